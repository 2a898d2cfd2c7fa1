"""A reduced kill torture (``benchmarks/kill_torture.py``): the CLI is SIGKILLed at a chosen moment,
resumed with ``--resume`` to completion, and every prompt must be trained once, every step logged
once, the final checkpoint must load, and no process of the run may survive the kill."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import kill_torture  # noqa: E402

# (index into kill_torture.CASES, what it must be): the first three cases of the full script, and the
# first one with a critic
REDUCED = {
    0: ("sync", False, "checkpoint", ()),  # killed while its first checkpoint is written: resumes from scratch
    1: ("periodic", True, "train", ()),  # killed in a training micro-batch
    2: ("async", False, "generate", ()),  # killed while completions arrive
    20: ("async", True, "train", kill_torture.CRITIC),  # with a critic, in a training micro-batch
    22: ("sft", False, "train", ()),  # relayrl sft, killed in a step: the same losses and weights as never killed
}


@pytest.mark.slow
@pytest.mark.parametrize("index", list(REDUCED), ids=["sync-first-checkpoint", "periodic+partial-train",
                                                      "async-generate", "async+partial+critic-train", "sft-train"])
def test_killed_run_resumes_exactly(tmp_path, index):
    case = kill_torture.CASES[index]
    assert (case.mode, case.partial, case.kills[0].phase, case.extra) == REDUCED[index]
    r = kill_torture.run_case(index, tmp_path, seed=0)
    assert r["kills"] == len(case.kills), r["notes"]
    assert ("critic" in r["checks"]) == bool(case.extra)
    assert ("exact" in r["checks"]) == (case.command == "sft")
    assert r["passed"], json.dumps({k: r[k] for k in ("where", "checks", "notes", "resumed_from")}, indent=1,
                                   ensure_ascii=False) + "\n" + "\n".join(
        f"attempt {i} log tail:\n{a['log_tail']}" for i, a in enumerate(r["attempts"]) if a["log_tail"])


ADAPTIVE = ["data.selection=vade", "data.selection_key=terms", "rollout.budget=adaptive", "rollout.dynamic_sampling=true"]


@pytest.mark.slow
def test_killed_run_with_selection_and_budgets_resumes_exactly(tmp_path):
    """Case 6 (async + partial, killed in a training micro-batch) with prompt selection, adaptive budgets and
    dynamic sampling: posteriors, the epoch's passed-over prompts, budget windows and filtered prompts
    travel with the checkpoint; every prompt drawn is trained, carried or filtered once."""
    r = kill_torture.run_case(5, tmp_path, seed=0, extra=ADAPTIVE)
    assert r["kills"] == 1, r["notes"]
    assert r["passed"], json.dumps({k: r[k] for k in ("where", "checks", "notes", "resumed_from")}, indent=1,
                                   ensure_ascii=False)


AGENT = ["model.path=builtin:agent-demo", "data.path=builtin:agent-demo", "reward.fn=math",
         f"env.name=agent:{Path(__file__).resolve().parent.parent / 'examples' / 'openai_agent.py'}:run",
         "env.max_turns=3", "env.max_tokens=128", "rollout.max_new_tokens=48"]


@pytest.mark.slow
def test_killed_run_of_an_agent_program_resumes_exactly(tmp_path):
    """Case 6 (async + partial rollouts, SIGKILLed in a training micro-batch while endpoint episodes'
    requests are in flight) with the OpenAI-SDK agent program (examples/openai_agent.py): the resume starts
    from a checkpoint, where an episode that was running restarts from its prompt and a finished one is
    carried with its tokens; every prompt is trained once, every step logged once, no process survives."""
    r = kill_torture.run_case(5, tmp_path, seed=0, extra=AGENT)
    assert r["kills"] == 1 and r["resumed_from"][0].isdigit(), r["notes"]
    assert r["passed"], json.dumps({k: r[k] for k in ("where", "checks", "notes", "resumed_from")}, indent=1,
                                   ensure_ascii=False) + "\n" + "\n".join(
        f"attempt {i} log tail:\n{a['log_tail']}" for i, a in enumerate(r["attempts"]) if a["log_tail"])


WORKSPACE = ["data.path=builtin:swe-demo", "env.name=workspace", "env.max_turns=2", "rollout.group_size=2",
             "rollout.max_new_tokens=32", "rollout.dynamic_sampling=false", "rollout.budget=fixed"]  # (all 0: nothing to filter)


@pytest.mark.slow
def test_killed_run_of_workspace_episodes_resumes_with_no_workspace_left(tmp_path):
    """Case 6 (async + partial rollouts, SIGKILLed in a training micro-batch) on workspace tasks
    (env.name=workspace, builtin:swe-demo): episodes have sandboxes and test runs in flight when the kill
    lands; no process of the run survives it (bwrap, the keepers and their commands carry the run's marker or
    die with their sandbox), and every prompt is trained once after the resume."""
    r = kill_torture.run_case(5, tmp_path, seed=0, extra=WORKSPACE)
    assert r["kills"] == 1, r["notes"]
    assert r["passed"], json.dumps({k: r[k] for k in ("where", "checks", "notes", "resumed_from")}, indent=1,
                                   ensure_ascii=False) + "\n" + "\n".join(
        f"attempt {i} log tail:\n{a['log_tail']}" for i, a in enumerate(r["attempts"]) if a["log_tail"])


# ---------------------------------------------------------------- re-planning a kill that cannot land (fast)


def _scripted(monkeypatch, outcomes: list[str]) -> list[dict]:
    """``run_case`` with ``run_attempt`` replaced: each try draws its moment as the real one does and
    ends as ``outcomes`` says ('done': ran to completion before its kill, 'killed', 'error': exit 1);
    tries beyond the list complete. The checks of the run directory are stubbed (no CLI runs)."""
    seen: list[dict] = []

    def run_attempt(cmd, env, run_dir, log, kill, rng, resume, timeout, grace, marker):
        n = rng.randint(int(kill.lo), int(kill.hi)) if kill is not None else 0
        seen.append({"range": (kill.lo, kill.hi) if kill else None, "n": n,
                     "found": (run_dir / "progress").read_text() if (run_dir / "progress").exists() else None})
        outcome = outcomes[len(seen) - 1] if len(seen) <= len(outcomes) else "done"
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "progress").write_text(f"try {len(seen)}: {outcome}")
        rc = {"done": 0, "killed": -9, "error": 1}[outcome]
        return kill_torture.Attempt(kill=f"{kill.phase} #{n}" if kill else "", drawn=n, rc=rc, killed=rc == -9,
                                    landed="somewhere" if rc == -9 else "", seconds=1.0, procs_seen=1,
                                    expected_from="scratch" if resume else "")

    monkeypatch.setattr(kill_torture, "run_attempt", run_attempt)
    for check in ("check_once", "check_steps", "check_loads"):
        monkeypatch.setattr(kill_torture, check, lambda run_dir, steps: (True, ""))
    monkeypatch.setattr(kill_torture, "marked_processes", lambda marker: [])
    return seen


def test_a_kill_that_cannot_land_is_replanned_earlier_from_the_same_run_directory(tmp_path, monkeypatch):
    seen = _scripted(monkeypatch, ["done", "killed", "done"])
    r = kill_torture.run_case(1, tmp_path, seed=0)  # periodic+partial, fault("train", 3, 6)
    first = seen[0]["n"]
    expected = kill_torture.replan(kill_torture.CASES[1].kills[0], kill_torture.Attempt("", drawn=first), 0)
    assert seen[1]["range"] == (expected.lo, expected.hi) and seen[1]["n"] < first
    assert seen[1]["found"] is None  # the run directory put back as before the try (none yet)
    assert seen[2]["found"] == "try 2: killed"  # the resume sees what the landed kill left
    assert r["passed"] and r["kills"] == 1 and r["replans"] == 1 and not r["untested"], r["notes"]
    (miss,) = r["attempts"][0]["replans"]
    assert miss["kill"] == f"train #{first}" and miss["replanned"] == kill_torture.describe_kill(expected)
    assert any("re-planned" in n for n in r["notes"])
    assert "re-planned ×1" in r["where"]
    again = _scripted(monkeypatch, ["done", "killed", "done"])
    kill_torture.run_case(1, tmp_path, seed=0)
    assert again == seen  # deterministic from the seed


def test_a_kill_that_lands_after_the_final_checkpoint_is_replanned_when_more_kills_follow(tmp_path, monkeypatch):
    """A kill landing once the last checkpoint is written leaves the next planned kill nothing to land
    in (the resume has no step left): that kill is drawn again, earlier, from the same run directory."""
    case = next(i for i, c in enumerate(kill_torture.CASES) if len(c.kills) >= 2)
    steps_dir = tmp_path / f"case{case + 1:02d}" / "checkpoints" / f"step_{kill_torture.STEPS:06d}"
    seen: list = []

    def run_attempt(cmd, env, run_dir, log, kill, rng, resume, timeout, grace, marker):
        seen.append(kill)
        late = len(seen) == 1  # the first try is killed past the final checkpoint, every later one in time
        run_dir.mkdir(parents=True, exist_ok=True)
        if late:
            steps_dir.mkdir(parents=True)
            (steps_dir / "state.json").write_text("{}")
        rc = -9 if kill is not None else 0
        return kill_torture.Attempt(kill="k" if kill else "", drawn=kill_torture.STEPS if late else 1, rc=rc,
                                    killed=rc == -9, landed="x" if rc else "", seconds=1.0, procs_seen=1,
                                    expected_from="scratch" if resume else "")

    monkeypatch.setattr(kill_torture, "run_attempt", run_attempt)
    monkeypatch.setattr(kill_torture, "last_logged_step", lambda run_dir: kill_torture.STEPS)
    for check in ("check_once", "check_steps", "check_loads"):
        monkeypatch.setattr(kill_torture, check, lambda run_dir, steps: (True, ""))
    monkeypatch.setattr(kill_torture, "marked_processes", lambda marker: [])
    r = kill_torture.run_case(case, tmp_path, seed=0)
    assert r["replans"] == 1 and not steps_dir.exists()  # re-run from the run directory put back as it was
    assert len(seen) == len(kill_torture.CASES[case].kills) + 2 and r["passed"], r["notes"]
    assert any("landed after the final checkpoint" in n for n in r["notes"])


def test_a_kill_that_never_lands_leaves_the_case_untested_not_failed(tmp_path, monkeypatch):
    seen = _scripted(monkeypatch, ["done"] * 10)
    r = kill_torture.run_case(1, tmp_path, seed=0)
    assert len(seen) == kill_torture.MAX_REPLANS + 1  # bounded
    assert all(b["n"] < a["n"] for a, b in zip(seen, seen[1:]) if a["n"] > 1)
    assert r["passed"] and r["kills"] == 0 and r["replans"] == kill_torture.MAX_REPLANS and r["untested"]
    assert kill_torture.row(r)[4] == "0 of 1"


def test_an_attempt_that_fails_instead_of_being_killed_is_not_replanned(tmp_path, monkeypatch):
    seen = _scripted(monkeypatch, ["error"])
    r = kill_torture.run_case(1, tmp_path, seed=0)
    assert len(seen) == 1 and not r["passed"] and not r["checks"]["exit 0"] and r["replans"] == 0


def test_replan_draws_earlier_moments():
    K, A = kill_torture, kill_torture.Attempt
    assert K.replan(K.fault("generate", 33, 90), A("", drawn=50), 0) == K.fault("generate", 33, 49)
    assert K.replan(K.fault("checkpoint", 2), A("", drawn=2), 0) == K.fault("checkpoint", 1, 1)
    assert K.replan(K.fault("checkpoint", 1), A("", drawn=1), 0) is None  # the phase was never reached
    w = K.replan(K.wall(0.5, 8.0), A("", drawn=7.0, seconds=5.0), 0)
    assert w.hi == pytest.approx(4.5) and w.lo == 0.5
    a = K.replan(K.after_step(1, 4), A("", drawn=3, delay=1.2), logged=2)  # resumed near the end: +3 never came
    assert (a.lo, a.hi, a.delay_hi) == (1, 1, 1.5)
    a = K.replan(K.after_step(1, 4), A("", drawn=1, delay=1.2), logged=2)  # logged +1, exited within the delay
    assert (a.lo, a.hi, a.delay_hi) == (1, 1, 0.6)


@pytest.mark.slow
def test_killed_run_with_a_lora_adapter_resumes_exactly(tmp_path):
    """Case 2 (periodic + partial, SIGKILLed in a training micro-batch) with model.lora.r=4: the adapter (PEFT's
    files) and its optimiser state travel with the checkpoint, the engine process starts from the base and takes
    the checkpoint's adapter; the final checkpoint loads with from_pretrained (transformers reads PEFT's files)."""
    r = kill_torture.run_case(1, tmp_path, seed=0, extra=["model.lora.r=4"])
    assert r["kills"] == 1, r["notes"]
    assert r["passed"], json.dumps({k: r[k] for k in ("where", "checks", "notes", "resumed_from")}, indent=1,
                                   ensure_ascii=False) + "\n" + "\n".join(
        f"attempt {i} log tail:\n{a['log_tail']}" for i, a in enumerate(r["attempts"]) if a["log_tail"])
