"""run.report_to: every tracker, through its own library, offline, read back with its own reader
(``tracker_readers``) equals metrics.jsonl; a killed run resumed continues the same tracker runs; a
tracker that cannot start is one line at start, exit status 2, nothing written; one that fails
mid-run is turned off and the run goes on."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from relayrl.cli import main
from relayrl.tracking.trackers import TrackerContext, Trackers, scalars
from tests import tracker_readers as read

ALL = "run.report_to=[tensorboard,wandb,mlflow,trackio,swanlab]"
TINY_RUN = ["reward.fn=tests.rewards_for_tests:digit_fraction", "rollout.max_new_tokens=8",
            "rollout.prompts_per_step=4", "rollout.group_size=4", "trainer.lr=2e-2", "trainer.warmup_steps=0",
            "run.progress=false", "data.eval_path=null"]
EVAL = ["data.eval_path=builtin:demo-eval", "eval.size=8"]
ONLINE = ["WANDB_MODE", "MLFLOW_TRACKING_URI", "SWANLAB_MODE", "TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL"]


@pytest.fixture(scope="session")
def trackio_dir(tmp_path_factory) -> Path:
    """trackio reads TRACKIO_DIR once, when first imported: one folder for this session's runs."""
    if "trackio" not in sys.modules:
        os.environ["TRACKIO_DIR"] = str(tmp_path_factory.mktemp("trackio"))
    from trackio.utils import TRACKIO_DIR

    return Path(TRACKIO_DIR)


@pytest.fixture()
def offline(monkeypatch):
    """The defaults: no tracker told to go online by the environment."""
    for name in ONLINE:
        monkeypatch.delenv(name, raising=False)


def _metrics(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: scalars(r) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def _same(got: dict, want: dict[int, dict], steps, who: str, float32: bool = False) -> None:
    """Every metric of each of ``steps`` in ``got`` ({key: {step: value}}) equals metrics.jsonl's
    (``float32``: as rounded to float32, what TensorBoard's scalar summaries hold)."""
    import numpy as np

    want = {s: {k: float(np.float32(v)) if float32 else v for k, v in m.items()} for s, m in want.items()}
    bad = [(k, s, got.get(k, {}).get(s), v) for s in steps for k, v in want[s].items()
           if not (s in got.get(k, {}) and (got[k][s] == v or (math.isnan(v) and math.isnan(got[k][s]))))]
    assert not bad, f"{who}: {len(bad)} values differ from metrics.jsonl, e.g. (key, step, got, want) {bad[:4]}"


@pytest.mark.slow
def test_every_tracker_reads_back_what_metrics_jsonl_has(tiny_path, tmp_path, trackio_dir, offline):
    project = f"p-{tmp_path.name}"
    assert main(["train", *TINY_RUN, *EVAL, f"model.path={tiny_path}", f"run.output_dir={tmp_path}", "run.name=tracked",
                 "run.steps=3", "run.save_every=2", "eval.every=2", ALL, f"run.project={project}"]) == 0
    run = tmp_path / "tracked"
    want, summary = _metrics(run), json.loads((run / "summary.json").read_text())
    assert sorted(want) == [1, 2, 3] and "eval/accuracy" in want[2] and "staleness_hist/0" in want[3]
    before = {f"eval/{k}": v for k, v in scalars(summary["eval_before"]).items()}
    want_all = {0: before, **want}  # the evaluation before training goes to the trackers at step 0
    saved = json.loads((run / "trackers.json").read_text())

    tb, ea = read.tensorboard(run / "tensorboard")
    _same(tb, want_all, [0, 1, 2, 3], "tensorboard", float32=True)
    assert read.tensorboard_hparams(ea)["rollout.group_size"] == 4
    assert {"pictures/curves", "pictures/timeline"} <= set(ea.Tags()["images"])
    assert tb["final/eval_accuracy_after"][3] == pytest.approx(summary["eval_accuracy_after"], rel=1e-7)  # (float32)

    (folder,) = (run / "wandb").glob("offline-run-*")  # offline by default
    records = read.wandb_records(next(folder.glob("run-*.wandb")))
    hist = read.wandb_history(records)
    _same(hist, want_all, [0, 1, 2, 3], "wandb")
    (run_rec,) = [r["run"] for r in records if r["type"] == "run"]
    assert run_rec["run_id"] == saved["wandb"]["id"] and run_rec["config"]["update"]["rollout"]["group_size"] == 4
    final = {k: v for r in records if r["type"] == "summary" for k, v in r["summary"]["update"].items()}
    assert final["eval_accuracy_after"] == summary["eval_accuracy_after"]
    assert (folder / "files" / hist["pictures/curves.path"][3]).is_file()

    assert saved["mlflow"]["tracking_uri"] == f"sqlite:///{(run / 'mlflow.db').resolve()}"  # a local store
    ml, params, artifacts, ml_run = read.mlflow_run(saved["mlflow"]["tracking_uri"], saved["mlflow"]["run_id"])
    _same(ml, want_all, [0, 1, 2, 3], "mlflow")
    assert params["rollout.group_size"] == "4" and params["run.report_to"] == json.dumps(
        ["jsonl", "tensorboard", "wandb", "mlflow", "trackio", "swanlab"])
    assert {"config.yaml", "pictures/curves.png", "pictures/timeline.png"} <= set(artifacts)
    assert ml_run.info.status == "FINISHED" and ml["final/eval_accuracy_after"][3] == summary["eval_accuracy_after"]

    tio, rows = read.trackio_logs(project, saved["trackio"]["id"])
    _same(tio, want_all, [0, 1, 2, 3], "trackio")
    assert read.trackio_config(project, "tracked", saved["trackio"]["id"])["rollout"]["group_size"] == 4
    assert tio["pictures/curves"][3]["_type"] == "trackio.image"

    (folder,) = (run / "swanlog").glob("run-*")
    records = read.swanlab_records(folder)
    _same(read.swanlab_scalars(records), want_all, [0, 1, 2, 3], "swanlab")
    assert {r["media"]["key"] for r in records if "media" in r} == {"pictures/curves", "pictures/timeline"}
    config = yaml.safe_load((folder / "files" / "config.yaml").read_text())
    assert config["rollout"]["value"]["group_size"] == 4

    assert (run / "curves.png").stat().st_size > 20_000 and (run / "timeline.png").is_file()
    from huggingface_hub import ModelCard

    card = ModelCard.load(run / "checkpoints" / "step_000003" / "README.md")
    values = {r.metric_name: r.metric_value for r in card.data.eval_results}
    assert values["held-out accuracy after training (sampled, T=1.0; reward ≥ 1)"] == \
        round(summary["eval_accuracy_after"], 4)
    assert values["held-out accuracy before training (greedy; reward ≥ 1)"] == \
        round(summary["eval_greedy_accuracy_before"], 4)
    assert "`rollout.group_size` | `4`" in card.text and "step 3 of 3" in card.text
    early = (run / "checkpoints" / "step_000002" / "README.md").read_text()
    assert "intermediate checkpoint" in early and "after training" not in ModelCard(early).data.to_yaml()


def _run_cli(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "relayrl.cli", "train", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@pytest.mark.slow
def test_resume_continues_the_same_tracker_runs(tiny_path, tmp_path, trackio_dir, offline):
    """Killed (SIGKILL, by its fault point) while writing the checkpoint of step 4, with steps 3 and 4
    logged past the checkpoint of step 2, then --resume: the trackers continue their runs, and
    what they hold equals the trimmed metrics.jsonl (TensorBoard: its purge hides the killed
    attempt's steps 3 and 4)."""
    project = f"p-{tmp_path.name}"
    run = tmp_path / "killed"
    args = [*TINY_RUN, f"model.path={tiny_path}", f"run.output_dir={tmp_path}", "run.name=killed", "run.steps=5",
            "run.save_every=2", ALL, f"run.project={project}"]
    root = str(Path(__file__).parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
           "TRACKIO_DIR": str(trackio_dir)}
    # (an in-process W&B run earlier in this session left its service in WANDB_SERVICE: a child would share
    # it, and the service would keep the killed child's run open; a run on its own has its own service)
    env.pop("WANDB_SERVICE", None)
    cmd = [sys.executable, "-m", "relayrl.cli", "train", *args]
    killed = subprocess.run(cmd, env={**env, "RELAYRL_KILL_AT": "checkpoint:2"}, capture_output=True, text=True,
                            timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not (run / "checkpoints" / "step_000004").exists()
    killed = _metrics(run)
    assert sorted(killed)[:4] == [1, 2, 3, 4]
    first = json.loads((run / "trackers.json").read_text())
    done = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    want = _metrics(run)
    assert sorted(want) == [1, 2, 3, 4, 5] and want[3] != killed[3]  # step 3 was logged again
    saved = json.loads((run / "trackers.json").read_text())
    same_ids = ("wandb", "mlflow", "swanlab")
    assert {k: saved[k] for k in same_ids} == {k: first[k] for k in same_ids}
    assert saved["trackio"]["id"] == first["trackio"]["id"]

    tb, _ = read.tensorboard(run / "tensorboard")  # the same folder; purge_step hid the killed attempt's step 3
    _same(tb, want, [1, 2, 3, 4, 5], "tensorboard", float32=True)
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 2

    folders = sorted((run / "wandb").glob("offline-run-*"), key=lambda p: p.stat().st_mtime)
    assert len(folders) == 2 and all(f.name.endswith(saved["wandb"]["id"]) for f in folders)
    resumed = read.wandb_records(next(folders[1].glob("run-*.wandb")))
    assert [r["run"]["resume"] for r in resumed if r["type"] == "run"] == [True]
    hist = read.wandb_history(resumed)
    assert min(hist["reward_mean"]) == 3
    _same(hist, want, [3, 4, 5], "wandb, the resumed attempt")
    before = read.wandb_history(read.wandb_records(next(folders[0].glob("run-*.wandb"))))
    kept = sorted(before.get("reward_mean", {}))  # (W&B writes every 0.5 s: the killed attempt may lack its last steps)
    assert kept == list(range(1, len(kept) + 1)) and kept[-1:] <= [4]
    _same(before, killed, kept, "wandb, the killed attempt")

    uri, run_id = saved["mlflow"]["tracking_uri"], saved["mlflow"]["run_id"]
    ml, _, _, ml_run = read.mlflow_run(uri, run_id)  # the latest value at each step
    _same(ml, want, [1, 2, 3, 4, 5], "mlflow")
    assert ml_run.info.status == "FINISHED" and ml_run.data.tags["relayrl.resumed_at_step_2"] == "true"
    assert [m.value for m in read.mlflow_history(uri, run_id, "reward_mean") if m.step == 3] == [
        killed[3]["reward_mean"], want[3]["reward_mean"]]  # MLflow keeps both (it cannot delete a value)

    assert [r["id"] for r in read.trackio_runs(project)] == [saved["trackio"]["id"]]
    tio, _ = read.trackio_logs(project, saved["trackio"]["id"])
    _same(tio, want, [3, 4, 5], "trackio")

    folders = sorted((run / "swanlog").glob("run-*"))
    assert len(folders) == 2 and all(f.name.endswith(saved["swanlab"]["id"]) for f in folders)
    _same(read.swanlab_scalars(read.swanlab_records(folders[1])), want, [3, 4, 5], "swanlab, the resumed attempt")


# ---------------------------------------------------------------- start-up errors, failures mid-run

def _fails_at_start(capsys, tmp_path, *args) -> str:
    code = main(["train", *args, f"run.output_dir={tmp_path / 'runs'}"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("relayrl: ") and "Traceback" not in err
    assert not (tmp_path / "runs").exists()  # nothing written
    return err


@pytest.mark.parametrize("name, extra", [("wandb", "wandb"), ("mlflow", "mlflow"), ("trackio", "trackio"),
                                         ("swanlab", "swanlab"), ("tensorboard", "torch.utils.tensorboard")])
def test_a_missing_tracker_package_is_one_line_at_start(name, extra, tmp_path, capsys, monkeypatch, offline):
    monkeypatch.setitem(sys.modules, extra, None)  # (import raises ImportError, as when it is not installed)
    err = _fails_at_start(capsys, tmp_path, f"run.report_to=[{name}]")
    assert f"relayrl: tracker error: run.report_to has {name}" in err and f"pip install 'relayrl[{name}]'" in err


def test_an_unreachable_tracker_server_is_one_line_at_start(tmp_path, capsys, monkeypatch, offline):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # (discard port: nothing listens)
    err = _fails_at_start(capsys, tmp_path, "run.report_to=[tensorboard,mlflow]")
    assert "MLFLOW_TRACKING_URI=http://127.0.0.1:9" in err and "cannot be reached" in err


def test_wandb_online_without_a_key_is_one_line_at_start(tmp_path, capsys, monkeypatch, offline):
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # (no ~/.netrc)
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    err = _fails_at_start(capsys, tmp_path, "run.report_to=wandb")
    assert "WANDB_MODE=online" in err and "API key" in err


def test_unknown_tracker_names_the_field_and_the_valid_ones(tmp_path, capsys):
    err = _fails_at_start(capsys, tmp_path, "run.report_to=[tensorbord]")
    assert "run.report_to" in err and "'tensorboard'" in err and "'swanlab'" in err


def test_a_tracker_failing_mid_run_is_turned_off_and_the_run_goes_on(tmp_path):
    warnings: list[str] = []
    ctx = TrackerContext(tmp_path, "r", "p", {"run": {"steps": 3}}, None)
    trackers = Trackers.open(["jsonl", "tensorboard"], ctx, warnings.append)
    (tb,) = trackers.trackers

    def disk_full(*a, **k):
        raise OSError(28, "No space left on device")

    tb.w.add_scalar = disk_full
    trackers.log({"step": 1, "reward_mean": 0.5})  # no exception
    assert trackers.trackers == [] and "tensorboard failed (step 1)" in warnings[-1] and "turned off" in warnings[-1]
    trackers.log({"step": 2, "reward_mean": 0.6})
    trackers.finish({"steps": 2}, {}, 2)


def test_scalars_flattens_lists_and_dicts_and_leaves_out_text():
    got = scalars({"step": 4, "a": 1, "b": 0.5, "ok": True, "hist": [3, 1], "d": {"x": 2}, "s": "text", "n": None})
    assert got == {"a": 1.0, "b": 0.5, "ok": 1.0, "hist/0": 3.0, "hist/1": 1.0, "d/x": 2.0}


def test_a_fresh_start_removes_what_an_earlier_attempt_of_the_run_left(tmp_path):
    """Killed before its first checkpoint, the run starts again from scratch: new tracker runs, and
    none of the old attempt's steps in the tracker folders."""
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "events.out.tfevents.old").write_bytes(b"x")
    (tmp_path / "mlflow.db").write_bytes(b"x")
    (tmp_path / "trackers.json").write_text(json.dumps({"wandb": {"id": "old"}}))
    trackers = Trackers.open(["jsonl", "tensorboard"], TrackerContext(tmp_path, "r", "p", {}, None), print)
    trackers.close(ok=True)
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "tensorboard" / "events.out.tfevents.old").exists()
    saved = json.loads((tmp_path / "trackers.json").read_text())
    assert saved == {"tensorboard": {"log_dir": str(tmp_path / "tensorboard")}}


def test_trackers_leave_the_random_state_as_it_was(tmp_path, offline):
    """SwanLab draws from Python's global random state when it starts a run; what relayrl and user
    code seeded must draw the same with or without run.report_to."""
    import random

    random.seed(7)
    want = random.getstate()
    ctx = TrackerContext(tmp_path, "r", "p", {"run": {"steps": 1}}, None)
    trackers = Trackers.open(["jsonl", "swanlab", "tensorboard"], ctx, lambda *a: None)
    trackers.log({"step": 1, "reward_mean": 0.5})
    trackers.finish({"steps": 1}, {}, 1)
    assert random.getstate() == want


KILLED_AFTER_TWO_STEPS = """
import os, signal, sys
from pathlib import Path
from relayrl.tracking.trackers import TrackerContext, Trackers
ctx = TrackerContext(Path(sys.argv[1]), "durable", sys.argv[2], {"run": {"steps": 2}}, None)
trackers = Trackers.open(["jsonl", sys.argv[3]], ctx, print)
trackers.log({"step": 1, "reward_mean": 0.25})
trackers.log({"step": 2, "reward_mean": 0.5})
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_trackio_keeps_the_steps_logged_before_a_kill(tmp_path, trackio_dir, offline):
    """A run SIGKILLed right after a step keeps it in trackio, as in metrics.jsonl: trackio's own thread
    writes only every 0.5 s, and a run not yet written is not found by --resume, which would then start
    a second run. (W&B cannot be made to write now: its service writes every
    x_transaction_log_flush_interval, 0.5 s here, and holds a step's row until the next step.)"""
    name = "trackio"
    project = f"p-{tmp_path.name}"
    env = {**os.environ, "TRACKIO_DIR": str(trackio_dir)}
    env.pop("WANDB_SERVICE", None)  # (its own service, as a run on its own has)
    done = subprocess.run([sys.executable, "-c", KILLED_AFTER_TWO_STEPS, str(tmp_path), project, name], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    (run,) = read.trackio_runs(project)
    logged, _ = read.trackio_logs(project, run["id"])
    assert logged["reward_mean"] == {1: 0.25, 2: 0.5}
