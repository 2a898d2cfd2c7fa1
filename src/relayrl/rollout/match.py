"""A match: one episode of a multi-agent environment (``envs.multi``), filling one trajectory per role
the policy plays, on the runner's public calls (``rollout.episode``'s ``EpisodeHost``).

    views = await env.reset(prompt)                         each role's opening messages
    loop: role = env.turn()                                 (or several roles acting at once: generated together,
                                                             their moves stepped in the order named)
          the policy's role: its observations since its last turn (mask 0), then its turn (the engine's tokens,
                             mask 1) on its own trajectory; a role's first prompt is rendered when it first moves
          another role:      env.scripted(role)
          result = env.step(role, text) → observations per role ... until done
    each trajectory: its role's reward and outcome

A match stops unfinished (every role 0, outcome "draw") when it runs past ``env.max_turns`` turns of each
role or a role's trajectory has no room for its next observations (``env.max_tokens``).
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from dataclasses import dataclass, field

from relayrl.envs.chat import next_turn_suffix, render_ids
from relayrl.envs.multi import OUTCOMES, MultiStep, Players
from relayrl.records import FinishReason, SamplingParams, Trajectory, clear_tokens
from relayrl.rollout.episode import EpisodeFailed, EpisodeHost, anchor, describe_error, env_call


@dataclass
class _View:
    """One role's side of the match."""

    messages: list[dict]
    pending: list[dict] = field(default_factory=list)  # observations since its last turn
    turns: int = 0
    anchors: list[int] = field(default_factory=list)  # the game as each of its turns saw it (GiGPO's anchor states)


async def match_episode(runner: EpisodeHost, players: Players, trajs: dict[str, Trajectory], params: SamplingParams,
                        train: bool) -> None:
    """Run one match, ``trajs`` the policy's roles' trajectories (started afresh)."""
    budget = [runner.limits.episode_timeout_s]
    name = runner.limits.env_name
    try:
        env = players()
    except Exception as e:  # noqa: BLE001 - user code
        raise EpisodeFailed("env", f"env.name={name} (constructor)", describe_error(e)) from None
    try:
        await _run_match(runner, players, env, trajs, params, train, budget)
    finally:
        if callable(getattr(env, "close", None)):
            await env_call(runner, env, "close", (), budget, final=True)


def _bad(env, method: str, name: str, error: str) -> EpisodeFailed:
    return EpisodeFailed("env", f"{type(env).__name__}.{method} (env.name={name})", error)


def _roles_of(env, method: str, name: str, keys, roles: tuple[str, ...]) -> None:
    unknown = [r for r in keys if r not in roles]
    if unknown:
        raise _bad(env, method, name, f"named role {unknown[0]!r}, which the game does not have (roles: "
                                      f"{', '.join(roles)})")


async def _run_match(runner: EpisodeHost, players: Players, env, trajs: dict[str, Trajectory],
                     params: SamplingParams, train: bool, budget: list[float]) -> None:
    name, roles = runner.limits.env_name, players.roles
    prompt = next(iter(trajs.values())).prompt
    for role, t in trajs.items():
        t.info = {"role": role}
        t.finish_reason = None
        clear_tokens(t)
    opening = await env_call(runner, env, "reset", (prompt,), budget)
    if not isinstance(opening, dict):
        raise _bad(env, "reset", name, f"returned {type(opening).__name__}, not a dict of messages per role")
    _roles_of(env, "reset", name, opening, roles)
    views = {r: _View(list(opening.get(r, []))) for r in roles}
    counts: Counter = Counter()
    result = MultiStep()

    async def move(role: str) -> str | None:
        if role in trajs:  # None: no room for its observations, or the engine failed on it
            return await _policy_turn(runner, trajs[role], views[role], params, train)
        text = await env_call(runner, env, "scripted", (role,), budget)
        if not isinstance(text, str):
            raise _bad(env, "scripted", name, f"returned {type(text).__name__}, not the move's text")
        return text

    for _ in range(runner.limits.max_turns * len(roles)):
        who = await env_call(runner, env, "turn", (), budget)
        acting = list(who) if isinstance(who, (list, tuple)) else [who]
        _roles_of(env, "turn", name, acting, roles)
        if not acting or len(set(acting)) != len(acting):
            raise _bad(env, "turn", name, f"returned {who!r}: a role, or a list of distinct roles acting at once")
        texts = await asyncio.gather(*(move(r) for r in acting))  # (roles acting at once: generated together)
        if any(text is None for text in texts):
            break
        for role, text in zip(acting, texts):  # their moves reach the game in the order turn() named them
            result = await env_call(runner, env, "step", (role, text), budget)
            if not isinstance(result, MultiStep):
                raise _bad(env, "step", name, f"returned {type(result).__name__}, not a MultiStep")
            _roles_of(env, "step", name, result.messages, roles)
            for r, msgs in result.messages.items():
                views[r].pending += list(msgs)
            counts.update(result.info)
            if result.done:
                break
        if result.done:
            break
    if any(t.finish_reason == FinishReason.FAILED for t in trajs.values()):  # the engine failed: not scored
        return
    done = result.done
    rewards = dict(result.rewards or {}) if done else {}
    _roles_of(env, "step", name, rewards, roles)
    _roles_of(env, "step", name, result.outcome if done else {}, roles)
    for r, v in rewards.items():
        if not isinstance(v, (int, float)) or not math.isfinite(float(v)):
            raise _bad(env, "step", name, f"returned a non-finite reward {v!r} for role {r!r}")
    for role, t in trajs.items():
        outcome = result.outcome.get(role, "draw") if done else "draw"
        if outcome not in OUTCOMES:
            raise _bad(env, "step", name, f"gave role {role!r} the outcome {outcome!r}, not one of {OUTCOMES}")
        v = views[role]
        if v.turns == 0:  # it never moved (the other won or forfeited first): its prompt as it stood, no tokens
            seen = v.messages + v.pending
            t.prompt_ids = render_ids(runner.tokenizer, seen, add_generation_prompt=True) if seen else []
        t.reward = float(rewards.get(role, 0.0))
        t.text = next((m["content"] for m in reversed(v.messages) if m.get("role") == "assistant"), "")
        t.info = {"role": role, "outcome": outcome, "turns": v.turns,
                  "unfinished": int(not done), **{k: int(n) for k, n in counts.items()}}
        if v.turns:  # (GiGPO over matches: one step per move, the reward on the last; each move's state)
            t.info |= {"step_rewards": [0.0] * (v.turns - 1) + [t.reward], "anchors": v.anchors[: v.turns]}
        if t.finish_reason is None:
            t.finish_reason = FinishReason.STOP


async def _policy_turn(runner: EpisodeHost, t: Trajectory, v: _View, params: SamplingParams, train: bool
                       ) -> str | None:
    """The policy's next turn in role ``v``, on ``t``: its text, or None when the match cannot go on
    (no room left for its observations, or the engine failed on the turn)."""
    tok, lim = runner.tokenizer, runner.limits
    v.anchors.append(anchor(v.pending))  # (the observation its move starts from: GiGPO's anchor state)
    if v.turns == 0:
        v.messages += v.pending
        t.prompt_ids = render_ids(tok, v.messages, add_generation_prompt=True)
        start = 0
    else:
        suffix = next_turn_suffix(tok, v.messages, v.pending)
        if t.response_ids[-1] != tok.eos_token_id:  # stopped on another EOS id (or cut): end the turn
            suffix = [tok.eos_token_id] + suffix
        if len(t.response_ids) + len(suffix) >= lim.max_tokens:
            return None
        runner.append(t, suffix, [0.0] * len(suffix), [t.versions[-1]] * len(suffix), 0, v.turns - 1)
        v.messages += v.pending
        start, t.finish_reason = len(t.response_ids), None
    v.pending = []
    text = await runner.turn(t, v.turns, start, min(params.max_new_tokens, lim.max_tokens - start), params, train)
    v.messages.append({"role": "assistant", "content": text})
    v.turns += 1
    if t.finish_reason == FinishReason.FAILED:
        return None
    return text
