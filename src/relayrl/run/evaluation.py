"""Held-out evaluation over episodes: sampled accuracy (successes: reward ≥ 1) at the training temperature,
pass@k, greedy accuracy, and the mean rewards beside them; and the report ``relayrl eval`` writes (``eval.json``, ``eval_samples.jsonl``)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from relayrl import failures
from relayrl.envs.multi import Players
from relayrl.fault_injection import fault_point
from relayrl.records import Prompt, SamplingParams
from relayrl.rollout.groups import family, make_groups


def no_evaluation_note(data) -> str:
    """The log's line for a run with no held-out prompts: why, and how to have them (``data``: DataCfg)."""
    if "eval_path" in data.model_fields_set:
        return "no held-out evaluation (data.eval_path=null)"
    if data.path.startswith("builtin:"):
        return f"no held-out evaluation: data.path={data.path} has no held-out set of its own (data.eval_path=FILE)"
    return (f"no held-out evaluation: data.path={data.path} is data of your own and data.eval_path is not set (the "
            "demo's held-out prompts go with the demo's data only); data.eval_path=FILE gives held-out numbers")


def episode_stats(trajs: list) -> dict:
    """What agents do, over episodes: how many call a tool, errors, turns (an agent program's: its
    requests; the branches its sessions started and the sampling parameters the trainer's overrode)."""
    info = [t.info for t in trajs if "branch_of" not in t.info]  # (an agent episode's extra branches)
    n = max(1, len(info))
    served = {f"serve/{k}": sum(i.get(k, 0) for i in info) for k in ("branches", "sampling_overrides",
                                                                      "merged_turns", "new_branch_tools_changed")} \
        if any("sampling_overrides" in i for i in info) else {}
    return {**served, **match_stats(info),
        "tool_call_rate": sum(i.get("tool_calls", 0) > 0 for i in info) / n,  # episodes with at least one call
        "tool_calls_mean": sum(i.get("tool_calls", 0) for i in info) / n,
        "tool_errors": sum(i.get("tool_errors", 0) for i in info),
        "tool_timeouts": sum(i.get("tool_timeouts", 0) for i in info),
        "tool_raised": sum(i.get("tool_raised", 0) for i in info),  # exceptions inside tools (of tool_errors)
        "turns_mean": sum(i.get("turns", 1) for i in info) / n,
        **env_share(info),
        **({"context_rewrites": sum(i.get("context_rewrites", 0) for i in info)}  # (env.context=elide)
           if any("context_rewrites" in i for i in info) else {}),
    }


def env_share(info: list[dict]) -> dict:
    """Of environment episodes' wall time, the share spent in environment calls (``env_time_frac``: OS-level
    work, for workspaces: sandboxes, tools, tests); nothing where no episode had an environment."""
    timed = [i for i in info if i.get("episode_s")]
    total = sum(i["episode_s"] for i in timed)
    return {"env_time_frac": sum(i["env_s"] for i in timed) / total} if total > 0 else {}


def match_stats(info: list[dict]) -> dict:
    """Matches of a multi-agent environment (``envs.multi``): the win rate, per role (``NAME#k`` as one), and
    the fraction left unfinished; nothing for other episodes."""
    played = [i for i in info if "outcome" in i]
    if not played:
        return {}
    out = {"win_rate": sum(i["outcome"] == "win" for i in played) / len(played)}
    for role in sorted({family(i["role"]) for i in played}):
        mine = [i for i in played if family(i["role"]) == role]
        out[f"win_rate/{role}"] = sum(i["outcome"] == "win" for i in mine) / len(mine)
    out["unfinished_frac"] = sum(i.get("unfinished", 0) for i in played) / len(played)
    return out


SUCCESS = 1.0  # a reward at least this is a success: accuracy and pass@k count these


def fmt_eval(e: dict) -> str:
    """An evaluation in the log: the accuracy (successes), and the mean reward where it says something else."""
    if "win_rate" in e:  # a multi-agent environment's matches against its scripted player
        return f"win rate {e['win_rate']:.1%} (sampled, T={e['temperature']}), greedy {e['win_rate_greedy']:.1%}"
    line = f"accuracy {e['accuracy']:.1%} (sampled, T={e['temperature']}), greedy {e['accuracy_greedy']:.1%}"
    if _partial(e):
        line += f"; mean reward {e['reward_mean']:.3f}, greedy {e.get('reward_mean_greedy', e['accuracy_greedy']):.3f}"
    return line


def fmt_change(before: dict, after: dict) -> str:
    """'held-out accuracy: 36.9% → 52.0% (greedy ...)', with the mean reward's change where it differs."""
    line = (f"held-out accuracy: {before['accuracy']:.1%} → {after['accuracy']:.1%} "
            f"(greedy {before['accuracy_greedy']:.1%} → {after['accuracy_greedy']:.1%})")
    if _partial(before) or _partial(after):
        mean = lambda e, k: e.get(k.replace("accuracy", "reward_mean"), e[k])  # noqa: E731 (an older run's: accuracy)
        line += (f"; mean reward {mean(before, 'accuracy'):.3f} → {mean(after, 'accuracy'):.3f} "
                 f"(greedy {mean(before, 'accuracy_greedy'):.3f} → {mean(after, 'accuracy_greedy'):.3f})")
    return line


def _partial(e: dict) -> bool:
    """The rewards were not all 0 or 1 (partial credit): the mean reward is not the accuracy."""
    return any(abs(e.get(k.replace("accuracy", "reward_mean"), e[k]) - e[k]) > 1e-12
               for k in ("accuracy", "accuracy_greedy"))


def pass_at_k(trajs: list, n: int) -> dict:
    """``pass_at_k`` for k = 1, 2, 4, ... and n: the unbiased estimate 1 - C(m-c, k) / C(m, k) of
    Chen et al. (2021, "Evaluating Large Language Models Trained on Code", eq. 1) per prompt, over
    its m scored samples of which c solved it (reward >= 1, what the built-in verifiers give a right
    answer), averaged over the prompts with at least k scored samples."""
    by_prompt: dict[str, list[bool]] = {}
    for t in trajs:
        by_prompt.setdefault(t.group_id, []).append(t.reward >= SUCCESS)
    out = {}
    for k in sorted({2 ** i for i in range(n.bit_length()) if 2 ** i <= n} | {n}):
        est = [1 - math.comb(len(s) - sum(s), k) / math.comb(len(s), k) for s in by_prompt.values() if len(s) >= k]
        out[f"pass_at_{k}"] = sum(est) / len(est) if est else None
    return out


def sample_record(t, tokenizer, kind: str) -> dict:
    """One evaluated episode, for ``eval_samples.jsonl``."""
    return {"prompt_id": t.prompt.id, "prompt": t.prompt.messages, "answer": t.prompt.answer, "kind": kind,
            "sample": t.sample_idx, "completion": tokenizer.decode(t.response_ids, skip_special_tokens=True),
            "reward": t.reward, "finish_reason": t.finish_reason.value if t.finish_reason else None,
            "response_tokens": len(t.response_ids), "failure": t.failure, "prompt_ids": list(t.prompt_ids),
            "response_ids": list(t.response_ids), **({"mask": list(t.mask)} if t.mask and not all(t.mask) else {}),
            **({"turns": t.info.get("turns"), "tool_calls": t.info.get("tool_calls", 0)} if t.info else {})}


@dataclass(frozen=True)
class EvalSettings:
    """What an evaluation reads of the config: eval.samples and eval.seed, the rollout's sampling
    (rollout.temperature, max_new_tokens, top_p, top_k), data.prompt_format, run.max_failure_frac."""
    samples: int
    seed: int
    temperature: float
    max_new_tokens: int
    top_p: float = 1.0
    top_k: int = 0
    prompt_format: str = "chat"
    max_failure_frac: float = 0.5


def evaluate(runner, tokenizer, prompts: list[Prompt], s: EvalSettings, when: str = "", samples: list | None = None
             ) -> dict:
    """``accuracy``: the fraction of ``eval.samples`` sampled episodes per prompt at ``rollout.temperature``
    that succeeded (reward ≥ 1, ``SUCCESS``: what the built-in verifiers give a right answer, and pass@k's
    threshold), and with several, ``pass_at_k``; ``accuracy_greedy``: the same of the greedy one (a multi-agent environment's: one greedy
    match per role of ``env.eval_roles``, each against the scripted player);
    ``reward_mean`` and ``reward_mean_greedy``: their mean rewards (equal to the accuracies for a 0/1 reward;
    with partial credit, what a verifier's mean says, never called accuracy). With an environment, also the tool-call rate (sampled and greedy) and tool errors of
    the sampled ones. Episodes whose user code failed are left out of the means and counted
    (``accuracy_failed``). ``samples``: a list that gets every episode (``sample_record``).
    Sampling is seeded per episode by ``eval.seed``, its prompt and sample index: every evaluation
    draws the same random numbers (differences between evaluations are the policy's), and takes
    none from the engine's stream (training rollouts sample as they would without it).
    Runs through ``runner`` (episodes.EpisodeRunner) while the training episodes are held."""
    import asyncio

    out = {"temperature": s.temperature, "prompts": len(prompts)}
    players = getattr(runner, "make_env", None)
    greedy = len(players.eval) if isinstance(players, Players) else 1  # (matches: one per role the policy plays)
    for key, temp, n in (("accuracy", s.temperature, s.samples), ("accuracy_greedy", 0.0, greedy)):
        groups = make_groups(prompts, tokenizer, n, f"eval-{key}-v{runner.engine.version}", s.prompt_format)
        params = SamplingParams(s.max_new_tokens, temp, s.top_p, s.top_k, seed=s.seed)

        async def run_all():
            await asyncio.gather(*(runner.group(g, params, train=False) for g in groups))

        runner.run(run_all())
        fault_point("eval")
        every = [t for g in groups for t in g.trajectories]
        which = "sampled" if key == "accuracy" else "greedy"  # (too many failures: the run stops)
        counts = failures.check(every, s.max_failure_frac, f"the evaluation{' ' + when if when else ''} ({which})")
        trajs = [t for t in every if not failures.failed(t)]  # failed episodes are not scored 0
        out[key] = sum(t.reward >= SUCCESS for t in trajs) / max(1, len(trajs))
        out[key.replace("accuracy", "reward_mean")] = sum(t.reward for t in trajs) / max(1, len(trajs))
        out[f"{key}_failed"] = sum(counts.values())
        if samples is not None:
            samples += [sample_record(t, tokenizer, which) for t in every]
        if key == "accuracy" and n > 1:
            out.update(pass_at_k(trajs, n))
        stats = episode_stats(trajs) if runner.multi_turn else None
        if key == "accuracy":
            out.update(stats or {}, response_len_mean=sum(len(t.response_ids) for t in trajs) / max(1, len(trajs)))
        elif stats:
            out["tool_call_rate_greedy"] = stats["tool_call_rate"]
            if "win_rate" in stats:
                out["win_rate_greedy"] = stats["win_rate"]
    return out


def write_report(out_dir: str | Path, result: dict, samples: list[dict], about: dict) -> tuple[Path, Path]:
    """``eval.json`` (what was evaluated, how, and the result) and ``eval_samples.jsonl`` (one line per
    episode: prompt, completion, reward, finish reason) in ``out_dir``."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    report, lines = d / "eval.json", d / "eval_samples.jsonl"
    report.write_text(json.dumps({**about, "result": result}, indent=1))
    lines.write_text("".join(json.dumps(r) + "\n" for r in samples))
    return report, lines
