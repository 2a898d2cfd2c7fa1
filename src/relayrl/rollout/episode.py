"""The episode, and the public interface every kind of episode is written on.

An episode runs one ``Trajectory`` to its end on an ``EpisodeRunner`` (``rollout.runner``), through
three public calls of an ``EpisodeHost`` (AReaL's ``RolloutWorkflow`` is the model):

    text = await runner.turn(t, turn, start, limit, params, train)   generate a turn onto ``t`` (mask 1)
    runner.append(t, ids, logprobs, versions, mask, turn)             record tokens that are not the policy's
    reward, failure = await runner.verified(text, t.prompt)           the verifier, batched, off the loop

and raises ``EpisodeFailed`` when user code fails it (counted, left out of training). Three kinds
use it: single-turn (``EpisodeRunner``), with an environment (``env_episode`` here), and an agent
program's sessions of the OpenAI-compatible endpoint (``relayrl.serve.agent``).

    with an environment:  messages = await env.reset(prompt)
        loop: generate a turn (the engine's tokens, mask 1) → env.step(text) → observations
              → the template's suffix for them (mask 0) → the next turn ... until done

The tokens between turns (tool results, headers, separators) come from the chat template
(``envs.chat.next_turn_suffix``) and are not trained. An environment whose ``reset``/``step``/``close``
raises or passes its deadline (``env.step_timeout_s`` each call, ``env.episode_timeout_s`` for all of
an episode's calls) fails its episode.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from relayrl.engine.base import EngineError
from relayrl.envs.base import Env
from relayrl.envs.chat import TemplateMismatch, elide, next_turn_suffix, render_ids
from relayrl.envs.tools import tool_schemas
from relayrl.failures import UserCodeError
from relayrl.models import images as images_of
from relayrl.models.vision import VisionError
from relayrl.records import FinishReason, SamplingParams, Trajectory, clear_tokens, tokens_of

class EpisodeHost(Protocol):
    """What an episode is written on: ``rollout.runner.EpisodeRunner`` is one; a test's stand-in or
    another runner can be. Episodes never call anything else of it."""

    tokenizer: Any
    limits: "EpisodeLimits | None"
    eos_ids: list[int]

    async def turn(self, t: Trajectory, turn: int, start: int, limit: int, params: SamplingParams, train: bool,
                   watch: Callable[[], bool] | None = None) -> str: ...

    def append(self, t: Trajectory, ids, logprobs, versions, mask: int, turn: int) -> None: ...

    async def verified(self, text: str, prompt) -> tuple[float, dict | None]: ...


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int
    max_tokens: int  # after the prompt: the policy's turns and the observations between them
    step_timeout_s: float = 60.0  # each call of the environment: reset, step, close
    episode_timeout_s: float = 600.0  # all of one episode's environment calls together
    env_name: str = "env"  # how failures name the environment (env.name's value)
    context: str = "end"  # when the next observations do not fit: end the episode, or "elide" (a new branch)
    max_context_tokens: int | None = None  # env.context=elide: a turn's whole context (null: prompt + max_tokens)


class EpisodeFailed(Exception):
    """User code (an environment, an agent program) failed this episode: it is left out of training and
    counted by ``kind`` (``relayrl.failures``); ``source`` names the code, ``error`` what happened."""

    def __init__(self, kind: str, source: str, error: str):
        super().__init__(error)
        self.kind, self.source, self.error = kind, source, error


def describe_error(e: BaseException) -> str:
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def trajectory_seed(seed: int | None, t: Trajectory, train: bool) -> int | None:
    """The sampling seed of one trajectory: a function of ``seed`` and, in training, its group id
    (unique over the run, and checkpointed) and sample index; in an evaluation, its prompt and
    sample index (every evaluation draws the same numbers)."""
    if seed is None:
        return None
    key = f"{seed}/{t.request_id if train else f'{t.prompt.id}/{t.sample_idx}'}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little")


def anchor(messages: list[dict]) -> int:
    """A stable id of an observation (GiGPO's anchor state): equal messages, equal ids."""
    blob = json.dumps(messages, sort_keys=True, ensure_ascii=False).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:7], "little")


async def env_episode(runner: EpisodeHost, make_env: Callable[[], Env], t: Trajectory, params: SamplingParams,
                      train: bool) -> None:
    """An episode with an environment (``env.name``): reset, then turns and steps until done; the
    verifier decides on the last turn unless the environment gave the final reward."""
    budget = [runner.limits.episode_timeout_s]  # what is left of the episode's time in environment calls
    started = time.monotonic()
    try:
        env = make_env()
    except Exception as e:  # noqa: BLE001 - user code
        raise EpisodeFailed("env", f"env.name={runner.limits.env_name} (constructor)", describe_error(e)) from None
    try:
        await _run_env_episode(runner, env, t, params, train, budget)
        # its wall time, and of it the time in environment calls (sandboxes, tools, tests: OS-level work)
        t.info |= {"env_s": round(runner.limits.episode_timeout_s - budget[0], 4),
                   "episode_s": round(time.monotonic() - started, 4)}
    finally:
        if callable(getattr(env, "close", None)):  # skyrl-gym style: release what the episode held
            await env_call(runner, env, "close", (), budget, final=True)

async def env_call(runner: EpisodeHost, env, method: str, args: tuple, budget: list[float], final: bool = False):
    """``env.<method>(*args)`` under its deadline (``env.step_timeout_s``, and what is left of
    ``env.episode_timeout_s``); what goes wrong raises ``EpisodeFailed`` naming the method."""
    source = f"{type(env).__name__}.{method} (env.name={runner.limits.env_name})"
    lim = runner.limits
    timeout = min(lim.step_timeout_s, max(budget[0], 0.0 if not final else lim.step_timeout_s))
    if timeout <= 0:
        raise EpisodeFailed("env_timeout", source, f"the episode's environment calls passed env.episode_timeout_s="
                                                f"{lim.episode_timeout_s:g}")
    start = time.monotonic()
    busy = getattr(runner, "env_busy", None)  # (the timeline's environment lane)
    if busy is not None:
        busy(+1)
    try:
        out = getattr(env, method)(*args)
        if inspect.isawaitable(out):
            out = await asyncio.wait_for(out, timeout)
        return out
    except asyncio.TimeoutError:
        which = "env.step_timeout_s" if timeout == lim.step_timeout_s else "env.episode_timeout_s"
        raise EpisodeFailed("env_timeout", source, f"no answer within {timeout:.3g} s ({which}="
                                                f"{getattr(lim, which.split('.')[1]):g})") from None
    except (EngineError, UserCodeError, TemplateMismatch, asyncio.CancelledError):
        raise
    except Exception as e:  # noqa: BLE001 - user code
        raise EpisodeFailed("env", source, describe_error(e)) from None
    finally:
        budget[0] -= time.monotonic() - start
        if busy is not None:
            busy(-1)

async def _run_env_episode(runner: EpisodeHost, env, t: Trajectory, params: SamplingParams, train: bool,
                           budget: list[float]) -> None:
    messages = list(await env_call(runner, env, "reset", (t.prompt,), budget))
    messages = _seen(runner, env, "reset", images_of.attach(messages, t.prompt.images) if t.prompt.images else messages)
    tools = tool_schemas(env.tools) if getattr(env, "tools", None) else None
    prompt_ids = _rendered(runner, env, "reset", lambda: render_ids(runner.tokenizer, messages, True, tools))
    carried = bool(t.response_ids) and prompt_ids == t.prompt_ids and 0 not in t.mask
    if not carried:  # a fresh episode, or one whose environment no longer renders its prompt
        t.prompt_ids, t.finish_reason = prompt_ids, None
        clear_tokens(t)
    _keep_images(t, messages)
    counts: Counter = Counter()
    context = runner.limits.max_context_tokens or len(t.prompt_ids) + runner.limits.max_tokens
    branches: list[dict] = []  # env.context=elide: the episode's branches before its history was rewritten
    step_rewards, anchors = [], [anchor(messages)]
    final: float | None = None
    carry = 0.0
    raised: str | None = None  # the first exception a tool raised (the failure report's example)
    for turn in range(runner.limits.max_turns):
        start = len(t.response_ids) if turn else 0  # turn 0 may go on from carried tokens
        if turn:
            t.finish_reason = None
        limit = min(params.max_new_tokens, runner.limits.max_tokens - start)
        text = await runner.turn(t, turn, start, limit, params, train)
        messages.append({"role": "assistant", "content": text})
        if t.finish_reason == FinishReason.FAILED:  # the engine failed on it: not the policy's answer
            return
        if t.finish_reason != FinishReason.STOP:  # cut by its token budget: scored as it stands
            break
        result = await env_call(runner, env, "step", (text,), budget)
        if result.reward is not None and not math.isfinite(float(result.reward)):
            raise EpisodeFailed("env", f"{type(env).__name__}.step (env.name={runner.limits.env_name})",
                             f"returned a non-finite reward {result.reward}")
        counts.update(result.info)
        raised = raised or (result.raised[0] if result.raised else None)
        if result.done or turn + 1 == runner.limits.max_turns:  # at the turn limit: that step's reward
            final = result.reward
            counts["turn_limit"] += int(not result.done)
            break
        seen = _seen(runner, env, "step", result.messages)
        suffix = _rendered(runner, env, "step", lambda: next_turn_suffix(runner.tokenizer, messages, seen, tools))
        if t.response_ids[-1] != runner.tokenizer.eos_token_id:  # stopped on another EOS id: end the turn
            suffix = [runner.tokenizer.eos_token_id] + suffix  # as the template does (not trained)
        if _full(runner.limits, t, suffix, params, context):
            rewritten = _rewrite(runner, messages, seen, tools, params, context)
            if rewritten is None:
                t.finish_reason = FinishReason.LENGTH  # no room for the observations: this turn is the last,
                carry = float(result.reward or 0.0)  # its step reward and the verifier's together (one step)
                break
            # env.context=elide: what was sampled so far is a branch of the episode, trained as sampled; the rest
            # goes on from the rewritten history, as a prompt of its own
            branches.append(tokens_of(t, json_safe=True) | {"finish_reason": FinishReason.STOP.value})
            messages, t.prompt_ids = rewritten
            clear_tokens(t)
        else:
            runner.append(t, suffix, [0.0] * len(suffix), [t.versions[-1]] * len(suffix), 0, turn)
            messages += seen
        _keep_images(t, messages)
        step_rewards.append(float(result.reward or 0.0))
        anchors.append(anchor(seen))
    if final is None and callable(getattr(env, "final_reward", None)):  # (a workspace: its tests decide)
        final = await env_call(runner, env, "final_reward", (), budget, final=True)
    if final is None:  # the verifier decides on the last turn
        final, t.failure = await runner.verified(messages[-1]["content"], t.prompt)
        if t.failure is not None:
            return
    step_rewards.append(float(final) + carry)
    t.reward = sum(step_rewards)
    t.text = messages[-1]["content"]
    t.info = {"turns": len(step_rewards), "step_rewards": step_rewards, "anchors": anchors[: len(step_rewards)],
              **{k: int(v) for k, v in counts.items()}, **({"tool_raised_example": raised} if raised else {}),
              **({"record": env.record} if getattr(env, "record", None) else {}),  # (a workspace: diff, tests)
              **({"branch_tokens": branches, "context_rewrites": len(branches)} if branches else {})}


def _seen(runner: EpisodeHost, env, method: str, messages: list[dict]) -> list[dict]:
    """An environment's messages with their image parts as markers and references (``models.images.with_images``);
    an image that cannot be read fails the episode, naming the message and part."""
    try:
        return [images_of.with_images(m, f"message {i}") for i, m in enumerate(messages, 1)]
    except images_of.ImageError as e:
        raise EpisodeFailed("env", f"{type(env).__name__}.{method} (env.name={runner.limits.env_name})", str(e)) from None


def _rendered(runner: EpisodeHost, env, method: str, render: Callable[[], list[int]]) -> list[int]:
    """``render()``; images the policy cannot take (a text-only model, a processor's refusal) fail the episode."""
    try:
        return render()
    except VisionError as e:
        raise EpisodeFailed("env", f"{type(env).__name__}.{method} (env.name={runner.limits.env_name})", str(e)) from None


def _keep_images(t: Trajectory, messages: list[dict]) -> None:
    """``t.images``: the images of its context, where its messages have any (or its prompt had)."""
    refs = images_of.refs_of(messages)
    t.images = refs if refs or t.prompt.images else None


def _full(limits: EpisodeLimits, t: Trajectory, suffix: list[int], params: SamplingParams, context: int) -> bool:
    """No room for the observations' tokens: past env.max_tokens, or (env.context=elide) past the context with
    a turn's tokens after them."""
    if len(t.response_ids) + len(suffix) >= limits.max_tokens:
        return True
    return limits.context == "elide" and len(t.prompt_ids) + len(t.response_ids) + len(suffix) + \
        params.max_new_tokens > context


def _rewrite(runner: EpisodeHost, messages: list[dict], new: list[dict], tools, params: SamplingParams,
             context: int) -> tuple[list[dict], list[int]] | None:
    """env.context=elide: the history with its tool outputs elided, then the new observations, and its tokens as
    the next branch's prompt; None when it still leaves no room for a turn (or the policy is "end")."""
    if runner.limits.context != "elide" or (elided := elide(messages)) is None:
        return None
    ids = render_ids(runner.tokenizer, elided + new, add_generation_prompt=True, tools=tools)
    room = min(context - len(ids), runner.limits.max_tokens)
    return (elided + new, ids) if room >= min(params.max_new_tokens, runner.limits.max_tokens) else None
