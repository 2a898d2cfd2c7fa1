"""A reduced kill torture (``benchmarks/kill_torture.py``): the CLI is SIGKILLed at a chosen moment,
resumed with ``--resume`` to completion, and every prompt must be trained once, every step logged
once, the final checkpoint must load, and no process of the run may survive the kill."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import kill_torture  # noqa: E402

# (index into kill_torture.CASES, what it must be): the first three cases of the full script
REDUCED = {
    0: ("sync", False, "checkpoint"),  # killed while its first checkpoint is written: resumes from scratch
    1: ("periodic", True, "train"),  # killed in a training micro-batch
    2: ("async", False, "generate"),  # killed while completions arrive
}


@pytest.mark.slow
@pytest.mark.parametrize("index", list(REDUCED), ids=["sync-first-checkpoint", "periodic+partial-train",
                                                      "async-generate"])
def test_killed_run_resumes_exactly(tmp_path, index):
    case = kill_torture.CASES[index]
    assert (case.mode, case.partial, case.kills[0].phase) == REDUCED[index]
    r = kill_torture.run_case(index, tmp_path, seed=0)
    assert r["kills"] == len(case.kills), r["notes"]
    assert r["passed"], json.dumps({k: r[k] for k in ("where", "checks", "notes", "resumed_from")}, indent=1,
                                   ensure_ascii=False) + "\n" + "\n".join(
        f"attempt {i} log tail:\n{a['log_tail']}" for i, a in enumerate(r["attempts"]) if a["log_tail"])
