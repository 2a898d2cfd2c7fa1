"""The rollout driver: where a training step's groups come from, in every mode (``run.mode``).

Groups of episodes (``episodes.EpisodeRunner``: single-turn or with an environment) are admitted
while the staleness manager grants capacity (AReaL's rule): η versions ahead of the trainer at
most. Admitted groups run at once on the runner's loop; whichever finish first are trained first.

    sync      η = 0: a step's groups start once its weights are published; the step waits for
              them (the barrier).
    periodic  η = 1: the next step's groups generate while this one trains, from the weights of
              the last publish; weights change only once they are all done (or, with partial
              rollouts, cut them: they continue under the new weights).
    async     η = rollout.max_staleness: generation runs ahead; a weight update goes into the
              engine while requests are in flight (cut and continued with partial rollouts,
              finished under the weights they started with otherwise).

Partial rollouts with over-provisioning (APRIL; sync and periodic): ``rollout.over_provision``
× the step's groups are in flight; a step takes the first complete ones and the rest are cut at
the weight update and continued (in sync mode they wait, held, while the trainer has the
cores), to be trained at the next step at the latest.

Staleness without survivor bias. A group admitted at version a has a deadline, a + η (plus
⌈extra / B⌉ when over-provisioned): the last version that may train it. The trainer takes ready
groups earliest deadline first, and takes one ahead of a group still running only while every
group left can still meet its deadline (EDF feasibility: the i-th of them by deadline is trained
1 + i // B steps later at the earliest); otherwise it waits for the running one. The capacity rule
makes that always possible, so no group is ever older than its bound and none is discarded or
requeued. Discarding stale groups (or regenerating them) trains on the ones that happened to
finish quickly — short responses, few turns, fast tools; here every admitted group is trained,
whatever its length, and the wait is for the slowest of at most one batch.

Dynamic sampling (DAPO, ``rollout.dynamic_sampling``): a finished group whose rewards have no
variance (every episode right, or every one wrong) has zero advantage everywhere and teaches
nothing; it is left out before it is accepted, its capacity slot freed, and a new group takes its
place, so the step's batch fills with groups that teach. That holds in every mode: the staleness
bound counts accepted groups, so a filtered one costs no version of lag, and the replacement gets
its own deadline. At most ``rollout.dynamic_sampling_max`` × the batch groups are filtered between
two batches taken (DAPO's max_num_gen_batches); past that a zero-variance group is accepted as it
is (a model that solves everything, or nothing, would otherwise generate forever). The prompts filtered are written beside the ones
trained (``trained_prompts.jsonl``), so every consumed prompt is accounted for across resumes.

Adaptive budgets (``rollout.budget=adaptive``, math in ``selection``): a group starts with
``budget_min`` episodes; when they are done, one whose rewards have no variance stops there (and is
filtered, with dynamic sampling: a cheaper filter than a whole group), one with variance gets more,
up to ``budget_max``, from its own reserve (``group_size − budget_min``) and the surplus that the
stopped groups of its *window* left — the ``prompts_per_step`` groups admitted together — so a
window never generates more than ``prompts_per_step × group_size`` episodes. The surplus goes to
whichever group of the window asks first; the reserve is every group's whatever its timing.
Advantages are computed per group whatever its size.

Prompt selection (``prompt_sampler.py``) sees every finished group's rewards (``observe``), filtered
ones too, before its next draw.

Checkpoints: ``held`` stops the episodes at a token boundary and returns every group not yet
trained: complete ones, running ones with what their episodes generated so far (an episode past
its first tool call restarts from its prompt: ``rollout.episode``), and those not yet started. A
resumed run admits them first, as of the version of their oldest token, so the staleness bound
holds across the resume; nothing is lost and nothing is trained twice.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections import deque
from typing import Callable

from relayrl.data import selection
from relayrl.engine.base import EngineError
from relayrl.failures import UserCodeError, failed
from relayrl.records import Group, SamplingParams, Trajectory
from relayrl.rollout.groups import carried_copy, expand_branches, length_class, no_variance, oldest_version
from relayrl.rollout.staleness import StalenessManager
from relayrl.tracking.timeline import Timeline


class EpisodeRollout:
    """``take_prompts(n)``/``new_groups(prompts)`` feed it; ``batch`` groups per step; ``eta`` the
    staleness bound; ``extra`` over-provisioned groups (partial only); ``park_while_training``:
    sync, the cut episodes wait for the next publish; ``drain_before_publish``: periodic without
    partial, weights change only once every admitted group is done. ``carried``: groups from a
    checkpoint, admitted first; ``max_groups``: groups to admit in all (carried ones included), the
    ones the run's remaining steps train, so nothing is generated past the last step."""

    def __init__(self, runner, take_prompts: Callable[[int], list], new_groups: Callable[[list], list[Group]],
                 params: SamplingParams, batch: int, eta: int, *, partial: bool = False, extra: int = 0,
                 park_while_training: bool = False, drain_before_publish: bool = False, version: int = 0,
                 carried: list[Group] = (), timeline: Timeline | None = None, counters: dict | None = None,
                 max_groups: int | None = None, filter_groups: bool = False, filter_max: int = 4,
                 budget: tuple[int, int, int] | None = None, observe: Callable[[Group, int], None] | None = None,
                 sampler_state: Callable[[], object] | None = None):
        if extra and not partial:
            raise ValueError("over-provisioning needs partial rollouts (the extra groups are cut and carried)")
        self.runner, self.take_prompts, self.new_groups, self.params = runner, take_prompts, new_groups, params
        self.batch, self.eta, self.partial, self.version = batch, eta, partial, version
        self.extra, self.slack = extra, math.ceil(extra / batch)  # an over-provisioned group: carried ≤ slack steps
        self.park, self.drain = park_while_training and partial, drain_before_publish and not partial
        self.mgr = StalenessManager(eta, batch, version=version, extra=extra)
        self.runner.timeline = timeline
        counters = counters or {}
        self.runner.continued = counters.get("partial_resumed", self.runner.continued)
        self.filter, self.filter_cap = filter_groups, filter_max * batch
        self.filtered_ids: list[str] = list(counters.get("filtered_pending", []))  # since the last step
        self.filtered_tokens = counters.get("filtered_tokens_pending", 0)  # generated for filtered groups since the last step
        self.runner.generated += counters.get("generated_pending", 0)  # (a resumed run: what the stopped one had not taken)
        self.filtered_groups: list[Group] = []  # since the last step (for the rollout records)
        self.last_filtered: list[Group] = []  # those ``take_filtered`` took
        self.filtered_total = counters.get("filtered_total", 0)
        self.filtered_since_batch = self.filter_exhausted = 0
        # adaptive budgets: (first stage, group_size, most); the surplus per window; groups admitted so far
        self.budget = budget
        self.banks: dict[int, int] = {int(k): v for k, v in counters.get("budget_banks", {}).items()}
        self.admitted = counters.get("budget_admitted", 0)
        self.budget_extra = counters.get("budget_extra_total", 0)
        self.budget_stopped = counters.get("budget_stopped_total", 0)
        self.observe, self.sampler_state = observe, sampler_state
        self.saved: tuple[dict, object] | None = None  # (counters, sampler state) as of the last ``held``
        self.cv = threading.Condition()
        self.waiting: deque[Group] = deque(carried)
        self.ready: list[Group] = []
        self.running: dict[int, Group] = {}
        self.seq: dict[int, int] = {}  # id(group) -> admission order
        self.admitted_at: dict[int, int] = {}  # id(group) -> the version it counts its staleness from
        self.next_seq = 0
        self.changes = 0  # groups finished so far (a driven engine decodes until this moves)
        self.left = max_groups if max_groups is not None else float("inf")  # groups still to admit
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
        """``batch`` complete groups, earliest deadline first (``_pick``); and the tokens generated
        since the previous call."""
        with self.cv:
            while (batch := self._pick(self.version)) is None:
                self._raise_if_failed()
                self._wait()
                self.runner.check_alive()  # (an environment blocking the loop: no group would ever finish)
            self.filtered_since_batch = 0
            for g in batch:
                self.ready.remove(g)
                for t in g.trajectories:
                    self.trained[length_class(t)] += 1
        if self.park and self.running:
            self.runner.hold()  # sync: the step's barrier; the rest wait for the new weights
        return batch, self.runner.take_generated()

    def _deadline(self, g: Group) -> int:
        """The last version at which ``g`` may be trained."""
        return self.admitted_at[id(g)] + self.eta + self.slack

    def _pick(self, version: int) -> list[Group] | None:
        """Earliest deadline first among the ready groups, unless taking them would leave the others
        unable to meet their deadlines (the i-th of those left, by deadline, is trained ``1 + i // B``
        steps from now at the earliest) while an earlier-deadline group is still running: then wait."""
        if len(self.ready) < self.batch:
            return None
        key = lambda g: (self._deadline(g), self.seq[id(g)])  # noqa: E731
        ready = sorted(self.ready, key=key)
        batch, rest = ready[: self.batch], sorted(ready[self.batch:] + list(self.running.values()), key=key)
        if all(self._deadline(g) >= version + 1 + i // self.batch for i, g in enumerate(rest)):
            return batch
        ideal = sorted(self.ready + list(self.running.values()), key=key)[: self.batch]
        return batch if all(id(g) not in self.running for g in ideal) else None  # (over a resume's carry)

    def publish(self, load: Callable[[], None]) -> None:
        """New weights into the engine (``load``) as version + 1. With partial rollouts the turns in
        flight are cut at the update (inside one engine pause, so no token is sampled by the new
        weights over a KV cache of the old ones) and continue under the new weights."""
        if self.drain:
            with self.cv:
                while self.running or (self.mgr.capacity() and self.left and not self.hold):  # admitting
                    self._raise_if_failed()
                    self._wait()
                    self.runner.check_alive()
        if self.partial:
            with self.runner.engine.pause():
                self.runner.abort_inflight()
                load()
        else:
            load()
        self.version += 1
        self.mgr.set_version(self.version)
        if self.park:
            self.runner.release()
        self.runner.loop.call_soon_threadsafe(self.wake.set)

    def held(self) -> list[Group]:
        """Stop the episodes; the groups to carry in a checkpoint (see the module doc). They go on
        after ``release``."""
        self.hold = True
        self.runner.hold()
        return self.runner.run(self._snapshot())

    def release(self) -> None:
        self.hold = False
        self.runner.release()
        self.runner.loop.call_soon_threadsafe(self.wake.set)

    def take_filtered(self) -> tuple[list[str], dict]:
        """The prompt ids dynamic sampling filtered since the last call, and its metrics (the groups
        themselves: ``last_filtered``)."""
        with self.cv:
            ids, self.filtered_ids = self.filtered_ids, []
            self.last_filtered, self.filtered_groups = self.filtered_groups, []
            tokens, self.filtered_tokens = self.filtered_tokens, 0
        if not self.filter:
            return ids, {}
        return ids, {"dynamic/filtered_groups": len(ids), "dynamic/filtered_tokens": tokens,
                     "dynamic/filtered_total": self.filtered_total, "dynamic/accepted_unfiltered_total": self.filter_exhausted}

    def metrics(self) -> dict:
        budget = {"budget/extra_total": self.budget_extra, "budget/stopped_total": self.budget_stopped} \
            if self.budget else {}
        return {**budget, "partial_resumed_total": self.runner.continued, "groups_in_flight": len(self.running),
                "episode_errors_total": self.runner.error_count,
                **{f"episodes_{k}_{c}_total": v[c] for k, v in (("finished", self.finished), ("trained", self.trained))
                   for c in v}}

    def counters(self) -> dict:
        with self.cv:
            out = {"partial_resumed": self.runner.continued, "filtered_pending": list(self.filtered_ids),
                   "filtered_total": self.filtered_total, "filtered_tokens_pending": self.filtered_tokens,
                   "generated_pending": self.runner.generated}  # (tokens of groups not yet taken: counted at their step)
            if self.budget:
                live = [g.window for g in (*self.ready, *self.running.values(), *self.waiting) if g.window is not None]
                first = min(live + [self.admitted // self.batch])  # older windows have no group left to draw
                out.update(budget_banks={str(w): n for w, n in self.banks.items() if w >= first},
                           budget_admitted=self.admitted, budget_extra_total=self.budget_extra,
                           budget_stopped_total=self.budget_stopped)
            return out

    def checkpoint_state(self) -> tuple[dict, object]:
        """(counters, the sampler's state) as of the last ``held``: taken on the loop in the same instant
        as the groups it returned, so a group finishing meanwhile is counted in neither or in both."""
        if self.saved is None:
            raise RuntimeError("checkpoint_state() before held()")
        return self.saved

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.runner.release()
        if self.runner.blocked_for() < 5:  # (a loop blocked by user code cannot cancel: the run is ending)
            self.runner.run(self._cancel())

    def _wait(self) -> None:
        """(With ``cv`` held.) Wait for a group to finish; a driven engine decodes meanwhile, here."""
        if not self.runner.driven:
            self.cv.wait(0.5)
            return
        seen = self.changes
        self.cv.release()
        try:
            self.runner.serve(lambda: self.changes != seen or self.error is not None)
        finally:
            self.cv.acquire()

    def _raise_if_failed(self) -> None:
        if isinstance(self.error, (EngineError, UserCodeError)):
            raise type(self.error)(str(self.error)) from self.error
        if self.error is not None:
            raise RuntimeError(f"rollout failed: {self.error!r}") from self.error

    # -- on the runner's loop ------------------------------------------------------------------
    async def _admit(self) -> None:
        try:
            while not self.closed:
                if not self.hold:
                    self._start()
                self.wake.clear()
                await self.wake.wait()  # set by a publish, a release, close
        except BaseException as e:  # noqa: BLE001 - surfaced to the trainer by next_batch
            self._fail(e)

    def _start(self) -> None:
        n = self.mgr.try_start(int(min(10**9, self.left)))
        self.left -= n
        groups = [self.waiting.popleft() for _ in range(min(n, len(self.waiting)))]
        if len(groups) < n:
            groups += self.new_groups(self.take_prompts(n - len(groups)))
        for g in groups:
            if self.budget and g.window is None:  # a new group: its first stage
                g.trajectories, g.sized = g.trajectories[:self.budget[0]], False
                g.window, self.admitted = self.admitted // self.batch, self.admitted + 1
            with self.cv:
                oldest = oldest_version(g)  # a carried group counts from its oldest token
                at = self.mgr.version if oldest is None else min(oldest, self.mgr.version)
                self.seq[id(g)], self.admitted_at[id(g)] = self.next_seq, at
                self.next_seq += 1
                if g.sized and all(t.complete for t in g.trajectories):  # complete, carried by a checkpoint
                    self.mgr.finish(accepted=True)
                    expand_branches(g)
                    self.ready.append(g)
                    self.changes += 1
                    self.cv.notify_all()
                    continue
                self.running[id(g)] = g
            task = asyncio.get_running_loop().create_task(self._run_group(g))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        if groups:
            self.runner.mark_engine()

    async def _run_group(self, g: Group) -> None:
        try:
            await self.runner.group(g, self.params)
            if not g.sized:
                self._size(g)
                await self.runner.group(g, self.params)  # its extra episodes (none: at once)
        except asyncio.CancelledError:
            return
        except BaseException as e:  # noqa: BLE001 - an engine failure ends the run, with its reason
            self._fail(e)
            return
        if self.observe is not None:
            self.observe(g, max((v for t in g.trajectories for v in t.versions), default=self.version))
        with self.cv:
            del self.running[id(g)]
            for t in g.trajectories:
                self.finished[length_class(t)] += 1
            if self.filter and no_variance(g):
                if self.filtered_since_batch < self.filter_cap:
                    self._filtered(g)
                    return
                self.filter_exhausted += 1
            self.mgr.finish(accepted=True)
            expand_branches(g)
            self.ready.append(g)
            self.changes += 1
            self.cv.notify_all()

    def _size(self, g: Group) -> None:
        """(On the loop.) ``g``'s first stage is done: how many more episodes it gets (module doc)."""
        first, size, most = self.budget
        want = selection.wanted_extra([t.reward for t in g.trajectories if not failed(t)], most)
        with self.cv:
            extra, self.banks[g.window] = selection.grant(want, size - first, self.banks.get(g.window, 0))
            self.budget_extra += extra
            self.budget_stopped += extra == 0
        n, ids = len(g.trajectories), g.trajectories[0].prompt_ids
        g.trajectories += [Trajectory(g.prompt, g.group_id, n + i, list(ids)) for i in range(extra)]
        g.sized = True

    def _filtered(self, g: Group) -> None:
        """(With ``cv`` held, on the loop.) ``g`` teaches nothing: its slot goes to a new group."""
        self.mgr.finish(accepted=False)
        self.left += 1
        self.filtered_since_batch += 1
        self.filtered_total += 1
        self.filtered_ids.append(g.prompt.id)
        self.filtered_groups.append(g)
        self.filtered_tokens += sum(int(sum(t.mask)) if t.mask else len(t.response_ids) for t in g.trajectories)
        self.changes += 1
        self.cv.notify_all()
        self.wake.set()  # admit its replacement

    def _fail(self, e: BaseException) -> None:
        with self.cv:
            self.error = self.error or e
            self.cv.notify_all()

    async def _snapshot(self) -> list[Group]:
        with self.cv:
            order = sorted([*self.ready, *self.running.values()], key=lambda g: self.seq[id(g)])
            out = [g if id(g) not in self.running else carried_copy(g) for g in order]
        self.saved = (self.counters(), self.sampler_state() if self.sampler_state else None)
        return out + list(self.waiting)

    async def _cancel(self) -> None:
        self.wake.set()
        tasks = list(self.tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.admission.cancel()


async def _event() -> asyncio.Event:
    return asyncio.Event()  # made on the loop that waits on it
