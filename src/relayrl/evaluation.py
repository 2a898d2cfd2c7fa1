"""Held-out evaluation over episodes: sampled accuracy at the training temperature and greedy accuracy."""

from __future__ import annotations

from relayrl import failures
from relayrl.config import Config
from relayrl.faults import fault_point
from relayrl.records import Prompt, SamplingParams
from relayrl.rollout import make_groups


def episode_stats(trajs: list) -> dict:
    """What agents do, over episodes: how many call a tool, errors, turns (an agent program's: its
    requests; the branches its sessions started and the sampling parameters the trainer's overrode)."""
    info = [t.info for t in trajs if "branch_of" not in t.info]  # (an agent episode's extra branches)
    n = max(1, len(info))
    served = {f"serve/{k}": sum(i.get(k, 0) for i in info) for k in ("branches", "sampling_overrides",
                                                                      "merged_turns")} \
        if any("sampling_overrides" in i for i in info) else {}
    return {**served,
        "tool_call_rate": sum(i.get("tool_calls", 0) > 0 for i in info) / n,  # episodes with at least one call
        "tool_calls_mean": sum(i.get("tool_calls", 0) for i in info) / n,
        "tool_errors": sum(i.get("tool_errors", 0) for i in info),
        "tool_timeouts": sum(i.get("tool_timeouts", 0) for i in info),
        "tool_raised": sum(i.get("tool_raised", 0) for i in info),  # exceptions inside tools (of tool_errors)
        "turns_mean": sum(i.get("turns", 1) for i in info) / n,
    }


def evaluate(runner, tokenizer, prompts: list[Prompt], cfg: Config, when: str = "") -> dict:
    """``accuracy``: mean reward (pass@1) of ``eval.samples`` sampled episodes per prompt at
    ``rollout.temperature``; ``accuracy_greedy``: mean reward of the greedy one. With an
    environment, also the tool-call rate (sampled and greedy) and tool errors of the sampled ones.
    Episodes whose user code failed are left out of the means and counted (``accuracy_failed``).
    Runs through ``runner`` (episodes.EpisodeRunner) while the training episodes are held."""
    import asyncio

    r = cfg.rollout
    out = {"temperature": r.temperature, "prompts": len(prompts)}
    for key, temp, n in (("accuracy", r.temperature, cfg.eval.samples), ("accuracy_greedy", 0.0, 1)):
        groups = make_groups(prompts, tokenizer, n, f"eval-{key}-v{runner.engine.version}", cfg.data.prompt_format)
        params = SamplingParams(r.max_new_tokens, temp, r.top_p, r.top_k)

        async def run_all():
            await asyncio.gather(*(runner.group(g, params, train=False) for g in groups))

        runner.run(run_all())
        fault_point("eval")
        every = [t for g in groups for t in g.trajectories]
        which = "sampled" if key == "accuracy" else "greedy"  # (too many failures: the run stops)
        counts = failures.check(every, cfg.run.max_failure_frac, f"the evaluation{' ' + when if when else ''} ({which})")
        trajs = [t for t in every if not failures.failed(t)]  # failed episodes are not scored 0
        out[key] = sum(t.reward for t in trajs) / max(1, len(trajs))
        out[f"{key}_failed"] = sum(counts.values())
        stats = episode_stats(trajs) if runner.multi_turn else None
        if key == "accuracy":
            out.update(stats or {}, response_len_mean=sum(len(t.response_ids) for t in trajs) / max(1, len(trajs)))
        elif stats:
            out["tool_call_rate_greedy"] = stats["tool_call_rate"]
    return out
