"""The rollout driver for episodes, sync and async alike (``run.mode``; ``env.name`` set).

Groups of episodes are admitted while the staleness manager grants capacity: η versions ahead
of the trainer at most (AReaL's rule), η = 0 for ``sync``, where a step's groups start once its
weights are published and the step waits for all of them (the barrier). Admitted groups run at
once on the episode runner's loop; whichever finish first are trained first.

Staleness without survivor bias. A group admitted at version a is *due* at version a + η: the
trainer takes due groups first and waits for one that is still running, so no group is ever
older than η versions and none is discarded or requeued. Discarding stale episodes (or
regenerating them) trains on the ones that happened to finish quickly, which for agents means
few turns and short tool calls; here every admitted episode is trained, whatever its length.
The capacity rule bounds the due groups at any version by one batch, so waiting on them is
waiting for the slowest of at most one batch, never more. With ``rollout.partial`` a weight
update aborts the turns in flight and the episodes continue them under the new weights (so a
long episode's later tokens are fresh); without it they finish under the weights they started.

Checkpoints: ``held`` stops admitting and returns the complete groups not yet trained and the
running ones as fresh groups (restarted from their prompt after a resume: nothing lost, nothing
trained twice); the live run goes on with them meanwhile.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque

from relayrl.config import Config
from relayrl.engine.base import EngineError
from relayrl.records import Group, SamplingParams, Trajectory
from relayrl.staleness import StalenessManager
from relayrl.timeline import Timeline


class EpisodeSource:
    def __init__(self, cfg: Config, c, state, tl: Timeline):
        from relayrl.sources import new_groups

        r = cfg.rollout
        self.c, self.state, self.runner = c, state, c.episodes
        self.new_groups = lambda prompts: new_groups(cfg, c, state, prompts)
        self.params = SamplingParams(r.max_new_tokens, r.temperature, r.top_p, r.top_k)
        self.eta = r.max_staleness if cfg.run.mode == "async" else 0
        self.batch, self.partial = r.prompts_per_step, r.partial
        self.mgr = StalenessManager(self.eta, self.batch, version=state.version)
        self.runner.timeline = tl
        self.runner.continued = state.staleness.get("partial_resumed", self.runner.continued)
        self.cv = threading.Condition()
        self.waiting: deque[Group] = deque(c.buffer.take(len(c.buffer)))  # carried by a checkpoint
        self.ready: list[Group] = []
        self.running: dict[int, Group] = {}
        self.seq: dict[int, int] = {}  # id(group) -> admission order
        self.admitted_at: dict[int, int] = {}  # id(group) -> version when admitted
        self.next_seq = 0
        self.hold = self.closed = False
        self.error: BaseException | None = None
        self.tasks: set[asyncio.Task] = set()
        # survivor-bias check: episodes finished and trained, by length (several turns or one)
        self.finished = {"long": 0, "short": 0}
        self.trained = {"long": 0, "short": 0}
        self.wake = self.runner.run(_event())
        self.admission = self.runner.submit(self._admit())

    # -- trainer side --------------------------------------------------------------------------
    def next_batch(self) -> tuple[list[Group], int]:
        """``batch`` complete groups: the due ones first, then in admission order."""
        with self.cv:
            while (batch := self._pick(self.state.version)) is None:
                self._raise_if_failed()
                self.cv.wait(0.5)
            for g in batch:
                self.ready.remove(g)
                for t in g.trajectories:
                    self.trained[_length_class(t)] += 1
        return batch, self.runner.take_generated()

    def _pick(self, version: int) -> list[Group] | None:
        def due(g: Group) -> bool:
            return version - self.admitted_at[id(g)] >= self.eta

        if len(self.ready) < self.batch or any(due(g) for g in self.running.values()):
            return None
        ready = sorted(self.ready, key=lambda g: self.seq[id(g)])
        return ([g for g in ready if due(g)] + [g for g in ready if not due(g)])[: self.batch]

    def score(self, groups: list[Group]) -> None:
        pass  # scored inside the episodes

    def publish(self, load) -> None:
        """New weights into the engine; with partial rollouts the turns in flight are cut at the
        update (inside one engine pause) and continue under the new weights."""
        if self.partial:
            with self.runner.engine.pause():
                self.runner.abort_inflight()
                load()
        else:
            load()
        self.mgr.set_version(self.state.version + 1)
        self.runner.loop.call_soon_threadsafe(self.wake.set)

    def held(self) -> list[Group]:
        """Stop admitting; the groups to carry in a checkpoint (see the module doc)."""
        return self.runner.run(self._snapshot())

    def release(self) -> None:
        self.hold = False
        self.runner.loop.call_soon_threadsafe(self.wake.set)

    def metrics(self) -> dict:
        return {"partial_resumed_total": self.runner.continued, "groups_in_flight": len(self.running),
                "episode_errors_total": self.runner.error_count,
                **{f"episodes_{k}_{c}_total": v[c] for k, v in (("finished", self.finished), ("trained", self.trained))
                   for c in v}}

    def counters(self) -> dict:
        return {"partial_resumed": self.runner.continued}

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.runner.run(self._cancel())

    def _raise_if_failed(self) -> None:
        if isinstance(self.error, EngineError):
            raise EngineError(str(self.error)) from self.error
        if self.error is not None:
            raise RuntimeError(f"episode rollout failed: {self.error!r}") from self.error

    # -- on the runner's loop ------------------------------------------------------------------
    async def _admit(self) -> None:
        try:
            while not self.closed:
                if not self.hold:
                    self._start()
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), 0.1)
                except asyncio.TimeoutError:
                    pass
                self.runner.mark_engine()
        except BaseException as e:  # noqa: BLE001 - surfaced to the trainer by next_batch
            self._fail(e)

    def _start(self) -> None:
        n = self.mgr.try_start(10**9)
        groups = [self.waiting.popleft() for _ in range(min(n, len(self.waiting)))]
        if len(groups) < n:
            groups += self.new_groups(self.c.sampler.take(n - len(groups)))
        for g in groups:
            with self.cv:
                self.seq[id(g)], self.admitted_at[id(g)] = self.next_seq, self.mgr.version
                self.next_seq += 1
                if all(t.done for t in g.trajectories):  # complete, carried by a checkpoint
                    self.mgr.finish(accepted=True)
                    self.ready.append(g)
                    self.cv.notify_all()
                    continue
                self.running[id(g)] = g
            task = asyncio.get_running_loop().create_task(self._run_group(g))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _run_group(self, g: Group) -> None:
        try:
            await self.runner.group(g, self.params)
        except asyncio.CancelledError:
            return
        except BaseException as e:  # noqa: BLE001 - an engine failure ends the run, with its reason
            self._fail(e)
            return
        with self.cv:
            del self.running[id(g)]
            for t in g.trajectories:
                self.finished[_length_class(t)] += 1
            self.mgr.finish(accepted=True)
            self.ready.append(g)
            self.cv.notify_all()

    def _fail(self, e: BaseException) -> None:
        with self.cv:
            self.error = self.error or e
            self.cv.notify_all()

    async def _snapshot(self) -> list[Group]:
        self.hold = True
        with self.cv:
            order = sorted([*self.ready, *self.running.values()], key=lambda g: self.seq[id(g)])
            out = [g if id(g) not in self.running else _fresh(g) for g in order]
        return out + list(self.waiting)

    async def _cancel(self) -> None:
        self.wake.set()
        tasks = list(self.tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.admission.cancel()


def _length_class(t: Trajectory) -> str:
    return "long" if t.info.get("turns", 1) > 1 else "short"


async def _event() -> asyncio.Event:
    return asyncio.Event()  # made on the loop that waits on it


def _fresh(g: Group) -> Group:
    """``g`` as it was admitted: a restart from its prompt."""
    return Group(g.prompt, g.group_id, [Trajectory(g.prompt, g.group_id, t.sample_idx, list(t.prompt_ids))
                                        for t in g.trajectories])
