"""The workspace demo's task set: small generated Python repositories, each with one bug that its problem
statement describes and hidden tests (its test patch) that catch it, in SWE-bench's instance format
(``relayrl.workspaces.tasks``). ``data.path=builtin:swe-demo`` (training) and ``builtin:swe-demo-eval``
(held out: other seeds, so other names and numbers) make their repositories on first use, under
``cache_folder()``; the same split always gives the same repositories and rows.

Each repository: ``<module>.py`` with three functions of the bug families below (one of them wrong), and
``tests/test_<module>.py`` testing the other two (the PASS_TO_PASS tests). The test patch adds
``tests/test_<function>.py`` (the FAIL_TO_PASS test). The fix is one line. ``content`` makes a repository's
files without git, for the warm start's scripted episodes (``relayrl.demo.swe_model``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import tempfile
from pathlib import Path

VERSION = 3
# The tests, without the plugins of the trainer's environment (pytest-randomly, hypothesis, ...: 1.3 s of each
# run here, for tests that need none of them).
TEST_CMD = "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -rA -p no:cacheprovider tests"
MODULES = ["mathutil", "helpers", "calc", "tools", "core", "ops", "basic", "util"]  # (none a standard module)
# (name, correct line, buggy line, call, expected, the statement's wrong value), with {a} {b} filled per repository
FAMILIES = [
    ("add_{s}", "return a + b", "return a - b", "({a}, {b})", "{a} + {b}", "{a} - {b}"),
    ("largest_{s}", "return max(xs)", "return min(xs)", "([{a}, {b}, {a} + {b}])", "{a} + {b}", "min({a}, {b})"),
    ("is_even_{s}", "return n % 2 == 0", "return n % 2 == 1", "({a} * 2)", "True", "False"),
    ("last_{s}", "return xs[-1]", "return xs[0]", "([{a}, {b}])", "{b}", "{a}"),
    ("double_{s}", "return n * 2", "return n * 3", "({a})", "{a} * 2", "{a} * 3"),
    ("count_{s}", "return len(xs)", "return len(xs) - 1", "([{a}] * {b})", "{b}", "{b} - 1"),
    ("negate_{s}", "return -n", "return n", "({a})", "-{a}", "{a}"),
    ("square_{s}", "return n * n", "return n + n", "({a})", "{a} * {a}", "{a} + {a}"),
]
SUFFIXES = ["value", "item", "number", "total", "result", "entry"]
ARG = {"add": "a, b", "largest": "xs", "is_even": "n", "last": "xs", "double": "n", "count": "xs", "negate": "n",
       "square": "n"}


def cache_folder() -> Path:
    return Path(tempfile.gettempdir()) / f"relayrl-{os.getuid()}" / f"swe-demo-v{VERSION}"


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_AUTHOR_DATE": "2026-01-01T00:00:00", "GIT_COMMITTER_DATE":
           "2026-01-01T00:00:00"}
    return subprocess.run(["git", "-c", "user.name=relayrl", "-c", "user.email=demo@relayrl", *args], cwd=repo, env=env,
                          check=True, capture_output=True, text=True).stdout.strip()


def content(rng: random.Random) -> dict:
    """One repository's files and task, from ``rng`` (no git): ``files`` (path -> text), ``test_file`` and
    ``test_body`` (what the test patch adds), ``statement``, ``fix`` (the file, the wrong function's first two
    lines and what they must become: one exact occurrence), ``hidden`` and ``visible`` (test ids)."""
    module = rng.choice(MODULES)
    fams = rng.sample(FAMILIES, 3)
    suffix = rng.choice(SUFFIXES)
    a, b = rng.randint(3, 9), rng.randint(3, 9)  # (3 and more: n + n != n * n)
    fill = {"a": a, "b": b, "s": suffix}
    names = [f[0].format(**fill) for f in fams]
    heads = [f"def {name}({ARG[name.rsplit('_', 1)[0]]}):" for name in names]
    src = [f"{head}\n    {wrong if i == 0 else right}\n" for i, (head, (_, right, wrong, *_)) in enumerate(zip(heads, fams))]
    old = [f"from {module} import {', '.join(names[1:])}\n"]
    for name, (_, _, _, call, expected, _) in zip(names[1:], fams[1:]):
        old.append(f"\n\ndef test_{name}():\n    assert {name}{call.format(**fill)} == {expected.format(**fill)}\n")
    name, (_, right, wrong, call, expected, wrong_value) = names[0], fams[0]
    shown = eval(wrong_value.format(**fill))  # noqa: S307 - our own arithmetic on small ints
    want = eval(expected.format(**fill))  # noqa: S307
    hidden = f"tests/test_{name}.py"
    return {"files": {f"{module}.py": "\n\n".join(src), f"tests/test_{module}.py": "".join(old)},
            "test_file": hidden, "test_body": f"from {module} import {name}\n\n\ndef test_{name}():\n    assert "
                                              f"{name}{call.format(**fill)} == {expected.format(**fill)}\n",
            "statement": f"`{name}{call.format(**fill)}` in `{module}.py` returns {shown!r}; it should return {want!r}. "
                         f"Fix `{name}`.",
            "fix": {"path": f"{module}.py", "old": f"{heads[0]}\n    {wrong}", "new": f"{heads[0]}\n    {right}"},
            "hidden": [f"{hidden}::test_{name}"], "visible": [f"tests/test_{module}.py::test_{n}" for n in names[1:]]}


def _make_one(folder: Path, rng: random.Random, iid: str) -> dict:
    c = content(rng)
    repo = folder / iid
    (repo / "tests").mkdir(parents=True)
    for path, text in c["files"].items():
        (repo / path).write_text(text)
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "initial")
    base_commit = _git(repo, "rev-parse", "HEAD")
    (repo / c["test_file"]).write_text(c["test_body"])
    _git(repo, "add", "-A")
    test_patch = _git(repo, "diff", "--cached", "HEAD") + "\n"
    _git(repo, "reset", "-q", "--hard", base_commit)
    return {"instance_id": iid, "repo": str(repo), "base_commit": base_commit, "problem_statement": c["statement"],
            "test_patch": test_patch, "FAIL_TO_PASS": c["hidden"], "PASS_TO_PASS": c["visible"], "test_cmd": TEST_CMD,
            "fix": c["fix"]}


def make_rows(n: int, seed: int, split: str) -> list[dict]:
    """The split's rows, its repositories made under ``cache_folder()`` the first time (atomically)."""
    folder = cache_folder() / f"{split}-{n}-{seed}"
    rows_file = folder / "rows.jsonl"
    if not rows_file.exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".new-"))
        try:
            rng = random.Random(seed)
            rows = [_make_one(tmp, rng, f"{split}-{i:04d}") for i in range(n)]
            text = "".join(json.dumps(r) + "\n" for r in rows)
            (tmp / "rows.jsonl").write_text(text.replace(str(tmp), str(folder)))
            os.rename(tmp, folder)
        except OSError:
            if not rows_file.exists():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return [json.loads(x) for x in rows_file.read_text().splitlines()]
