"""Resume always works, and refuses a change that would silently break it."""

import json
from pathlib import Path

import pytest

from relayrl.config import load_config
from relayrl.run.loop import ResumeError, train
from tests.test_e2e import EASY, _metrics


def _cfg(tiny_path, tmp_path, *extra):
    return load_config(None, EASY + [f"model.path={tiny_path}", f"run.output_dir={tmp_path}", "run.name=r",
                                     "run.steps=2", "run.save_every=2", *extra])


@pytest.mark.slow
@pytest.mark.parametrize("resume", [True, False])
def test_a_run_killed_in_its_first_checkpoint_starts_again_cleanly(tiny_path, tmp_path, resume):
    """Before: `--resume` said "no checkpoint", a plain re-run said "already has checkpoints", and
    the logs of the crashed attempt were appended to (step numbers repeated)."""
    run = tmp_path / "r"
    (run / "checkpoints" / ".tmp-step_000002").mkdir(parents=True)
    (run / "checkpoints" / ".tmp-step_000002" / "model.safetensors").write_bytes(b"half")
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"st')  # and a line cut by the kill
    (run / "trained_prompts.jsonl").write_text('{"step": 1, "prompt_ids": ["x"]}\n')
    summary = train(_cfg(tiny_path, tmp_path), resume=resume)
    assert summary["steps"] == 2
    assert [m["step"] for m in _metrics(run)] == [1, 2]
    assert [json.loads(x)["step"] for x in (run / "trained_prompts.jsonl").read_text().splitlines()] == [1, 2]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000002"]


@pytest.mark.slow
def test_resume_refuses_unsafe_changes_and_allows_safe_ones(tiny_path, tmp_path):
    rows = [json.loads(x) for x in Path(__file__).parent.joinpath("data_small.jsonl").read_text().splitlines()]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train(_cfg(tiny_path, tmp_path, f"data.path={data}"))
    run = tmp_path / "r"
    before = (run / "metrics.jsonl").read_text()
    with pytest.raises(ResumeError, match=r"run\.seed was 0 and is now 1"):
        train(_cfg(tiny_path, tmp_path, f"data.path={data}", "run.seed=1", "run.steps=3"), resume=True)
    with pytest.raises(ResumeError, match=r"trainer\.lr"):
        train(_cfg(tiny_path, tmp_path, f"data.path={data}", "trainer.lr=1e-3", "run.steps=3"), resume=True)
    with pytest.raises(ResumeError, match=r"env\.name was None and is now 'single_turn'"):
        train(_cfg(tiny_path, tmp_path, f"data.path={data}", "env.name=single_turn", "run.steps=3"), resume=True)
    rows[3]["prompt"] = "something else"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ResumeError, match="training data"):
        train(_cfg(tiny_path, tmp_path, f"data.path={data}", "run.steps=3"), resume=True)
    assert (run / "metrics.jsonl").read_text() == before  # a refused resume touches nothing
    rows[3]["prompt"] = json.loads(Path(__file__).parent.joinpath("data_small.jsonl").read_text()
                                   .splitlines()[3])["prompt"]
    moved = tmp_path / "moved.jsonl"  # the same data elsewhere is the same data
    moved.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = train(_cfg(tiny_path, tmp_path, f"data.path={moved}", "run.steps=3", "run.save_every=1"),
                    resume=True)
    assert summary["steps"] == 3 and [m["step"] for m in _metrics(run)] == [1, 2, 3]


def _children(pid: int) -> list[int]:
    return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.mark.slow
def test_engine_death_stops_the_run_with_a_clear_error_and_resume_continues(tmp_path):
    """Before, a dead engine process in async mode left the run waiting forever."""
    import os
    import signal
    import subprocess
    import sys
    import time

    args = ["data.eval_path=null", "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=64",
            "run.progress=false", "run.mode=async", f"run.output_dir={tmp_path}", "run.name=e", "run.steps=6",
            "run.save_every=2"]
    cmd = [sys.executable, "-m", "relayrl.cli", "train", *args]
    root = Path(__file__).parent.parent  # this checkout's src, whatever package the environment installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)])}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while not (tmp_path / "e" / "checkpoints" / "step_000002").exists():
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() is not None else ""
        time.sleep(0.05)
    engine = [c for c in _children(proc.pid) if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(engine) == 1
    os.kill(engine[0], signal.SIGKILL)
    t0 = time.time()
    _, err = proc.communicate(timeout=60)
    assert time.time() - t0 < 15, "the run noticed the dead engine late"
    assert proc.returncode == 1 and "Traceback" not in err, err
    assert any(ln.startswith("relayrl: ") and "engine process died (killed by SIGKILL)" in ln
               for ln in err.splitlines()), err
    done = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert [m["step"] for m in _metrics(tmp_path / "e")] == list(range(1, 7))


def test_a_run_name_taken_by_an_earlier_run_offers_a_free_name_first(tmp_path):
    """A guide's command run twice, or two examples with one name: the message offers a name that is free
    (runs/r-2 exists too: r-3), and --resume second, for the rarer case of continuing the earlier run."""
    from relayrl.run.resume import start_state

    for name in ("r", "r-2"):
        (tmp_path / name / "checkpoints" / "step_000040").mkdir(parents=True)
        (tmp_path / name / "checkpoints" / "step_000040" / "state.json").write_text("{}")
    cfg = load_config(None, [f"run.output_dir={tmp_path}", "run.name=r"])
    with pytest.raises(ResumeError, match=r"r already has checkpoints \(newest: step_000040\), from an earlier run of "
                                          r"this name: for a new run give it another name \(run\.name=r-3\); to "
                                          r"continue that one, pass --resume$"):
        start_state(cfg, False, print)
