"""``EpisodeRunner``: where every episode runs. One coroutine per episode drives the engine (and an
environment) and returns the trajectory, scored, token-in-token-out. Every rollout is made of episodes.

    single-turn (no environment):  generate → verify (``reward.fn``)                       here
    with an environment:           reset, then turns and steps until done          ``rollout.episode``
    an agent program:              run(client, prompt) on a session of the OpenAI-compatible
        endpoint (``relayrl.serve.agent``): each request a turn, generated here (``turn``), recorded the same way

The kinds are written on the runner's public interface (``turn``, ``append``, ``verified``,
``EpisodeFailed``: ``rollout.episode``).

Every token the policy generated keeps its id, behaviour log-prob and policy version; the
tokens between turns (tool results, headers, separators) come from the chat template
(``envs.chat.next_turn_suffix``) and are not trained. ``Trajectory.turns`` says which turn each
token belongs to. The reward is computed inside the episode (the environment's, or ``reward.fn``
on the final turn), off the trainer's thread.

User code that fails never becomes training data (``relayrl.failures``): a verifier that raises or
times out, an environment whose ``reset``/``step``/``close`` raises or passes its deadline
(``env.step_timeout_s`` each call, ``env.episode_timeout_s`` for all of an episode's calls), leave
the episode out, counted by kind; a chat template that cannot extend the conversation
(``TemplateMismatch``) stops the run. An environment that blocks the loop itself (a blocking call
inside ``async def step``) cannot be cancelled: ``check_alive`` finds the loop stuck past the step
deadline and stops the run naming the line it is stuck on.

A turn cut short (a weight update with ``rollout.partial``, or ``hold`` for a checkpoint) is
continued from its tokens: partial rollout at the episode level. An episode still in its first
turn can be carried in a checkpoint with its tokens and continued after a resume (its
environment is reset and must render the same prompt); one past a tool call restarts from its
prompt, since an environment's state cannot be saved.

``EpisodeRunner`` owns one asyncio loop in a thread and the async front of the engine; many
episodes run at once on it, so while one waits on a tool the others generate. Requests reach
the engine in the order of ``rollout.schedule`` (lengths learnt from finished turns).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import dataclasses
import itertools
import sys
import threading
import time
import traceback
from collections.abc import Callable

from relayrl.engine.async_front import AsyncEngine
from relayrl.engine.base import Engine, EngineError
from relayrl.envs.base import Env
from relayrl.envs.chat import TemplateMismatch
from relayrl.envs.multi import Players, family
from relayrl.failures import UserCodeError, fail
from relayrl.fault_injection import fault_point
from relayrl.models import moe
from relayrl.records import Completion, FinishReason, GenRequest, Group, SamplingParams, Trajectory, context_images
from relayrl.rollout.match import match_episode
from relayrl.rollout.episode import EpisodeFailed, EpisodeLimits, describe_error, env_episode, trajectory_seed
from relayrl.rollout.scheduling import LengthModel, Pending, order
from relayrl.rollout.scoring import EpisodeScoring


class EpisodeRunner:
    """Runs episodes on one asyncio loop (a daemon thread). ``score(text, prompt) -> (reward,
    failed)`` is the verifier, or ``score_batch([(text, prompt), ...])`` for many at once (blocking;
    run on a thread; the calls of episodes that end together go as one batch). ``make_env()``
    makes one environment per episode (None: single-turn episodes over prompts already
    tokenized, ``Trajectory.prompt_ids``)."""

    BLOCKED_GRACE_S = 10.0  # how much longer than env.step_timeout_s the loop may be away before check_alive stops
    # How long ``hold`` waits for the engine to return the requests it aborted. An abort takes effect
    # at the engine's next step (milliseconds; seconds for a long prefill), so this only ends the
    # wait on an engine that is hung or stopped decoding, which would stall a checkpoint (or a sync
    # step's barrier) forever; 5 minutes leave room for a slow step, a recompile or a full batch's
    # prefill on a slow device. (No config field bounds the rollout's time this could follow.)
    ABORT_WAIT_S = 300.0

    def __init__(self, engine: Engine, tokenizer, make_env: Callable[[], Env] | None, limits: EpisodeLimits | None,
                 score: Callable[[str, object], tuple[float, dict | None]] | None = None, schedule: str = "fifo",
                 score_batch: Callable[[list[tuple[str, object]]], list[tuple[float, dict | None]]] | None = None,
                 eos_ids: list[int] | None = None, agent=None, scoring: dict | None = None):
        if (score is None) == (score_batch is None):
            raise ValueError("give the verifier as score or as score_batch")
        self.tokenizer, self.make_env, self.limits = tokenizer, make_env, limits
        self.agent = agent  # agent programs (``relayrl.serve.agent``): each episode a session of the endpoint
        # every id the engine stops on (a generation config may list several: Qwen2.5's <|im_end|> and
        # <|endoftext|>); the template's end of turn is tokenizer.eos_token_id
        self.eos_ids = set(eos_ids or []) | {tokenizer.eos_token_id}
        self.score_batch = score_batch or (lambda items: [score(text, prompt) for text, prompt in items])
        self._to_score: list[tuple[str, object, asyncio.Future]] = []
        if (make_env is not None or agent is not None) and limits is None:
            raise ValueError("episodes with an environment need limits (env.max_turns, env.max_tokens)")
        self.schedule, self.lengths = schedule, LengthModel()
        self.driven = getattr(engine, "driven", False)  # decoded by the thread that waits (``serve``)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="relayrl-episodes", daemon=True)
        self._thread.start()
        self._beat = time.monotonic()  # the loop's heartbeat: ``check_alive`` finds a loop that stopped
        self.loop.call_soon_threadsafe(self._heartbeat)
        self.engine = AsyncEngine(engine, self.loop, order=None if schedule == "fifo" else self._order)
        self._ids = itertools.count()
        self.per_role_adapters = False  # model.lora.per_role: each request decoded under its role's adapter
        self._lock = threading.Lock()
        self.inflight: dict[str, Trajectory] = {}  # request id -> its trajectory (cut by a partial publish)
        # request id -> (tokens of its turn so far, continued after a cut?, a training episode's?)
        self._turn_of: dict[str, tuple[int, bool, bool]] = {}
        self._go = self.run(_event())  # cleared while held: no training turn starts
        self._go.set()
        self.generated = 0  # training episodes' policy tokens since ``take_generated``
        self.continued = 0  # turns continued after a cut (cumulative)
        self.errors: list[str] = []  # episodes that failed in user code (first few messages)
        self.error_count = 0
        self._verify = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="relayrl-verify")
        # a judge and teachers (``rollout.scoring``: EpisodeScoring's arguments), after each episode's body
        self.scoring = EpisodeScoring(self.loop, self._verify, **scoring) if scoring else None
        self.timeline = None  # a Timeline: the engine lane is busy while a request is in flight
        self._busy_since: float | None = None
        self._env_calls, self._env_since = 0, 0.0  # environment calls in flight, since when
        if agent is not None:  # the endpoint, served on this loop
            try:
                self.submit(agent.start()).result(timeout=60)
            except BaseException:
                self.close()
                raise

    @property
    def multi_turn(self) -> bool:
        """Episodes talk to an environment or are agent programs (tool-call statistics apply)."""
        return self.make_env is not None or self.agent is not None

    # -- called from other threads -------------------------------------------------------------
    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro):
        fut = self.submit(coro)
        while not fut.done():
            if self.driven:
                self.serve(fut.done)
            else:
                concurrent.futures.wait([fut], timeout=0.5)
            self.check_alive()
        return fut.result()

    def _on_loop(self, make: Callable) -> concurrent.futures.Future:
        """The coroutine ``make()`` run on the loop, made there: a loop that stops before it gets to it leaves
        no coroutine behind never awaited (``submit(make())`` would, dropped with the loop's pending callbacks:
        the RuntimeWarning about ``close.<locals>.cancel_all`` at shutdown)."""
        out: concurrent.futures.Future = concurrent.futures.Future()

        def done(task: asyncio.Task) -> None:
            if task.cancelled():
                out.set_exception(concurrent.futures.CancelledError())
            elif task.exception() is not None:
                out.set_exception(task.exception())
            else:
                out.set_result(task.result())

        def start() -> None:
            if out.set_running_or_notify_cancel():
                self.loop.create_task(make()).add_done_callback(done)

        self.loop.call_soon_threadsafe(start)
        return out

    def _run_loop(self) -> None:
        try:
            self.loop.run_forever()
        except SystemExit:  # ``_interrupt``: the loop was stuck in user code and the run is stopping
            pass

    def _heartbeat(self) -> None:
        self._beat = time.monotonic()
        self.loop.call_later(0.25, self._heartbeat)

    def blocked_for(self) -> float:
        return time.monotonic() - self._beat

    def check_alive(self) -> None:
        """``UserCodeError`` if the loop has not come back for longer than an environment call may take:
        code running on it blocks (``time.sleep`` or a blocking request inside ``async def step``), so
        no deadline can fire and nothing else runs. Names the line it is stuck on."""
        limit = (self.limits.step_timeout_s if self.limits else 60.0) + self.BLOCKED_GRACE_S
        if not self._thread.is_alive() or self.blocked_for() <= limit:
            return
        import os

        frame = sys._current_frames().get(self._thread.ident)
        stack = traceback.extract_stack(frame) if frame is not None else []
        # relayrl's frames and asyncio's are known by where the packages are installed, never by a folder's
        # name: a user's environment in a clone named relayrl (git's default) is the user's code all the same
        package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # (src/relayrl: this file's package)
        own = (package + os.sep, os.path.dirname(asyncio.__file__) + os.sep)
        user = [f for f in stack if not f.filename.startswith(own)]
        where = f"{user[-1].filename}:{user[-1].lineno} in {user[-1].name}" if user else "an unknown place"
        self._interrupt()
        raise UserCodeError(
            f"the episodes' event loop has been blocked for {self.blocked_for():.0f} s at {where} (env.name="
            f"{self.limits.env_name if self.limits else None}): code on the loop must not block (in an async reset/step "
            f"run blocking work with asyncio.to_thread), since no deadline can stop it; the run stops")

    def _interrupt(self) -> None:
        """Raise SystemExit in the blocked loop thread when it next runs Python code (a call blocked in
        C, e.g. one long sleep, is not interrupted; the thread is a daemon and ends with the process)."""
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._thread.ident), ctypes.py_object(SystemExit))

    def serve(self, until: Callable[[], bool], timeout: float = 0.05) -> None:
        """A driven engine decodes on this thread until ``until()`` or ``timeout`` with nothing to do."""
        front = self.engine
        front.pump()
        front.engine.serve(lambda: front.pump() or until(), timeout)

    def abort_inflight(self) -> None:
        with self._lock:
            ids = list(self.inflight)
        self.engine.abort(ids)

    def hold(self) -> None:
        """Stop the training episodes at a token boundary: what they have in flight is cut (kept,
        continued after ``release``) and no turn of theirs starts. Returns once none is in flight.
        Evaluation episodes run meanwhile."""
        self.run(self._hold())

    def release(self) -> None:
        self.loop.call_soon_threadsafe(self._go.set)

    async def _hold(self) -> None:
        self._go.clear()
        self.abort_inflight()
        deadline = time.monotonic() + self.ABORT_WAIT_S
        while waiting := [rid for rid in list(self.inflight) if self._turn_of.get(rid, (0, False, True))[2]]:
            if time.monotonic() > deadline:
                raise EngineError(self._abort_timeout(len(waiting)))
            await asyncio.sleep(0.002)

    def _abort_timeout(self, n: int) -> str:
        return (f"the engine ({type(self.engine.engine).__name__}) did not return its {n} aborted "
                f"request{'s' if n != 1 else ''} within {self.ABORT_WAIT_S:g} s, which a checkpoint or a sync "
                "step's barrier waits for: it is hung or has stopped decoding; check the engine's log, that its "
                "process (or Ray actor) is alive, and its device (nvidia-smi: busy, out of memory?)")

    def mark_engine(self) -> None:
        """Record the engine lane (busy while requests are in flight) up to now, an open busy period too."""
        with self._lock:
            self._mark(split=True)

    def env_busy(self, delta: int) -> None:
        """An environment call starts (+1) or ends (-1): the timeline's environment lane is busy while one is in
        flight (OS-level work: sandboxes, tools, tests), which the engine lane shows generation overlapping."""
        with self._lock:
            self._env_calls += delta
            if self.timeline is not None and delta > 0 and self._env_calls == 1:
                self._env_since = self.timeline.now()
            elif self.timeline is not None and self._env_calls == 0:
                self.timeline.record("environment", self._env_since, self.timeline.now())

    def _mark(self, split: bool = False) -> None:
        if self.timeline is None:
            return
        now, busy = self.timeline.now(), bool(self.inflight)
        if self._busy_since is not None and (not busy or split or now - self._busy_since >= 0.1):
            self.timeline.record("engine", self._busy_since, now)
            self._busy_since = None
        if busy and self._busy_since is None:
            self._busy_since = now

    def take_generated(self) -> int:
        with self._lock:
            n, self.generated = self.generated, 0
        return n

    def close(self) -> None:
        async def cancel_all():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self.loop.is_running() and self.blocked_for() < 5:  # (a blocked loop cannot cancel anything)
            try:
                if self.agent is not None:
                    self._on_loop(self.agent.stop).result(timeout=30)
                self._on_loop(cancel_all).result(timeout=30)
            except concurrent.futures.TimeoutError:
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
        self.engine.close()
        self._verify.shutdown(wait=False, cancel_futures=True)
        if self.scoring is not None:
            self.scoring.close()

    # -- on the loop ---------------------------------------------------------------------------
    async def group(self, g: Group, params: SamplingParams, train: bool = True) -> Group:
        """Every episode of ``g`` not yet complete, at once (``train=False``: evaluation, which
        runs on while training episodes are held)."""
        if isinstance(self.make_env, Players):  # a multi-agent environment: matches, one trajectory per role
            await asyncio.gather(*(self.match(m, params, train) for m in self.make_env.matches(g.trajectories, train)
                                   if not all(t.complete for t in m.values())))
        else:
            await asyncio.gather(*(self.episode(t, params, train) for t in g.trajectories if not t.complete))
        if self.scoring is not None:
            await self.scoring.group(g, train)  # (a ranking judge: the group's episodes, together)
        self.lengths.forget_group(g.group_id)
        return g

    async def episode(self, t: Trajectory, params: SamplingParams, train: bool = True) -> None:
        """Run ``t`` to its end (from its start, or on from a turn carried by a checkpoint). User code
        that fails (the verifier, the environment) fails this episode only: ``t.failure``, left out
        of training (``relayrl.failures``); a template that cannot extend the conversation stops the run."""
        t.failure = None
        t.teacher_logprobs = []
        for k in ("reward_own", "judge"):  # (a judge's, of an earlier run of this episode)
            t.info.pop(k, None)
        try:
            if self.agent is not None:
                await self.agent.episode(self, t, params, train)
            elif self.make_env is None:
                await self._single(t, params, train)
            else:
                await env_episode(self, self.make_env, t, params, train)
            if self.scoring is not None:
                await self.scoring.episode(t, train)
        except (EngineError, UserCodeError, asyncio.CancelledError):
            raise
        except TemplateMismatch as e:
            raise UserCodeError(
                f"the chat template of the tokenizer ({getattr(self.tokenizer, 'name_or_path', '?')}) cannot extend a "
                f"conversation token-in-token-out: {e}. Every multi-turn episode would fail the same way, so the run "
                "stops. Give a template that renders earlier turns unchanged once later ones follow (a Qwen3-style "
                "template drops earlier reasoning: use one that keeps it) with model.tokenizer, or train single-turn"
            ) from None
        except EpisodeFailed as e:
            fail(t, e.kind, e.source, e.error)
        except Exception as e:  # noqa: BLE001 - rendering the environment's messages, its tools' schemas
            fail(t, "env", f"env.name={self.limits.env_name if self.limits else None}", describe_error(e))
        if t.failure is not None:
            self.error_count += 1
            if len(self.errors) < 5:
                self.errors.append(f"{t.failure['source']}: {t.failure['error']}")
        t.complete = True

    async def match(self, trajs: dict[str, Trajectory], params: SamplingParams, train: bool = True) -> None:
        """One match of a multi-agent environment (``rollout.match``), ``trajs`` its policy roles' trajectories,
        run afresh. Its failure (user code, or the engine on one of its turns) is each of its trajectories'."""
        every = list(trajs.values())
        for t in every:
            t.failure, t.teacher_logprobs, t.info = None, [], {}
        try:
            await match_episode(self, self.make_env, trajs, params, train)
            if self.scoring is not None:
                for t in every:
                    await self.scoring.episode(t, train)
        except (EngineError, UserCodeError, asyncio.CancelledError):
            raise
        except TemplateMismatch as e:
            raise UserCodeError(f"the chat template of the tokenizer cannot extend a match's conversation "
                                f"token-in-token-out: {e}") from None
        except EpisodeFailed as e:
            for t in every:
                fail(t, e.kind, e.source, e.error)
        except Exception as e:  # noqa: BLE001 - rendering the environment's messages
            for t in every:
                fail(t, "env", f"env.name={self.limits.env_name}", describe_error(e))
        broken = next((t for t in every if t.failure is not None or t.finish_reason == FinishReason.FAILED), None)
        if broken is not None:
            why = broken.failure or {"kind": "engine", "source": "the engine", "error": "failed on a turn"}
            for t in every:
                if t.failure is None:
                    fail(t, why["kind"], why["source"], f"{why['error']} (role {broken.info.get('role', '?')})")
            self.error_count += 1
            if len(self.errors) < 5:
                self.errors.append(f"{why['source']}: {why['error']}")
        for t in every:
            t.complete = True

    async def _single(self, t: Trajectory, params: SamplingParams, train: bool) -> None:
        await self.turn(t, 0, 0, params.max_new_tokens, params, train)
        if t.finish_reason == FinishReason.FAILED:  # the engine failed on it: not the policy's answer
            return
        t.text = self.tokenizer.decode(t.response_ids, skip_special_tokens=True)
        t.reward, t.failure = await self.verified(t.text, t.prompt)

    async def turn(self, t: Trajectory, turn: int, start: int, limit: int, params: SamplingParams,
                    train: bool, watch: Callable[[], bool] | None = None) -> str:
        """Generate turn ``turn`` (its tokens from index ``start``) onto ``t`` until it stops,
        continued across cuts; its text. A turn already finished (carried) is not generated.
        ``watch`` (the endpoint's stop strings and streaming): tokens are streamed onto ``t`` and
        ``watch()`` called after each piece; True stops the turn there (``FinishReason.STOP``; it may
        have cut ``t`` back to where the turn should end)."""
        while t.finish_reason in (None, FinishReason.ABORTED):
            left = limit - (len(t.response_ids) - start)
            if left <= 0:
                t.finish_reason = FinishReason.LENGTH
                break
            if train:
                await self._go.wait()  # held (a checkpoint, a sync step's barrier): wait for release
            rid = f"{t.request_id}#{next(self._ids)}"  # unique: an aborted id may still be in the engine
            req = GenRequest(rid, t.prompt_ids, dataclasses.replace(params, max_new_tokens=left, seed=trajectory_seed(
                params.seed, t, train)), list(t.response_ids), images=context_images(t),
                adapter=family(t.info.get("role")) if self.per_role_adapters else None)
            with self._lock:
                self.inflight[rid] = t
                self._turn_of[rid] = (len(t.response_ids) - start, t.finish_reason is not None, train)
                self._mark()
            try:
                if watch is None:
                    c = await self.engine.generate(req)
                    self._take(t, c, turn, train)
                else:
                    c = await self._streamed(req, t, turn, train, watch)
            finally:
                with self._lock:
                    self.inflight.pop(rid, None)
                    self._turn_of.pop(rid, None)
                    self._mark()
            if train:
                fault_point("generate")  # crash tests: a kill as completions arrive
            t.finish_reason = c.finish_reason
            self.continued += c.finish_reason == FinishReason.ABORTED
        if t.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.lengths.observe(t.prompt.id, t.group_id, len(t.response_ids) - start)
        ids = t.response_ids[start:]
        if ids and ids[-1] in self.eos_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _take(self, t: Trajectory, c: Completion, turn: int, train: bool) -> None:
        if not len(c.token_ids) == len(c.logprobs) == len(c.versions):
            raise EngineError(f"the engine returned a ragged completion for {c.request_id}")
        self.append(t, c.token_ids, c.logprobs, c.versions, 1, turn)
        t.routes = moe.extend(t.routes, c.routes)  # (a mixture of experts': routing replay)
        if train:
            with self._lock:
                self.generated += len(c.token_ids)

    async def _streamed(self, req: GenRequest, t: Trajectory, turn: int, train: bool,
                        watch: Callable[[], bool]) -> Completion:
        """``req`` streamed onto ``t`` piece by piece; stopped (aborted in the engine) when ``watch()``
        says so. The completion's finish reason (its tokens are on ``t`` already)."""
        async with contextlib.aclosing(self.engine.stream(req)) as pieces:
            async for c in pieces:
                self._take(t, c, turn, train)
                n = len(t.response_ids)
                if watch():
                    if train:  # the tokens a stop cut off are no part of the reply: not counted as generated
                        with self._lock:
                            self.generated -= n - len(t.response_ids)
                    return Completion(req.request_id, [], [], [], FinishReason.STOP)
                if c.finish_reason is not None:
                    return c
        raise EngineError(f"the engine's stream of {req.request_id} ended without a finish reason")

    async def verified(self, text: str, prompt) -> tuple[float, dict | None]:
        """The verifier's (reward, failure or None) for a final turn, off the loop; the calls made in one loop
        iteration (episodes whose last tokens arrived together) go to it as one batch."""
        fut = self.loop.create_future()
        if not self._to_score:
            self.loop.call_soon(self._score_pending)
        self._to_score.append((text, prompt, fut))
        reward, failure = await fut
        return reward, failure or None

    def _score_pending(self) -> None:
        batch, self._to_score = self._to_score, []
        job = self.loop.run_in_executor(self._verify, self.score_batch, [(text, p) for text, p, _ in batch])

        def resolve(job: asyncio.Future) -> None:
            error = job.exception() if not job.cancelled() else asyncio.CancelledError()
            for i, (_, _, fut) in enumerate(batch):
                if not fut.done():
                    fut.set_exception(error) if error else fut.set_result(job.result()[i])

        job.add_done_callback(resolve)

    def _order(self, requests: list[GenRequest]) -> list[GenRequest]:
        """One submission in ``rollout.schedule`` order (called by the async front, on the loop)."""
        with self._lock:
            pending = []
            for i, r in enumerate(requests):
                t = self.inflight.get(r.request_id)
                done, cont, _ = self._turn_of.get(r.request_id, (0, False, True))
                pending.append(Pending(r.request_id, t.prompt.id if t else "", t.group_id if t else "", done, i, cont))
        by_id = {r.request_id: r for r in requests}
        return [by_id[p.request_id] for p in order(pending, self.schedule, self.lengths)]

    @staticmethod
    def append(t: Trajectory, ids, logprobs, versions, mask: int, turn: int) -> None:
        t.response_ids += list(ids)
        t.behav_logprobs += list(logprobs)
        t.versions += list(versions)
        t.mask += [mask] * len(ids)
        t.turns += [turn] * len(ids)


async def _event() -> asyncio.Event:
    return asyncio.Event()  # made on the loop that waits on it
