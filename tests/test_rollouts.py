"""Rollout records (``run.save_rollouts``): one gzip JSONL file per recorded step, every episode a
line; a resume from the checkpoint at step k replaces the dead attempt's steps > k; the trackers get
each step as a table; ``relayrl show`` lists and opens them."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from relayrl.cli import main
from relayrl.config import load_config
from relayrl.run.loop import train
from relayrl.tracking.rollouts import expand_runs, read_step, recorded_steps, step_file, version_runs
from tests import tracker_readers as read
from tests.test_e2e import EASY
from tests.test_trackers import offline, trackio_dir  # noqa: F401 (fixtures)

STEP = 4 * 8  # EASY: prompts_per_step × group_size episodes a step


def _cfg(tiny_path, tmp_path, *extra):
    return load_config(None, EASY + [f"model.path={tiny_path}", f"run.output_dir={tmp_path}", "run.name=r", *extra])


def _steps(run: Path) -> dict[int, list[dict]]:
    return {s: read_step(p) for s, p in recorded_steps(run).items()}


def test_version_runs_round_trip():
    assert version_runs([3, 3, 4, 4, 4, 3]) == [[3, 2], [4, 3], [3, 1]] and version_runs([]) == []
    assert expand_runs(version_runs([1, 1, 2, 5, 5])) == [1, 1, 2, 5, 5]


@pytest.mark.slow
def test_each_step_recorded_once_and_a_resume_replaces_the_dead_attempts_steps(tiny_path, tmp_path):
    run = tmp_path / "r"
    train(_cfg(tiny_path, tmp_path, "run.steps=4", "run.save_every=2"))
    first = _steps(run)
    assert sorted(first) == [1, 2, 3, 4]
    trained = {json.loads(x)["step"]: json.loads(x)["prompt_ids"] for x in
               (run / "trained_prompts.jsonl").read_text().splitlines()}
    for s, recs in first.items():
        assert len(recs) == STEP and {r["status"] for r in recs} == {"trained"} and {r["step"] for r in recs} == {s}
        assert sorted({r["prompt_id"] for r in recs}) == sorted(trained[s])  # the batch the trainer took
        assert len({r["id"] for r in recs}) == STEP
        for r in recs:
            assert sum(n for _, n in r["versions"]) == r["length"] == len(r["response_ids"])
            assert r["versions"] == [[s - 1, r["length"]]] and r["staleness"] == 0  # sync: the version trained
            assert r["prompt"][0]["role"] == "user" and isinstance(r["response"], str)
            assert r["finish_reason"] in ("stop", "length") and r["failure"] is None
    # the attempt died after recording steps 3..5 but before the checkpoint at 4: resume from step 2
    shutil.rmtree(run / "checkpoints" / "step_000004")
    for s in (3, 4, 5):
        with gzip.open(step_file(run, s), "wt") as f:
            f.write(json.dumps({"step": s, "id": "dead attempt"}) + "\n")
    (run / "rollouts" / "step_000006.jsonl.gz.part").write_bytes(b"half")  # cut by the kill
    kept = {s: step_file(run, s).read_bytes() for s in (1, 2)}
    train(_cfg(tiny_path, tmp_path, "run.steps=4", "run.save_every=2"), resume=True)
    again = _steps(run)
    assert sorted(again) == [1, 2, 3, 4] and sorted(p.name for p in (run / "rollouts").iterdir()) == [
        f"step_00000{s}.jsonl.gz" for s in (1, 2, 3, 4)]
    assert {s: step_file(run, s).read_bytes() for s in (1, 2)} == kept  # before the checkpoint: untouched
    for s in (3, 4):
        assert len(again[s]) == STEP and "dead attempt" not in {r["id"] for r in again[s]}
        assert [r["response_ids"] for r in again[s]] == [r["response_ids"] for r in first[s]]  # (exact resume)


@pytest.mark.slow
def test_save_rollouts_every_n_steps_and_off(tiny_path, tmp_path):
    train(_cfg(tiny_path, tmp_path, "run.steps=3", "run.save_rollouts=2"))
    assert sorted(recorded_steps(tmp_path / "r")) == [2]
    train(_cfg(tiny_path, tmp_path, "run.steps=1", "run.save_rollouts=0", "run.name=off"))
    assert not (tmp_path / "off" / "rollouts").exists()


@pytest.mark.slow
def test_failed_episodes_are_recorded_and_show_failures_lists_only_them(tiny_path, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    train(_cfg(tiny_path, tmp_path, "run.steps=1", "reward.fn=tests.rewards_for_tests:flaky",
               "run.max_failure_frac=1"))
    (recs,) = _steps(tmp_path / "r").values()
    failed = [r for r in recs if r["status"] == "failed"]
    assert failed and len(failed) < len(recs) and len(recs) == STEP
    assert all(r["failure"]["kind"] == "reward" and "flaky verifier" in r["failure"]["error"] for r in failed)
    assert all(r["failure"] is None for r in recs if r["status"] == "trained")
    capsys.readouterr()
    assert main(["show", str(tmp_path / "r"), "--failures", "--limit", "0"]) == 0
    out = capsys.readouterr().out
    assert f"{len(failed)} of {len(recs)} episodes" in out
    assert all(r["id"] in out for r in failed) and not any(r["id"] in out for r in recs if not r["failure"])
    assert out.count("failed") >= len(failed) and "trained" not in out


@pytest.mark.slow
def test_trackers_get_each_recorded_step_as_a_table(tiny_path, tmp_path, trackio_dir, offline):  # noqa: F811
    project = f"p-{tmp_path.name}"
    train(_cfg(tiny_path, tmp_path, "run.steps=2", "run.report_to=[tensorboard,wandb,mlflow,trackio]",
               f"run.project={project}", "rollout.prompts_per_step=2", "rollout.group_size=2"))
    run = tmp_path / "r"
    want = {s: [r["id"] for r in recs] for s, recs in _steps(run).items()}
    assert sorted(want) == [1, 2] and all(len(v) == 4 for v in want.values())

    _, ea = read.tensorboard(run / "tensorboard")
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in ea.Tensors("rollouts/text_summary")}
    assert sorted(texts) == [1, 2]
    for s, ids in want.items():
        assert texts[s].startswith("| id | step | status |") and all(f"| {i} | {s} | trained |" in texts[s] for i in ids)

    (folder,) = (run / "wandb").glob("offline-run-*")
    hist = read.wandb_history(read.wandb_records(next(folder.glob("run-*.wandb"))))
    for s, ids in want.items():
        table = json.loads((folder / "files" / hist["rollouts.path"][s]).read_text())
        assert table["columns"][:3] == ["id", "step", "status"] and [row[0] for row in table["data"]] == ids

    saved = json.loads((run / "trackers.json").read_text())
    _, _, artifacts, _ = read.mlflow_run(saved["mlflow"]["tracking_uri"], saved["mlflow"]["run_id"])
    assert {"rollouts/step_000001.json", "rollouts/step_000002.json"} <= set(artifacts)

    tio, _ = read.trackio_logs(project, saved["trackio"]["id"])
    for s, ids in want.items():
        assert tio["rollouts"][s]["_type"] == "trackio.table" and [row["id"] for row in tio["rollouts"][s]["_value"]] == ids
