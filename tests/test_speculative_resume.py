"""Speculative drafts across a resume: a resumed run's engines get the earlier responses of its rollout records
(``tracking.rollouts.recorded_responses``, ``Engine.remember``), so history drafts from its first step on."""

import gzip
import io
import json

import pytest
from rich.console import Console

from relayrl.engine.speculative import Speculator
from relayrl.tracking.rollouts import recorded_responses, step_file


def _write(run_dir, step, records):
    path = step_file(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))


def _record(prompt, response, **kw):
    return {"prompt_ids": prompt, "response_ids": response, "finish_reason": "stop", **kw}


A, B, C, D, E = [1, 2], [3, 4], [5, 6], [7, 8], [9, 9]  # (prompts: a draft looks up 2 tokens or more)


def test_the_records_give_the_newest_whole_responses_oldest_first(tmp_path):
    _write(tmp_path, 1, [_record(A, [10, 11]), _record(B, [12, 13, 14], finish_reason="length")])
    _write(tmp_path, 2, [_record(A, [20]), _record(A, [21, 22], finish_reason="aborted"),  # (continued later)
                         _record(C, [23, 24, 25], turns=[{"assistant": "x", "env": "y"}, {"assistant": "z"}],
                                 mask=[1, 0, 1]),  # (an episode whole, as its prompt's history held it)
                         _record(D, [26], finish_reason="failed"), _record(D, []), {"prompt_ids": E}])
    _write(tmp_path, 3, [_record(A, [30])])  # past the checkpoint: a dead attempt's
    responses, damaged = recorded_responses(tmp_path, 2, 100)
    assert responses == [(A, [10, 11]), (B, [12, 13, 14]), (A, [20]), (C, [23, 24, 25])] and damaged == []
    # about max_tokens of them: the newest files first, each file read whole
    assert recorded_responses(tmp_path, 2, 1)[0] == [(A, [20]), (C, [23, 24, 25])]
    assert recorded_responses(tmp_path, 3, 1)[0] == [(A, [30])]
    # a damaged file is named and left out, the others read
    step_file(tmp_path, 2).write_bytes(b"\x1f\x8b not gzip")
    responses, damaged = recorded_responses(tmp_path, 2, 100)
    assert responses == [(A, [10, 11]), (B, [12, 13, 14])]
    assert len(damaged) == 1 and "step_000002.jsonl.gz" in damaged[0]
    # kept as the prompt's history (and, with recent, every prompt's): drafts for its next responses
    spec = Speculator(("siblings", "history"), max_draft=4)
    assert spec.remember(responses) == 2
    assert spec.drafts([("a", A, [], 10)]) == ([[10, 11]], ["history"])
    assert Speculator(("siblings", "prompt")).remember(responses) == 0  # (no source keeps them)


@pytest.mark.parametrize("mode", ["sync", pytest.param("async", marks=pytest.mark.slow)])
def test_a_resumed_run_drafts_from_the_responses_before_its_checkpoint(tmp_path, mode):
    """Two prompts, every step the same two: after a resume at step 2 the engine (in this process for sync, in
    its own for async) holds the 16 responses of steps 1-2, and in sync mode step 3 drafts from them (without
    the records its history would be empty until step 3's responses finish)."""
    from relayrl.config import load_config
    from relayrl.demo.model import demo_model_path
    from relayrl.run.loop import train

    demo = str(demo_model_path(log=lambda *a: None))
    data = tmp_path / "two.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Sum mod 10: a={i} b=4", "answer": str(i + 4)}) + "\n"
                            for i in range(2)))
    args = [f"model.path={demo}", f"run.output_dir={tmp_path}", "run.name=r", f"data.path={data}",
            "data.eval_path=null", "rollout.speculative=on", f"run.mode={mode}", "rollout.prompts_per_step=2",
            "rollout.group_size=4", "rollout.max_new_tokens=24", "rollout.budget=fixed",
            "rollout.dynamic_sampling=false", "run.progress=false", "run.save_every=2"]
    train(load_config(None, args + ["run.steps=2"]))
    out = io.StringIO()
    cfg = load_config(None, args + ["run.steps=3"])
    train(cfg, resume=True, console=Console(file=out, width=200))
    assert "speculative drafts: 16 earlier responses from the rollout records" in out.getvalue()
    m = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in m] == [1, 2, 3]
    run = json.loads((cfg.run_dir / "summary.json").read_text())["speculative"]  # (the run's, across the resume)
    assert run["drafted"] == sum(x["spec/drafted"] for x in m) > sum(x["spec/drafted"] for x in m[2:])
    assert run["accepted"] == sum(x["spec/accepted"] for x in m)
    if mode == "sync":
        assert m[2].get("spec/drafted_history", 0) > 0


def test_a_resumed_agent_run_drafts_from_its_episodes_before_its_checkpoint(tmp_path):
    """The agent demo (a calculator tool, several turns) on two prompts: the resumed engine holds the 16 episodes
    of steps 1-2 whole (each turn a request for the episode's prompt continuing its response so far, the way the
    engine keeps them: the log counts what the engine kept), and step 3 drafts from history."""
    from pathlib import Path

    from relayrl.config import load_config
    from relayrl.data.datasets import load_prompts
    from relayrl.run.loop import train

    data = tmp_path / "two.jsonl"
    data.write_text("".join(json.dumps({"id": p.id, "prompt": p.messages, "answer": p.answer}) + "\n"
                            for p in load_prompts("builtin:agent-demo", limit=2)))
    example = Path(__file__).parent.parent / "examples" / "agent_demo.yaml"
    args = [f"run.output_dir={tmp_path}", "run.name=r", f"data.path={data}", "data.eval_path=null",
            "rollout.speculative=on", "rollout.prompts_per_step=2", "rollout.group_size=4", "run.progress=false",
            "run.save_every=2"]
    train(load_config(str(example), args + ["run.steps=2"]))
    records = [json.loads(x) for x in gzip.open(step_file(tmp_path / "r", 2), "rt")]
    assert any("mask" in r for r in records)  # (episodes of several turns: calls to the calculator)
    out = io.StringIO()
    cfg = load_config(str(example), args + ["run.steps=3"])
    train(cfg, resume=True, console=Console(file=out, width=200))
    assert "speculative drafts: 16 earlier responses from the rollout records" in out.getvalue()
    m = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert m[2].get("spec/drafted_history", 0) > 0
