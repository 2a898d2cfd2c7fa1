from pathlib import Path

import hypothesis  # (imported before any test, see below)
import pytest
import torch

from relayrl.demo import model as demo_model
from tests.tiers import (  # noqa: F401 (the suite's tiers and the fast tier's budget: pytest finds the hooks here)
    pytest_addoption,
    pytest_collection_modifyitems,
    pytest_runtest_makereport,
    pytest_terminal_summary,
)

# (hypothesis's pytest plugin imports hypothesis at the session's end when no test did; after a test whose episode
# loop was blocked and interrupted (test_failure_policy: SystemExit sent into that thread), CPython 3.11.7's AST
# compiler then fails on the import (gh-106905: "AST constructor recursion depth mismatch"), exit 1 on a run
# whose tests all passed. Imported here, it never compiles then.)

# Property tests draw the same examples every run (derandomize: a failure fails every run, not one in several), and
# keep no example database in the working folder.
hypothesis.settings.register_profile("relayrl", derandomize=True, database=None, deadline=None)
hypothesis.settings.load_profile("relayrl")

TINY = {"hidden_size": 32, "layers": 2, "heads": 2, "intermediate_size": 64, "vocab_size": 300}


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    """A tiny random Llama + demo tokenizer saved with save_pretrained (no SFT)."""
    path = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    recipe = {**demo_model.RECIPE, **TINY}
    tok = demo_model.build_tokenizer(recipe["seed"], recipe["vocab_size"])
    model = demo_model.build_model(tok, recipe)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture()
def tiny(tiny_path):
    from relayrl.models import load_policy, load_tokenizer

    return load_policy(tiny_path), load_tokenizer(tiny_path)


def _working_folder(cwd: Path) -> dict[str, int | None]:
    """What a test could leave in the folder pytest runs in (a user's clone, where `relayrl train` keeps
    runs/): its entries (not dot-files: hypothesis keeps its examples in .hypothesis/), and two levels
    under runs/ with their modification times (a run's folder, its files and checkpoints/)."""
    seen: dict[str, int | None] = {p.name: None for p in cwd.iterdir() if not p.name.startswith(".")}
    runs = cwd / "runs"
    if runs.is_dir():
        for p in [*runs.glob("*"), *runs.glob("*/*")]:
            seen[str(p.relative_to(cwd))] = p.stat().st_mtime_ns
    return seen


@pytest.fixture(autouse=True)
def _leaves_the_working_folder_alone():
    """Tests never write in the working folder: a run of a test with the default run.output_dir would
    write into (or stop on) the user's own runs/demo. Every test writes under its tmp_path."""
    cwd = Path.cwd()
    before = _working_folder(cwd)
    yield
    after = _working_folder(cwd)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k, -1) != after.get(k, -1))
    assert not changed, f"the test wrote in the working folder {cwd}: {changed[:5]}"
