"""The package's shape, kept by tests: no import circles among relayrl's modules, few modules at the
top, no long files, and the whole ``Config`` only where a run is assembled. The import graph is
built from the source's AST: every ``import``, at the top, inside a function, or under
``if TYPE_CHECKING:`` (a type a layer names is a dependency too, even if it never runs)."""

from __future__ import annotations

import ast
import gc
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "relayrl"
# where the whole Config may go: the command line, the assembly and the loops that drive it (relayrl train's and
# relayrl sft's), and resume (which compares a checkpoint's recorded config with the new one: the whole config by
# nature), and the Python entry point the command line is a layer over (relayrl.Run)
ASSEMBLY = {"relayrl.cli", "relayrl.run.api", "relayrl.run.build", "relayrl.run.loop", "relayrl.run.sft",
            "relayrl.run.resume"}



def parse(path: Path) -> ast.AST:
    """``ast.parse`` of a source file, with the garbage collector held off and once more on CPython 3.11's spurious
    "SystemError: AST constructor recursion depth mismatch" (seen once, in one shuffled order of the fast tier): the
    conversion keeps its depth in the interpreter's AST state, shared by every thread, so another thread parsing
    while this one's conversion runs Python code (a collection's finalizers, which may switch threads) throws the
    count off (cpython gh-106905)."""
    for attempt in range(3):
        gc.disable()  # (held off, not run first: a full collection per file took 29 s in a test's process)
        try:
            return ast.parse(path.read_text())
        except SystemError as e:
            if "recursion depth mismatch" not in str(e) or attempt == 2:
                raise
        finally:
            gc.enable()
    raise AssertionError("unreachable")

def modules(root: Path = PKG) -> dict[str, tuple[Path, bool]]:
    out = {}
    for p in root.rglob("*.py"):
        parts = list(p.relative_to(root.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (p, is_pkg)
    return out


def _runtime_nodes(tree: ast.AST):
    skip = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.If) and getattr(n.test, "id", getattr(n.test, "attr", None)) == "TYPE_CHECKING":
            skip.update(id(x) for s in n.body for x in ast.walk(s))
    return [n for n in ast.walk(tree) if id(n) not in skip]


def import_graph(root: Path = PKG) -> dict[str, set[str]]:
    """module -> the relayrl modules it imports (a name imported from a package counts as the
    submodule when there is one, else as the package)."""
    mods = modules(root)

    def resolve(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, (path, is_pkg) in mods.items():
        base = m if is_pkg else m.rpartition(".")[0]
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = base.split(".")[: len(base.split(".")) - node.level + 1]
                    mod = ".".join(parts + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                # a submodule imported by name counts as that module; any other name as the module it is in
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] == root.name and (r := resolve(target)) and r != m:
                    graph[m].add(r)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as a closed path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                found.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    found = cycles(import_graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_cycle_finder_finds_a_circle(tmp_path):
    pkg = tmp_path / "relayrl"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("from relayrl.a.x import f\n")
    (pkg / "a" / "x.py").write_text("def f():\n    from relayrl.b import g\n")
    (pkg / "b.py").write_text("from relayrl.a import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from relayrl import b\n")
    (pkg / "d.py").write_text("from relayrl import c\n")
    graph = import_graph(pkg)
    assert graph["relayrl.d"] == {"relayrl.c"} and graph["relayrl.c"] == {"relayrl.b"}
    assert cycles(graph) == [["relayrl.a.x", "relayrl.b"]]


def test_few_modules_at_the_top_and_no_long_files():
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= 8, f"{len(top)} modules directly in src/relayrl: {top}"
    long = {str(p.relative_to(SRC)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"files over 500 lines: {long}"


def test_the_whole_config_reaches_only_the_assembly():
    """Components take the sections they read (``RolloutCfg``, ``TrainerCfg``, an ``EngineSpec`` ...)."""
    takers = set()
    for m, (path, _) in modules().items():
        if m.startswith("relayrl.config"):
            continue
        for node in _runtime_nodes(parse(path)):
            if isinstance(node, ast.ImportFrom) and node.module == "relayrl.config" and \
                    any(a.name == "Config" for a in node.names):
                takers.add(m)
            if isinstance(node, ast.arg) and isinstance(node.annotation, (ast.Name, ast.Constant)) and \
                    getattr(node.annotation, "id", getattr(node.annotation, "value", None)) == "Config":
                takers.add(m)
    assert takers <= ASSEMBLY, f"the whole Config reaches {sorted(takers - ASSEMBLY)}"


def test_the_benchmarks_import_only_what_relayrl_has():
    """Every name a benchmark (or example) imports from relayrl exists (benchmarks/engines.py imported
    ``encode_prompt`` from ``relayrl.models`` after it moved, and stopped at its first line)."""
    import importlib

    missing = []
    for f in sorted([*(SRC.parent / "benchmarks").glob("*.py"), *(SRC.parent / "examples").glob("*.py")]):
        for n in ast.walk(parse(f)):
            if isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] == "relayrl":
                mod = importlib.import_module(n.module)
                for a in n.names:
                    if not hasattr(mod, a.name) and importlib.util.find_spec(f"{n.module}.{a.name}") is None:
                        missing.append(f"{f.name}: from {n.module} import {a.name}")
    assert not missing, missing


# The layers, lowest first: a module imports its own layer and those below it, never one above (the house's rule;
# the four imports that ran back up — demo → run, models → data, envs → rewards, and rewards → train before train
# was put below rewards — were moved where their users are). The modules at the top (records, failures, extras,
# fault_injection, lora_weights, files) are the floor; relayrl/__init__'s lazy `relayrl.Run` is not a layer.
LAYERS = ["demo", "algos", "config", "tracking", "models", "workers", "workspaces", "engine", "envs", "data", "train", "rewards",
          "rollout", "serve", "run", "cli"]


def test_no_import_runs_back_up_the_layers():
    def layer(m: str) -> int:
        parts = m.split(".")
        name = parts[1] if len(parts) > 1 else ""
        return LAYERS.index(name) if name in LAYERS else -1  # (the floor: the top-level modules)

    up = sorted(f"{a} -> {b}" for a, bs in import_graph().items() if a != "relayrl"
                for b in bs if layer(b) > layer(a))
    assert not up, f"imports that run back up the layers ({' < '.join(LAYERS)}): {up}"
