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


def episode_stats(trajs: list) -> dict:
    """What agents do, over episodes: how many call a tool, errors, turns."""
    n = max(1, len(trajs))
    info = [t.info for t in trajs]
    return {
        "tool_call_rate": sum(i.get("tool_calls", 0) > 0 for i in info) / n,  # episodes with at least one call
        "tool_calls_mean": sum(i.get("tool_calls", 0) for i in info) / n,
        "tool_errors": sum(i.get("tool_errors", 0) for i in info),
        "tool_timeouts": sum(i.get("tool_timeouts", 0) for i in info),
        "turns_mean": sum(i.get("turns", 1) for i in info) / n,
    }


def evaluate_episodes(runner, tokenizer, prompts: list[Prompt], cfg: Config) -> dict:
    """``evaluate`` for agents: the same accuracies over whole episodes (tools and all), plus
    the tool-call rate and errors of the sampled ones."""
    import asyncio

    r = cfg.rollout
    out = {"temperature": r.temperature, "prompts": len(prompts)}
    for key, temp, n in (("accuracy", r.temperature, cfg.eval.samples), ("accuracy_greedy", 0.0, 1)):
        groups = make_groups(prompts, tokenizer, n, f"eval-{key}-v{runner.engine.version}", cfg.data.prompt_format)
        params = SamplingParams(r.max_new_tokens, temp, r.top_p, r.top_k)

        async def run_all():
            await asyncio.gather(*(runner.group(g, params) for g in groups))

        runner.run(run_all())
        fault_point("eval")
        trajs = [t for g in groups for t in g.trajectories]
        out[key] = sum(t.reward for t in trajs) / len(trajs)
        stats = episode_stats(trajs)
        if key == "accuracy":
            out.update(stats, response_len_mean=sum(len(t.response_ids) for t in trajs) / len(trajs))
        else:
            out["tool_call_rate_greedy"] = stats["tool_call_rate"]
    return out
