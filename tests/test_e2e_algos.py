"""The algorithm suite end to end: the agent demo learns its tool behaviour with a critic (PPO's GAE),
DAPO's overlong handling runs through the pipeline, and a resume cannot switch a critic on or off."""

import json
from pathlib import Path

import pytest

from relayrl.config import load_config
from relayrl.run.loop import ResumeError, train
from tests.test_e2e import EASY, SMALL, _metrics

EXAMPLE = Path(__file__).parent.parent / "examples" / "agent_demo.yaml"


@pytest.mark.slow
def test_the_agent_demo_learns_to_call_its_tool_with_a_critic(tmp_path):
    """``examples/agent_demo.yaml algo.advantage=gae``, shortened: the critic's values over the tokens of
    multi-turn episodes (tool results masked out, the reward on the last turn) teach calling the tool."""
    cfg = load_config(str(EXAMPLE), [f"run.output_dir={tmp_path}", "algo.advantage=gae", "run.steps=15",
                                     "run.progress=false", "eval.size=48"])
    s = train(cfg)
    assert s["eval_tool_call_rate_greedy_before"] == 0 and s["eval_greedy_accuracy_before"] < 0.05
    assert s["eval_tool_call_rate_greedy_after"] > 0.9 and s["eval_greedy_accuracy_after"] > 0.5
    rows = _metrics(cfg.run_dir)
    assert all("critic/loss" in r and "critic/ev" in r for r in rows)
    assert max(r["critic/ev"] for r in rows[5:]) > 0  # the critic comes to explain some of the returns


@pytest.mark.slow
@pytest.mark.parametrize("overlong", [["algo.overlong=filter"], ["algo.overlong=punish", "algo.overlong_buffer=16"]],
                         ids=["filter", "punish"])
def test_overlong_handling_in_the_pipeline(tmp_path, overlong):
    """On the demo model with a budget of 32 tokens, the long tail is truncated: filtered out of the loss, or
    penalised (a mean penalty below 0)."""
    cfg = load_config(None, SMALL + overlong + [f"run.output_dir={tmp_path}", "run.steps=2",
                                                "rollout.max_new_tokens=32"])
    train(cfg)
    rows = _metrics(cfg.run_dir)
    if "algo.overlong=filter" in overlong:
        assert any(r["overlong/filtered_frac"] > 0 for r in rows) and all(r["truncated_frac"] ==
                                                                          r["overlong/filtered_frac"] for r in rows)
    else:
        assert any(r["overlong/penalty_mean"] < 0 for r in rows)


@pytest.mark.slow
def test_resume_refuses_to_switch_the_critic(tiny_path, tmp_path):
    args = EASY + [f"model.path={tiny_path}", f"run.output_dir={tmp_path}", "run.name=r", "run.steps=2"]
    train(load_config(None, args))
    with pytest.raises(ResumeError, match=r"algo\.advantage was 'grpo' and is now 'gae'; the checkpoint has no "
                                          r"critic"):
        train(load_config(None, args + ["algo.advantage=gae", "run.steps=3"]), resume=True)
    state = json.loads((tmp_path / "r" / "checkpoints" / "step_000002" / "state.json").read_text())
    assert state["step"] == 2
