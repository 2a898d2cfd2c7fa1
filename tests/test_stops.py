"""Long runs off a terminal and the stops schedulers send: a plain progress line every run.log_every_s
under nohup, slurm or a pipe; SIGTERM and SIGUSR1 finish the step, save it, print the resume command,
and the resumed run trains what an uninterrupted one does."""

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console

from relayrl.config import load_config
from relayrl.run import loop
from relayrl.run.loop import train
from relayrl.run.stops import StopRequested, StopSignals
from relayrl.tracking import ProgressBar

SMALL = ["rollout.budget=fixed", "rollout.dynamic_sampling=false", "data.eval_path=null", "rollout.max_new_tokens=8",
         "rollout.prompts_per_step=2", "rollout.group_size=2", "run.save_every=0", "run.threads=1",
         "reward.fn=tests.rewards_for_tests:digit_fraction"]


class Clock:
    """time.monotonic for a ProgressBar: the given times in turn, then the last one again."""

    def __init__(self, *times):
        self.times = list(times)

    def __call__(self):
        return self.times.pop(0) if len(self.times) > 1 else self.times[0]


def _step(reward=0.25, tokens=40):
    return {"reward_mean": reward, "response_len_mean": 7.5, "response_len_max": 8, "generated_tokens": tokens}


def test_off_a_terminal_a_plain_line_comes_every_log_every_s(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(time, "monotonic", Clock(0.0, 10.0, 31.0, 40.0, 70.0))  # start, then each step's end
    with ProgressBar(total=10, start=2, enabled=True, console=Console(file=out, width=200), every_s=30) as bar:
        for _ in range(4):
            bar.update(_step())
    lines = out.getvalue().splitlines()
    # one line past 30 s (step 4 of 10 at 0:31: 2 steps in 31 s, 6 to go; 80 tokens), the next 30 s after it
    assert lines == ["step 4/10  reward 0.250  len 8/8  3 tok/s  elapsed 0:31  eta 1:33",
                     "step 6/10  reward 0.250  len 8/8  2 tok/s  elapsed 1:10  eta 1:10"], lines


def test_no_lines_with_log_every_s_zero_and_no_bar_lines_on_a_terminal(monkeypatch):
    for every, terminal in ((0, False), (30, True)):
        out = io.StringIO()
        monkeypatch.setattr(time, "monotonic", Clock(0.0, 100.0, 200.0))
        with ProgressBar(total=5, start=0, enabled=True, console=Console(file=out, force_terminal=terminal,
                                                                         width=200), every_s=every) as bar:
            bar.update(_step())
            bar.update(_step())
        assert "elapsed" not in out.getvalue(), (every, terminal, out.getvalue())


def test_the_last_step_of_a_run_does_not_show_zero_tokens_per_second(monkeypatch):
    """tok/s over the steps this process ran: an async run's last step may generate nothing."""
    out = io.StringIO()
    monkeypatch.setattr(time, "monotonic", Clock(0.0, 40.0, 80.0))
    with ProgressBar(total=2, start=0, enabled=False, console=Console(file=out, width=200), every_s=30) as bar:
        bar.update(_step(tokens=800))
        bar.update(_step(tokens=0))
    assert out.getvalue().splitlines()[-1].startswith("step 2/2  reward 0.250  len 8/8  10 tok/s"), out.getvalue()


def test_a_sigterm_finishes_the_step_saves_it_and_stops(tiny_path, tmp_path, monkeypatch):
    """In process: the signal arrives during step 2; step 2 is written and checkpointed, then StopRequested."""
    checked = loop.check_sampling

    def signalled(m, alarm, version):
        if m["step"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return checked(m, alarm, version)

    monkeypatch.setattr(loop, "check_sampling", signalled)
    before = signal.getsignal(signal.SIGTERM)
    threads = torch.get_num_threads()
    cfg = load_config(None, SMALL + [f"model.path={tiny_path}", f"run.output_dir={tmp_path}", "run.steps=50",
                                     "run.name=r", "run.log_every_s=0"])
    try:
        with pytest.raises(StopRequested, match="stopped by SIGTERM after step 2, its checkpoint saved"):
            train(cfg)
    finally:
        torch.set_num_threads(threads)
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is put back
    run = tmp_path / "r"
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000002"]
    assert not (run / "summary.json").exists()  # not finished: resumed later



def test_a_step_that_fails_after_a_stop_signal_stops_as_asked(tiny_path, tmp_path, monkeypatch):
    """slurm's SIGTERM to every process of the job can end a verifier's or an engine's process mid-step:
    that step fails, is not trained, and the run stops as the signal asked (not as a user code error)."""
    taken = loop.take_failures

    def killed(groups, state, cfg):
        if state.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            raise loop.failures.UserCodeError("step 3: the worker pool's server died")
        return taken(groups, state, cfg)

    monkeypatch.setattr(loop, "take_failures", killed)
    threads = torch.get_num_threads()
    cfg = load_config(None, SMALL + [f"model.path={tiny_path}", f"run.output_dir={tmp_path}", "run.steps=50",
                                     "run.name=r", "run.log_every_s=0", "run.save_every=1"])
    try:
        with pytest.raises(StopRequested, match="after step 2") as e:
            train(cfg)
    finally:
        torch.set_num_threads(threads)
    assert isinstance(e.value.__cause__, loop.failures.UserCodeError)
    run = tmp_path / "r"
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000001", "step_000002"]

def test_a_stop_signal_before_the_first_step_stops_at_once_and_a_second_one_too():
    with StopSignals() as stop:
        with pytest.raises(KeyboardInterrupt):  # nothing to finish: as Ctrl-C
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(1)
        stop.armed = True
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.01)
        assert stop.signum == signal.SIGUSR1
        with pytest.raises(KeyboardInterrupt):  # the second: stop now
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)


def _cli(args: list[str], stdout=subprocess.PIPE) -> subprocess.Popen:
    root = Path(__file__).parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)])}
    return subprocess.Popen([sys.executable, "-m", "relayrl.cli", "train", *args], env=env, text=True,
                            stdout=stdout, stderr=subprocess.PIPE, start_new_session=True)


@pytest.mark.slow
def test_kill_term_under_a_pipe_prints_lines_and_the_resume_command_and_the_resumed_run_equals_an_uninterrupted_one(
        tiny_path, tmp_path):
    """As slurm stops a job: SIGTERM to every process of the run (its process group), stdout a file (nohup's)."""
    from safetensors.torch import load_file

    base = SMALL + [f"model.path={tiny_path}", f"run.output_dir={tmp_path}", "run.log_every_s=0.2"]
    stopped = base + ["run.name=stopped"]
    log = tmp_path / "nohup.out"
    with log.open("w") as f:
        p = _cli(stopped + ["run.steps=200"], stdout=f)
    metrics, deadline = tmp_path / "stopped" / "metrics.jsonl", time.monotonic() + 240
    try:  # past a plain progress line and 3 steps
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3 and "/200  reward" in log.read_text()):
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.05)
        os.killpg(p.pid, signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 143, err
    k = len(metrics.read_text().splitlines())
    assert err.strip().splitlines() == [
        f"relayrl: stopped by SIGTERM after step {k}; the last complete checkpoint is "
        f"{tmp_path / 'stopped' / 'checkpoints' / f'step_{k:06d}'} (step {k}); resume with: relayrl train "
        + " ".join(stopped + ["run.steps=200"]) + " --resume"], err
    assert re.search(r"^step \d+/200  reward \d\.\d{3}  len \d+/\d+  \d+ tok/s  elapsed 0:\d\d  eta \d+:\d\d",
                     log.read_text(), re.MULTILINE), log.read_text()
    n = k + 2
    resumed = _cli(stopped + [f"run.steps={n}", "--resume"])
    whole = _cli(base + ["run.name=whole", f"run.steps={n}"])
    for q in (resumed, whole):
        assert q.wait(timeout=300) == 0, q.communicate()

    def trained(name):
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return ([(r["step"], r["reward_mean"], r["loss"], r["generated_tokens"]) for r in rows],
                load_file(tmp_path / name / "checkpoints" / f"step_{n:06d}" / "model.safetensors"))

    (ms, ws), (mw, ww) = trained("stopped"), trained("whole")
    assert ms == mw and [r[0] for r in ms] == list(range(1, n + 1)), (k, ms, mw)
    assert all(torch.equal(ws[key], ww[key]) for key in ww)
