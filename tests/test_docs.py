"""The documentation is tested: the site builds with no warning, the generated configuration
reference lists every field of the schema, the troubleshooting page every error kind, and every
``relayrl ...`` command and YAML block of the README and the docs pages is valid (parsed by the
command line's own parser and loaded by ``load_config``). The README's commands run, in the reader's order,
in ``tests/test_docs_in_order.py``; ``tests/test_readme_env.py`` runs the environment guide's example as written.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from relayrl import cli
from relayrl.config import APPLIES_ONLY, Config, load_config
from relayrl.config.load import nested_fields

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]


def gen_config():
    spec = importlib.util.spec_from_file_location("gen_config", DOCS / "gen_config.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def blocks(page: Path, lang: str) -> list[str]:
    """The bodies of the page's fenced blocks in ``lang`` (indented blocks inside lists too)."""
    out = []
    for indent, body in re.findall(rf"^( *)```{lang}\n(.*?)^\1```", page.read_text(), re.DOTALL | re.MULTILINE):
        out.append("\n".join(line[len(indent):] for line in body.splitlines()))
    return out


def yaml_files(page: Path) -> dict[str, str]:
    """The page's YAML blocks that name their file on the first line (``# my.yaml — ...``)."""
    named = {}
    for body in blocks(page, "yaml"):
        m = re.match(r"#\s*(\S+\.ya?ml)\b", body)
        if m:
            named[m.group(1)] = body
    return named


def commands(page: Path) -> list[list[str]]:
    """Every ``relayrl ...`` command in the page's bash blocks, as argv after ``relayrl`` (lines joined
    at a trailing backslash, comments and ``...`` placeholders dropped; ``torchrun ... -m relayrl.cli``
    counts)."""
    out = []
    for body in blocks(page, "bash"):
        joined = re.sub(r"\\\n\s*", " ", body)
        for line in joined.splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:  # a heredoc's body
                continue
            words = [w for w in words if w != "..."]
            for i, w in enumerate(words):
                if w == "relayrl" or (w == "relayrl.cli" and i and words[i - 1] == "-m"):
                    out.append(words[i + 1:])
                    break
    return out


def validate(argv: list[str], folder: Path):
    """What ``relayrl`` does with the command before any work: its parser, and for train and eval the
    config (the YAML file, then the overrides) through ``load_config``."""
    if "--help" in argv or "-h" in argv:
        with contextlib.redirect_stdout(io.StringIO()) as out, pytest.raises(SystemExit) as done:
            cli._parser().parse_args(argv)
        assert done.value.code == 0 and "train" in out.getvalue()
        return None
    ns = cli._parser().parse_args(argv)
    if ns.cmd not in ("train", "eval"):
        return None
    config, overrides = cli._split(ns.args)
    if config is not None:
        config = str(folder / config) if (folder / config).exists() else str(ROOT / config)
        assert Path(config).exists(), f"{argv}: {config} is neither a YAML block of the page nor a file of the repo"
    extra = [f"eval.samples={ns.samples}"] if getattr(ns, "samples", None) else []
    return load_config(config, overrides + extra)


# ---- the site


def test_mkdocs_config_uses_the_generator_and_lists_every_page():
    text = (ROOT / "mkdocs.yml").read_text()
    conf = yaml.safe_load(text.replace("!!python", "#"))
    assert "docs/gen_config.py" in conf["hooks"]
    listed = set(re.findall(r":\s*(\S+\.md)\s*$", text, re.MULTILINE))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")} | {gen_config().PAGE}
    assert listed == pages, (listed ^ pages)


def test_the_site_builds_strict_with_no_warning(tmp_path):
    mkdocs = shutil.which("mkdocs") or pytest.skip("mkdocs is not installed: pip install -e '.[docs]'")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([mkdocs, "build", "--strict", "-d", str(tmp_path / "site")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "WARNING" not in done.stderr, done.stderr[-3000:]
    page = (tmp_path / "site" / "reference" / "config" / "index.html").read_text()
    for sec, name, _ in gen_config().fields():
        assert f'id="{sec}-{name.replace(".", "-")}"' in page, f"{sec}.{name}"


# ---- the configuration reference


def test_the_config_reference_lists_every_field_of_the_schema():
    g = gen_config()
    page = g.config_reference()
    listed = re.findall(r"^### `(\w+\.[\w.]+)`", page, re.MULTILINE)
    schema = [f"{sec}.{name}" for sec, info in Config.model_fields.items() for name, _ in nested_fields(info.annotation)]
    assert listed == schema  # every field, once, in the schema's order
    assert "model.lora.r" in schema  # (a section's own section, by its fields)
    parts = dict(zip(listed, re.split(r"^### `\w+\.[\w.]+`.*$", page, flags=re.MULTILINE)[1:]))
    for sec, name, f in g.fields():
        key, block = f"{sec}.{name}", parts[f"{sec}.{name}"]
        assert g.type_name(f.annotation) in block, key
        assert f"**Default** `{g.show(g.default_of(f))}`" in block, key
        assert g.escape(f.description or "") in block, key
        if key in APPLIES_ONLY:
            _, when, deciding = APPLIES_ONLY[key]
            assert g.escape(when) in block and all(f"`{d}`" in block for d in deciding), key
        else:
            assert "no mode or engine ignores it" in block, key
    for sec in Config.model_fields:
        assert f"\n## `{sec}`" in page


def test_every_field_the_docs_name_exists():
    """A `section.field` in backticks anywhere in the docs or the README is a field of the schema."""
    fields = {f"{sec}.{name}" for sec, name, _ in gen_config().fields()}
    subsections = {f.rpartition(".")[0] for f in fields if f.count(".") == 2}  # (a section's own: model.lora)
    fields |= subsections
    sections = set(Config.model_fields)
    unknown = set()
    for page in PAGES:
        for sec, name in re.findall(r"`(\w+)\.(\w+(?:\.\w+)?)(?:=[^`]*)?`", page.read_text()):
            if "." in name and f"{sec}.{name.partition('.')[0]}" not in subsections:
                continue  # (`run.loop.train`: a module's name, not a field)
            if sec in sections and f"{sec}.{name}" not in fields and name.rpartition(".")[2] not in ("py", "yaml", "jsonl", "json", "md", "pt"):
                unknown.add(f"{page.name}: {sec}.{name}")
    assert not unknown, sorted(unknown)


# ---- troubleshooting


def test_troubleshooting_lists_every_error_kind_with_its_exit_status():
    text = (DOCS / "reference" / "troubleshooting.md").read_text()
    rows = {m.group(1): int(m.group(2)) for m in re.finditer(r"^\| `([\w ]+)` \| (\d+) \|", text, re.MULTILINE)}
    assert rows == {kind: status for _, _, kind, status in cli.ERRORS}
    for module, name, _, _ in cli.ERRORS:
        assert name in text, name
    assert str(cli.INTERRUPTED) in text and str(cli.STOPPED) in text


# ---- commands and YAML blocks


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_yaml_block_loads_as_a_config(page, tmp_path):
    for body in blocks(page, "yaml"):
        f = tmp_path / "block.yaml"
        f.write_text(body)
        load_config(str(f), [])


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relayrl_command_is_valid(page, tmp_path):
    # a file a page names (`relayrl train my.yaml`) is its own YAML block of that name, else another page's
    named = {name: body for other in PAGES if other != page for name, body in yaml_files(other).items()}
    for name, body in {**named, **yaml_files(page)}.items():
        (tmp_path / name).write_text(body)
    for argv in commands(page):
        validate(argv, tmp_path)


def test_the_pages_have_commands_to_check():
    found = {p.name: len(commands(p)) for p in PAGES}
    assert found["README.md"] >= 4 and sum(found.values()) >= 30, found


def test_the_sites_search_finds_a_field_by_its_own_name():
    """The search plugin's separator splits `rollout.max_staleness` at its dot and keeps `max_staleness` whole (a
    query for the bare name found nothing); a decimal point stays."""
    conf = yaml.safe_load((ROOT / "mkdocs.yml").read_text().replace("!!python", "#"))
    sep = next(p["search"]["separator"] for p in conf["plugins"] if isinstance(p, dict) and "search" in p)
    tokens = [t for t in re.split(sep, "### `rollout.max_staleness` (default 3.5) EngineError") if t]
    assert {"rollout", "max_staleness", "3.5", "Engine", "Error"} <= set(tokens), tokens


def test_the_home_page_links_every_guide():
    text = (DOCS / "index.md").read_text()
    guides = sorted(p.name for p in (DOCS / "guides").glob("*.md"))
    assert [g for g in guides if f"(guides/{g})" not in text] == []
