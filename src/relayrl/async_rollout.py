"""Asynchronous rollout with bounded staleness (AReaL), partial rollouts (APRIL) and length-aware
ordering (Seer): generation never waits for training.

A rollout thread keeps the engine fed. It starts groups while the staleness manager grants
capacity (η versions ahead of the trainer at most), submits their unfinished responses in the
order of the scheduling policy, and collects completions as they stream out; a group whose
members are all done becomes *ready*. The trainer takes the oldest ready groups. A group whose
oldest token is more than η versions behind the trainer is never trained on: it is requeued
(regenerated from its prompt, so the epoch loses nothing) or discarded (``rollout.stale``),
and counted.

Weight updates go into the engine while requests are in flight. Without partial rollouts the
requests continue under the new weights (keeping their KV cache, as AReaL does). With partial
rollouts they are aborted at the next token and re-submitted with their tokens so far: the
engine refills its batch around them and their context is recomputed under the new policy.
Either way every token carries the version that sampled it.

For a checkpoint, ``held()`` stops starting work, aborts what is in flight and returns every
group the rollout holds (ready, partial, waiting) with the data cursor at that instant; the
groups are carried in the checkpoint and served first after a resume.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable

from relayrl.engine.base import Engine, EngineError
from relayrl.records import Completion, FinishReason, Group, SamplingParams
from relayrl.rollout import continuation
from relayrl.scheduling import LengthModel, order_trajectories
from relayrl.staleness import StalenessManager
from relayrl.timeline import Timeline


def oldest_version(g: Group) -> int | None:
    """The policy version of the group's oldest token (None before its first token)."""
    return min((v for t in g.trajectories for v in t.versions), default=None)


def versions_behind(g: Group, version: int) -> int:
    o = oldest_version(g)
    return 0 if o is None else version - o


class AsyncRollout:
    def __init__(self, engine: Engine, take_prompts: Callable[[int], list], new_groups: Callable[[list], list[Group]],
                 params: SamplingParams, batch: int, eta: int, *, partial: bool = False, stale: str = "requeue",
                 schedule: str = "fifo", version: int = 0, carried: list[Group] = (), timeline: Timeline | None = None,
                 counters: dict | None = None):
        self.engine, self.take_prompts, self.new_groups, self.params = engine, take_prompts, new_groups, params
        self.batch, self.eta, self.partial, self.stale, self.schedule = batch, eta, partial, stale, schedule
        self.mgr = StalenessManager(eta, batch, version=version)
        self.tl = timeline
        self.lengths = LengthModel()
        self.cv = threading.Condition()
        self.waiting: deque[Group] = deque(carried)  # carried or requeued groups, started before new prompts
        self.ready: list[Group] = []
        self.running: dict[int, Group] = {}  # id(group) -> group, started and not ready
        self.inflight: dict[str, tuple] = {}  # request id -> (group, trajectory)
        self.seq: dict[int, int] = {}  # id(group) -> admission order
        self.admitted_at: dict[int, int] = {}  # id(group) -> policy version when it was admitted
        self.next_seq = 0
        self.generated = 0  # tokens since the last batch was taken
        counters = counters or {}
        self.resumed = counters.get("partial_resumed", 0)  # partial responses continued (cumulative)
        self.stale_requeued = counters.get("stale_requeued", 0)
        self.stale_discarded = counters.get("stale_discarded", 0)
        self.stale_tokens = self.stale_responses = 0  # what the staleness bound threw away
        self.hold = False
        self.closed = False
        self.error: BaseException | None = None
        self._busy_since: float | None = None
        self.thread = threading.Thread(target=self._run, name="relayrl-async-rollout", daemon=True)
        self.thread.start()

    # -- trainer side ----------------------------------------------------------------------
    def next_batch(self, version: int) -> tuple[list[Group], int]:
        """``batch`` ready groups no more than η versions old at ``version``, in admission order;
        and the tokens generated since the previous call."""
        out: list[Group] = []
        with self.cv:
            while len(out) < self.batch:
                g = self._pick(version, self.batch - len(out))
                if g is None:
                    self._raise_if_failed()
                    self.cv.wait(0.5)
                    continue
                self.ready.remove(g)
                if versions_behind(g, version) > self.eta:
                    self.mgr.drop_stale(1)
                    self.stale_tokens += sum(len(t.response_ids) for t in g.trajectories)
                    self.stale_responses += len(g.trajectories)
                    if self.stale == "requeue":
                        self.stale_requeued += 1
                        self.waiting.appendleft(self.new_groups([g.prompt])[0])  # same prompt, empty responses
                    else:
                        self.stale_discarded += 1
                    self.seq.pop(id(g))
                    self.admitted_at.pop(id(g))
                    self.cv.notify_all()
                    continue
                out.append(g)
            out.sort(key=lambda x: self.seq.pop(id(x)))
            for g in out:
                del self.admitted_at[id(g)]
            generated, self.generated = self.generated, 0
        return out, generated

    def _pick(self, version: int, slots: int) -> Group | None:
        """The next group for the batch being filled at ``version``, or None to wait.

        A group at its deadline (η versions behind: it cannot wait for the next batch) goes first.
        Otherwise the oldest-admitted ready group, but only while the batch keeps a slot for every
        group still generating that is at its deadline: without that, short groups admitted later
        overtake a long one until it is too stale to train, and the trainer sees a sample biased
        towards short responses (the staleness-requeue survivor bias)."""
        def due(g: Group, oldest: int | None) -> bool:
            return oldest is not None and version - oldest >= self.eta

        ready = sorted(self.ready, key=lambda x: self.seq[id(x)])
        for g in ready:
            if due(g, oldest_version(g)):
                return g
        # a running group's tokens reach us only as its responses finish: its admission version
        # is the lower bound on its oldest token
        waiting_for = sum(due(g, min(v for v in (oldest_version(g), self.admitted_at[id(g)]) if v is not None))
                          for g in self.running.values())
        return ready[0] if ready and slots > waiting_for else None

    def publish(self, load: Callable[[], None], version: int) -> None:
        """Put weights ``version`` into the engine (``load``) and raise the capacity. With partial
        rollouts, what is in flight is cut first, inside one engine pause, so no token is sampled
        by the new weights over a KV cache of the old ones; the cut responses continue
        (re-batched, context recomputed) under the new weights."""
        if self.partial:
            with self.engine.pause():
                with self.cv:
                    ids = list(self.inflight)
                self.engine.abort(ids)
                load()
        else:
            load()
        self.mgr.set_version(version)
        with self.cv:
            self.cv.notify_all()

    def held(self) -> list[Group]:
        """Every group held (ready, partial, waiting), in admission order, with nothing in flight.
        Generation stops while the caller reads the data cursor; call ``release`` after."""
        with self.cv:
            self.hold = True
            ids = list(self.inflight)
        self.engine.abort(ids)
        with self.cv:
            while self.inflight:
                self._raise_if_failed()
                self.cv.wait(0.5)
            groups = sorted([*self.ready, *self.running.values()], key=lambda g: self.seq[id(g)])
            return groups + list(self.waiting)

    def release(self) -> None:
        with self.cv:
            self.hold = False
            self.cv.notify_all()

    def metrics(self) -> dict:
        return {"stale_requeued_total": self.stale_requeued, "stale_discarded_total": self.stale_discarded,
                "partial_resumed_total": self.resumed, "groups_in_flight": len(self.running),
                "stale_response_len_mean": self.stale_tokens / max(1, self.stale_responses)}

    def counters(self) -> dict:
        """Cumulative counts for the checkpoint (the manager's own are rebuilt from the version)."""
        return {"partial_resumed": self.resumed, "stale_requeued": self.stale_requeued,
                "stale_discarded": self.stale_discarded}

    def close(self) -> None:
        with self.cv:
            self.closed = True
            ids = list(self.inflight)
            self.cv.notify_all()
        self.engine.abort(ids)
        self.thread.join(timeout=30)

    # -- rollout thread ----------------------------------------------------------------------
    def _raise_if_failed(self) -> None:
        if isinstance(self.error, EngineError):  # the engine's own message names the cause
            raise EngineError(str(self.error)) from self.error
        if self.error is not None:
            raise RuntimeError(f"rollout thread failed: {self.error!r}") from self.error

    def _run(self) -> None:
        try:
            while True:
                with self.cv:
                    if self.closed:
                        return
                    if not self.hold:
                        self._start_groups()
                    idle = not self.inflight
                    if idle:
                        self._mark_busy(False)
                        self.cv.wait(0.05)
                        continue
                    self._mark_busy(True)
                done = self.engine.get(timeout=0.05)
                with self.cv:
                    self._collect(done)
        except BaseException as e:  # surfaced to the trainer by next_batch / held
            with self.cv:
                self.error = e
                self.cv.notify_all()

    def _start_groups(self) -> None:
        n = self.mgr.try_start(10**9)
        if n == 0:
            self._resubmit_aborted()
            return
        groups = [self.waiting.popleft() for _ in range(min(n, len(self.waiting)))]
        if len(groups) < n:
            groups += self.new_groups(self.take_prompts(n - len(groups)))
        for g in groups:
            self.seq[id(g)] = self.next_seq
            self.admitted_at[id(g)] = self.mgr.version
            self.next_seq += 1
            if all(t.done for t in g.trajectories):  # a complete group carried by a checkpoint
                self.mgr.finish(accepted=True)
                self.ready.append(g)
            else:
                self.running[id(g)] = g
        self._resubmit_aborted()
        self.cv.notify_all()

    def _resubmit_aborted(self) -> None:
        """Submit every unfinished, not-in-flight response of the running groups, in policy order."""
        todo = [(g, t) for g in self.running.values() for t in g.trajectories
                if not t.done and t.request_id not in self.inflight]
        if not todo:
            return
        group_of = {t.request_id: g for g, t in todo}  # running groups are in admission order
        reqs = []
        for t in order_trajectories([t for _, t in todo], self.schedule, self.lengths):
            self.inflight[t.request_id] = (group_of[t.request_id], t)
            self.resumed += bool(t.response_ids)
            reqs.append(continuation(t, self.params))
        self.engine.submit(reqs)

    def _collect(self, done: list[Completion]) -> None:
        for c in done:
            if c.request_id not in self.inflight:
                continue
            g, t = self.inflight.pop(c.request_id)
            t.extend(c)
            self.generated += len(c.token_ids)
            if c.finish_reason == FinishReason.ABORTED:
                continue  # re-submitted by the next _start_groups unless held
            self.lengths.observe(g.prompt.id, g.group_id, len(t.response_ids))
            if all(x.done for x in g.trajectories):
                del self.running[id(g)]
                self.lengths.forget_group(g.group_id)
                self.mgr.finish(accepted=True)
                self.ready.append(g)
        if done:
            self.cv.notify_all()  # the trainer waits for ready groups, ``held`` for an empty flight

    def _mark_busy(self, busy: bool) -> None:
        """Engine lane of the timeline: busy while requests are in flight, recorded in pieces of
        at most 0.1 s so the per-step idle fraction sees a busy period that has not ended yet."""
        if self.tl is None:
            return
        now = self.tl.now()
        if self._busy_since is not None and (not busy or now - self._busy_since >= 0.1):
            self.tl.record("engine", self._busy_since, now)
            self._busy_since = None
        if busy and self._busy_since is None:
            self._busy_since = now
