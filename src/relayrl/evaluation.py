"""Held-out evaluation through the engine: sampled accuracy at the training temperature and greedy accuracy."""

from __future__ import annotations

from relayrl.config import Config
from relayrl.engine.base import Engine
from relayrl.faults import fault_point
from relayrl.records import Prompt, SamplingParams
from relayrl.rewards import RewardRunner
from relayrl.rollout import generate_groups, make_groups, score_groups


def evaluate(engine: Engine, tokenizer, prompts: list[Prompt], reward: RewardRunner, cfg: Config) -> dict:
    """``accuracy``: mean reward (pass@1) of ``eval.samples`` sampled responses per prompt at
    ``rollout.temperature``; ``accuracy_greedy``: mean reward of the greedy response."""
    r = cfg.rollout
    out = {"temperature": r.temperature, "prompts": len(prompts)}
    for key, temp, n in (("accuracy", r.temperature, cfg.eval.samples), ("accuracy_greedy", 0.0, 1)):
        groups = make_groups(prompts, tokenizer, n, f"eval-{key}-v{engine.version}", cfg.data.prompt_format)
        generate_groups(engine, groups, SamplingParams(r.max_new_tokens, temp, r.top_p, r.top_k))
        fault_point("eval")
        score_groups(groups, reward, tokenizer)
        rewards = [x for g in groups for x in g.rewards]
        out[key] = sum(rewards) / len(rewards)
        if key == "accuracy":
            lens = [len(t.response_ids) for g in groups for t in g.trajectories]
            out["response_len_mean"] = sum(lens) / len(lens)
    return out
