"""The episode driver end to end on the demo model: sync and async train, a kill -9 + --resume
neither loses nor duplicates a prompt, and no group is ever older than η versions."""

import json

import pytest

from tests.test_e2e import SMALL, _metrics, kill_at_checkpoint_then_resume


@pytest.mark.slow
@pytest.mark.parametrize("mode", [
    ["run.mode=sync"],
    ["run.mode=async", "rollout.partial=true", "rollout.max_staleness=2"],
], ids=["sync", "async+partial"])
def test_episodes_survive_kill_and_resume(tmp_path, mode):
    args = SMALL + mode + ["env.name=single_turn", f"run.output_dir={tmp_path}", "run.steps=8", "run.save_every=2",
                           "run.name=p", "run.keep_checkpoints=8"]
    kill_at_checkpoint_then_resume(args, tmp_path / "p", step=4)
    run = tmp_path / "p"
    trained = [json.loads(x) for x in (run / "trained_prompts.jsonl").read_text().splitlines()]
    assert [t["step"] for t in trained] == list(range(1, 9))
    ids = [i for t in trained for i in t["prompt_ids"]]
    assert len(ids) == len(set(ids)) == 8 * 4  # nothing trained twice, every step full
    state = json.loads((run / "checkpoints" / "step_000008" / "state.json").read_text())
    carried = {g["prompt"]["id"] for g in state["partial_buffer"]}
    assert not carried & set(ids)
    assert state["sampler"]["consumed"] == len(ids) + len(carried)  # every prompt drawn is trained or carried
    m = _metrics(run)
    eta = 2 if "run.mode=async" in mode else 0
    assert max(x["staleness_max"] for x in m) <= eta  # due groups are waited for: never older than η
    measured = [x["logprob_mismatch_mean"] for x in m if x["logprob_mismatch_tokens"]]
    assert measured and all(x < 1e-3 for x in measured)
    if eta:
        assert any(x["offpolicy_token_frac"] > 0 for x in m) and m[-1]["partial_resumed_total"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_agent_demo_learns_to_call_its_tool(tmp_path, mode):
    """A shortened agent demo: the policy starts calling the calculator on about a third of the
    prompts and never greedily; a few steps of RL make calling it the greedy choice."""
    from pathlib import Path

    from relayrl.config import load_config
    from relayrl.run.loop import train

    example = Path(__file__).parent.parent / "examples" / "agent_demo.yaml"
    cfg = load_config(str(example), [f"run.output_dir={tmp_path}", f"run.mode={mode}", "run.steps=15",
                                     "run.progress=false", "eval.size=48"])
    s = train(cfg)
    assert s["eval_tool_call_rate_greedy_before"] == 0 and s["eval_greedy_accuracy_before"] < 0.05
    assert s["eval_tool_call_rate_greedy_after"] > 0.9 and s["eval_greedy_accuracy_after"] > 0.5
    assert s["eval_tool_call_rate_after"] > s["eval_tool_call_rate_before"] + 0.3
    rows = _metrics(cfg.run_dir)
    assert rows[-1]["tool_call_rate"] > rows[0]["tool_call_rate"] and all("tool_errors" in r for r in rows)


@pytest.mark.slow
def test_the_openai_sdk_agent_learns_through_the_endpoint(tmp_path):
    """examples/openai_agent.py (the agent demo's task as a plain OpenAI-SDK program), trained through the
    endpoint, learns as the ToolEnv demo does: calling the calculator becomes the greedy choice."""
    from pathlib import Path

    from relayrl.config import load_config
    from relayrl.run.loop import train

    root = Path(__file__).parent.parent
    cfg = load_config(str(root / "examples" / "openai_agent.yaml"),
                      [f"run.output_dir={tmp_path}", "run.steps=15", "run.progress=false", "eval.size=48",
                       f"env.name=agent:{root / 'examples' / 'openai_agent.py'}:run"])
    s = train(cfg)
    assert s["eval_tool_call_rate_greedy_before"] == 0 and s["eval_greedy_accuracy_before"] < 0.05
    assert s["eval_tool_call_rate_greedy_after"] > 0.9 and s["eval_greedy_accuracy_after"] > 0.5
    assert s["eval_tool_call_rate_after"] > s["eval_tool_call_rate_before"] + 0.3
    assert not s["episodes_left_out"]
    rows = _metrics(cfg.run_dir)
    assert rows[-1]["tool_call_rate"] > rows[0]["tool_call_rate"]
    assert all(r["serve/merged_turns"] > 0 and r["serve/branches"] == 0 for r in rows)  # one trajectory each


@pytest.mark.slow
def test_relayrl_eval_runs_an_agent_program(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parent.parent
    out = subprocess.run([sys.executable, "-m", "relayrl.cli", "eval", str(root / "examples" / "openai_agent.yaml"),
                          "eval.size=24", f"env.name=agent:{root / 'examples' / 'openai_agent.py'}:run"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    e = json.loads(out.stdout)
    assert e["prompts"] == 24 and e["accuracy_failed"] == 0 and 0 < e["tool_call_rate"] < 1
    assert e["accuracy_greedy"] == 0 and e["tool_call_rate_greedy"] == 0  # the warm start answers greedily in its head
    assert e["serve/sampling_overrides"] == 0 and e["turns_mean"] > 1
