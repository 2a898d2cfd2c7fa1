"""Any agent program as an episode: ``env.name=agent:path/to/agent.py:run`` (or ``agent:module:run``).

    async def run(client: openai.AsyncOpenAI, prompt: relayrl.records.Prompt) -> float | None

``client`` is pointed at the episode's own session of the endpoint (``relayrl.serve.server``; its
base URL ``/sessions/<key>/v1`` and its API key both name the session); ``prompt`` is the dataset
row (``messages``, ``answer``, ``metadata``). The program talks to the model as to any
OpenAI-compatible server (tools, several turns, streaming) and returns the episode's reward, or
None to have ``reward.fn`` score its final answer: the text of the last reply the model gave.
Every reply is recorded as tokens (``sessions``) and trained with that reward.

Several agents in one program (``env.roles``): the endpoint serves each role's policy as the model
``<serve.model_name>/<role>`` (with ``model.lora.per_role``, each its own adapter), and the program picks
one per request. Each role's replies are a trajectory of their own, in that role's baseline; the program
returns one reward for all of them (cooperating roles) or a dict, one per role whose model it asked.

These episodes run in the one rollout driver like any other (``rollout.driver``): the staleness
bound, partial rollouts (a request in flight at a weight update goes on under the new weights, its
tokens tagged by version), checkpoints (an episode not finished is carried from its prompt: a
program's state cannot be saved) and resume. Deadlines as for an environment's calls: the time the
program runs between its requests counts, each stretch at most ``env.step_timeout_s`` and all
together ``env.episode_timeout_s`` (generation, bounded by the episode's tokens, is not counted).
The failure policy too (``relayrl.failures``): a program that raises, passes a deadline, returns
something other than a number or None, or never asks the model anything fails its episode, which
is left out of training and counted (``failures/env``, ``failures/env_timeout``), never scored 0. A
program that raises *because* the endpoint refused a request at the episode's limits
(``env.max_turns`` requests, ``env.max_tokens`` tokens) ends its episode there instead, scored by
``reward.fn`` like an environment episode at its turn limit.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from relayrl.envs.base import import_object
from relayrl.rollout.episode import EpisodeFailed, describe_error
from relayrl.records import FinishReason, SamplingParams, Trajectory, clear_tokens, tokens_of
from relayrl.serve.sessions import Session, SessionTable

@dataclass(frozen=True)
class AgentProgram:
    """``env.name=agent:...``: the program, and ``env.args`` (keyword arguments of each call)."""

    spec: str
    fn: Callable
    args: dict
    roles: tuple[str, ...] = ()  # env.roles: each served as the model "<serve.model_name>/<role>"
    workspace: object = None  # the workspace section (relayrl.workspaces.episode.Settings), for rows that are tasks

    def __call__(self, client, prompt):
        return self.fn(client, prompt, **self.args)

    @classmethod
    def load(cls, spec: str, target: str, args: dict, roles=(), workspace=None) -> AgentProgram:
        """The coroutine function ``target`` (``module:run`` or ``file.py:run``) that ``env.name=spec``
        names; a ``ValueError`` naming the field when it cannot be one."""
        for module in ("fastapi", "uvicorn", "openai"):
            _need(module)
        fn = import_object(target, "env.name")
        if not inspect.iscoroutinefunction(fn):
            raise ValueError(f"env.name={spec!r}: {getattr(fn, '__name__', fn)!r} must be an async function "
                             "run(client, prompt) -> float | None")
        try:
            inspect.signature(fn).bind(None, None, **args)
        except TypeError as e:
            raise ValueError(f"env.name={spec!r}: run(client, prompt{', **env.args' if args else ''}) does not fit "
                             f"its signature: {e}") from None
        bad = [r for r in roles if not r or "/" in r]
        if bad or len(set(roles)) != len(roles):
            raise ValueError(f"env.roles: {list(roles)} must be distinct names without '/' (each is served as the "
                             "model <serve.model_name>/<role>)")
        from relayrl.workspaces.episode import Settings

        return cls(spec, fn, dict(args), tuple(roles), Settings.of(workspace) if workspace is not None else Settings())


def _need(module: str) -> None:
    from relayrl.extras import require

    require(module, "serve", "env.name=agent:...")


class AgentEpisodes:
    """The endpoint (started on the runner's loop) and one session per episode."""

    def __init__(self, program, name: str, model_name: str, context: int | None, host: str = "127.0.0.1",
                 port: int = 0, max_requests: int = 256, max_connections: int = 1024):
        self.program, self.name, self.model_name, self.context = program, name, model_name, context
        self.host, self.port, self.max_requests, self.max_connections = host, port, max_requests, max_connections
        self.table = SessionTable()
        self.endpoint = None  # a relayrl.serve.server.Endpoint, once started

    @property
    def url(self) -> str:
        return self.endpoint.url

    async def start(self) -> None:
        import httpx

        from relayrl.serve.server import Endpoint, build_app

        app = build_app(self.table, self.model_name, self.context, self.max_requests, self.program.roles)
        self.endpoint = Endpoint(app, self.host, self.port, self.max_connections)
        await self.endpoint.start()

    async def stop(self) -> None:
        if self.endpoint is not None:
            await self.endpoint.stop()

    def client(self, s: Session):
        """The session's own client and connection pool: one pool shared by every episode costs each
        request a scan of all its connections (httpcore), most of the loop's time at 64 episodes."""
        import httpx
        import openai

        transport = httpx.AsyncHTTPTransport(verify=False, retries=0)  # (plain HTTP on loopback: no TLS)
        http = httpx.AsyncClient(transport=transport, timeout=None)
        # (retries: the SDK's, for 429/503 answered when the endpoint is at its limits, before any work)
        return openai.AsyncOpenAI(base_url=f"{self.url}/sessions/{s.key}/v1", api_key=s.key, max_retries=3,
                                  timeout=None, http_client=http), http

    async def episode(self, runner, t: Trajectory, params: SamplingParams, train: bool) -> None:
        """Run the program for ``t`` from its prompt; ``t`` gets the latest reply's branch, the other
        branches go in ``t.info["branches"]`` (``rollout.groups.expand_branches``). A row that is a workspace
        task gets its workspace (``prompt.workspace``), closed when the episode ends."""
        source = f"agent program {self.name} (env.name={runner.limits.env_name})"
        try:
            prompt, ws = await _with_workspace(t.prompt, self.program.workspace)
        except Exception as e:  # noqa: BLE001 - infrastructure: the episode fails, it is not scored
            raise EpisodeFailed("env", source, f"its workspace: {describe_error(e)}") from None
        try:
            await self._episode(runner, t, params, train, prompt, ws, source)
        finally:
            if ws is not None:
                await ws.close()

    async def _episode(self, runner, t: Trajectory, params: SamplingParams, train: bool, prompt, ws, source) -> None:
        lim = runner.limits
        clear_tokens(t)
        t.finish_reason, t.info = None, {}
        s = self.table.new(runner, t, params, train, lim.max_turns, lim.max_tokens, self.context)
        client, http = self.client(s)
        task = asyncio.get_running_loop().create_task(self.program(client, prompt))
        try:
            try:
                result = await _watch(task, s, lim, source)
            except EpisodeFailed:
                raise
            except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
                raise
            except Exception as e:  # noqa: BLE001 - user code
                if s.fatal is not None:
                    raise s.fatal from None
                if s.limit_hit is None:
                    raise EpisodeFailed("env", source, describe_error(e)) from None
                result = None  # ended at the episode's limits: scored as it stands
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            self.table.close(s)
            await http.aclose()
        if s.fatal is not None:
            raise s.fatal
        branches = s.trained()
        if not branches:
            raise EpisodeFailed("env", source, "it never asked the model anything: there is nothing to train")
        if result is None and ws is not None:  # a workspace task: its tests decide
            try:
                result = await ws.verdict()
            except Exception as e:  # noqa: BLE001 - infrastructure: the episode fails, it is not scored
                raise EpisodeFailed("env", source, f"its workspace's tests: {describe_error(e)}") from None
        reward_of = _rewards(result, self.program.roles, {b.info.get("role") for b in branches}, source)
        final = s.last[1]
        if reward_of is None:
            result, t.failure = await runner.verified(final, t.prompt)
            if t.failure is not None:
                return
            reward_of = lambda role: float(result)  # noqa: E731
        main = branches[-1]
        for name, value in tokens_of(main).items():  # (every per-token field: records.TOKEN_FIELDS)
            setattr(t, name, value)
        t.finish_reason = main.finish_reason if main.finish_reason is not None else FinishReason.STOP
        role = main.info.get("role")
        t.reward, t.text = reward_of(role), final
        c = s.counts
        t.info = {"turns": c["requests"], "tool_calls": c["tool_calls"], "tool_errors": c["tool_errors"],
                  "branches": len(branches) - 1, "sampling_overrides": c["sampling_overrides"],
                  "merged_turns": c["merged"], "new_branch_tools_changed": c["new_branch_tools_changed"],
                  **({"turn_limit": 1} if s.limit_hit else {}), **({"role": role} if role else {})}
        if ws is not None and ws.record:
            t.info["record"] = ws.record  # (the diff that was tested, the tests' statuses)
        if len(branches) > 1:  # (each other role's latest reply: a trajectory of its own, "own"; the rest branches)
            mains = {id(b.traj) for r, b in s.last_of.items() if r != role}
            t.info["branch_tokens"] = [tokens_of(b, json_safe=True)
                                         | {"finish_reason": (b.finish_reason or FinishReason.STOP).value}
                                         | ({"role": b.info["role"], "reward": reward_of(b.info["role"]),
                                             "own": id(b) in mains} if b.info.get("role") else {})
                                         for b in branches[:-1]]


async def _with_workspace(prompt, settings):
    """(the prompt the program gets, its workspace): for a row that is a workspace task, a copy of the prompt
    whose ``workspace`` is the episode's (``relayrl.workspaces.episode.EpisodeWorkspace``: ``.path``,
    ``await .run(command, timeout=...)``); else the prompt, whose ``workspace`` is None."""
    from relayrl.workspaces.episode import EpisodeWorkspace
    from relayrl.workspaces.tasks import Task

    task = Task.of(prompt)
    if task is None:
        return prompt, None
    ws = await EpisodeWorkspace(task, settings).open()
    prompt = copy.copy(prompt)
    object.__setattr__(prompt, "workspace", ws)  # (a frozen dataclass: this episode's copy)
    return prompt, ws


def _rewards(result, roles: tuple[str, ...], played: set, source: str) -> Callable[[str | None], float] | None:
    """The reward of each role's trajectories from what the program returned (None: reward.fn scores the
    episode), or ``EpisodeFailed`` naming what is wrong with it."""
    def number(x, what: str) -> float:
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise EpisodeFailed("env", source, f"returned {type(x).__name__} {x!r:.60}{what}: run must return a float"
                                               f"{', a dict of floats per role,' if roles else ''} or None")
        if not math.isfinite(x):
            raise EpisodeFailed("env", source, f"returned a non-finite reward {x}{what}")
        return float(x)

    if result is None:
        return None
    if not isinstance(result, dict):
        value = number(result, "")
        return lambda role: value
    if not roles:
        raise EpisodeFailed("env", source, "returned a dict: rewards per role need the roles named in env.roles")
    unknown = [r for r in result if r not in roles]
    if unknown:
        raise EpisodeFailed("env", source, f"returned a reward for role {unknown[0]!r:.40}, which is not one of "
                                           f"env.roles ({', '.join(roles)})")
    if None in played:
        raise EpisodeFailed("env", source, "returned rewards per role, but asked the model without a role")
    missing = sorted(r for r in played if r not in result)
    if missing:
        raise EpisodeFailed("env", source, f"returned no reward for role {missing[0]!r}, whose model it asked")
    values = {r: number(v, f" for role {r!r}") for r, v in result.items()}
    return lambda role: values[role]


async def _watch(task: asyncio.Task, s: Session, lim, source: str):
    """The program's result, under its deadlines: the time it runs between requests (none in flight)
    counts, each stretch at most ``env.step_timeout_s``, all of them ``env.episode_timeout_s``."""
    budget = lim.episode_timeout_s
    while not task.done():
        s.activity.clear()
        if s.in_flight:
            await _first(task, s.activity, None)
            continue
        allowed = min(lim.step_timeout_s, budget)
        start = time.monotonic()
        await _first(task, s.activity, allowed)
        budget -= time.monotonic() - start
        if not task.done() and not s.in_flight and not s.activity.is_set():
            which = "env.step_timeout_s" if allowed == lim.step_timeout_s else "env.episode_timeout_s"
            value = lim.step_timeout_s if which == "env.step_timeout_s" else lim.episode_timeout_s
            raise EpisodeFailed("env_timeout", source, f"no request to the model nor an answer within {allowed:.3g} s "
                                                    f"({which}={value:g})")
    return task.result()


async def _first(task: asyncio.Task, event: asyncio.Event, timeout: float | None) -> None:
    waiter = asyncio.get_running_loop().create_task(event.wait())
    try:
        await asyncio.wait({task, waiter}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
