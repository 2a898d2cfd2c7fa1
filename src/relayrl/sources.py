"""Where a training step's groups come from, one class per pipeline mode (``run.mode``).

All three offer the same four calls to the loop, so the loop does not branch on the mode:
``next_batch`` (the step's groups and the tokens generated for them), ``publish`` (put new
weights into the engine), ``held``/``release`` (the groups carried in a checkpoint, with
generation stopped while the data cursor is read), and ``close``.

- ``sync``: generate the step's groups, then train (a barrier per step); with partial rollouts
  APRIL's over-provisioned step, carrying cut-off groups to the next step.
- ``periodic``: the next step's batch is generated in a thread while this one trains; weights
  are published only between batches (each batch has one version, one behind the trainer).
- ``async``: a rollout thread streams groups up to η versions ahead (``async_rollout``).
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

from relayrl.async_rollout import AsyncRollout
from relayrl.config import Config
from relayrl.records import Group
from relayrl.rollout import generate_groups, generate_until, make_groups, score_groups
from relayrl.scheduling import LengthModel
from relayrl.timeline import Timeline


def flatten(groups: list[Group]) -> list:
    return [t for g in groups for t in g.trajectories]


def rollout_step(cfg: Config, c, state, lengths: LengthModel | None = None) -> tuple[list[Group], int]:
    """Groups for the next training step, and the tokens generated for them and for the carried-over
    rest: a synchronous barrier, or APRIL's over-provisioned partial rollouts. Groups carried in
    the buffer (cut off, or prefetched before a checkpoint) are served first. Requests go to the
    engine in ``rollout.schedule`` order, with lengths learnt from earlier steps (``lengths``)."""
    groups, generated = _rollout_step(cfg, c, state, lengths)
    if lengths is not None:
        for t in flatten(groups):
            lengths.observe(t.prompt.id, t.group_id, len(t.response_ids))
    return groups, generated


def new_groups(cfg: Config, c, state, prompts: list) -> list[Group]:
    """Empty groups for ``prompts``, with ids unique over the whole run: the counter is part of the
    checkpoint, so a resumed run never reuses the id of a group it carries."""
    tag = f"g{state.groups_made}"
    state.groups_made += 1
    return make_groups(prompts, c.tokenizer, cfg.rollout.group_size, tag, cfg.data.prompt_format)


def _rollout_step(cfg: Config, c, state, lengths: LengthModel | None):
    r = cfg.rollout
    if not r.partial:
        carried = c.buffer.take(r.prompts_per_step)
        before = sum(len(t.response_ids) for t in flatten(carried))
        groups = carried + new_groups(cfg, c, state, c.sampler.take(r.prompts_per_step - len(carried)))
        generate_groups(c.engine, groups, c.params, r.schedule, lengths)
        return groups, sum(len(t.response_ids) for t in flatten(groups)) - before
    target = math.ceil(r.over_provision * r.prompts_per_step)
    carried = c.buffer.take(target)
    state.partial_resumed += sum(any(not t.done for t in g.trajectories) for g in carried)
    fresh = new_groups(cfg, c, state, c.sampler.take(max(0, target - len(carried))))
    before = sum(len(t.response_ids) for t in flatten(carried))
    complete, rest = generate_until(c.engine, carried + fresh, c.params, r.prompts_per_step, r.schedule, lengths)
    for g in complete[r.prompts_per_step :] + rest:
        c.buffer.put(g)
    generated = sum(len(t.response_ids) for t in flatten(complete + rest)) - before
    return complete[: r.prompts_per_step], generated


class SyncSource:
    def __init__(self, cfg: Config, c, state, tl: Timeline):
        self.cfg, self.c, self.state, self.tl = cfg, c, state, tl
        self.lengths = LengthModel()  # used by one rollout at a time

    def _rollout(self):
        with self.tl.busy("engine"):
            return rollout_step(self.cfg, self.c, self.state, self.lengths)

    def next_batch(self) -> tuple[list[Group], int]:
        return self._rollout()

    def score(self, groups: list[Group]) -> None:
        score_groups(groups, self.c.reward, self.c.tokenizer)

    def publish(self, load) -> None:
        load()

    def held(self) -> list[Group]:
        return self.c.buffer.peek()

    def release(self) -> None:
        pass

    def metrics(self) -> dict:
        return {"partial_resumed_total": self.state.partial_resumed, "partial_buffer_groups": len(self.c.buffer)}

    def counters(self) -> dict:
        return {}

    def close(self) -> None:
        pass


class PeriodicSource(SyncSource):
    """The next step's rollout runs in a thread while this step trains, from the weights loaded
    when it started (one version behind the trainer)."""

    def __init__(self, *a):
        super().__init__(*a)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="relayrl-rollout")
        self.future = None

    def next_batch(self):
        out = self.future.result() if self.future is not None else self._rollout()
        self.future = None
        if self.state.step + 1 < self.cfg.run.steps:
            self.future = self.pool.submit(self._rollout)
        return out

    def publish(self, load) -> None:
        if self.future is not None:
            self.future.result()  # weights change only between batches; re-raises a rollout failure
        load()

    def held(self) -> list[Group]:
        """A batch generated ahead is served first after a resume, then the partial buffer."""
        ahead = self.future.result()[0] if self.future is not None else []
        return ahead + self.c.buffer.peek()

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class AsyncSource:
    def __init__(self, cfg: Config, c, state, tl: Timeline):
        r = cfg.rollout
        self.state, self.c = state, c
        self.rollout = AsyncRollout(
            c.engine, c.sampler.take, lambda prompts: new_groups(cfg, c, state, prompts),
            c.params, r.prompts_per_step, r.max_staleness, partial=r.partial, stale=r.stale, schedule=r.schedule,
            version=state.version, carried=c.buffer.take(len(c.buffer)), timeline=tl, counters=state.staleness,
        )

    def next_batch(self):
        return self.rollout.next_batch(self.state.version)

    def score(self, groups: list[Group]) -> None:
        score_groups(groups, self.c.reward, self.c.tokenizer)

    def publish(self, load) -> None:
        self.rollout.publish(load, self.state.version + 1)

    def held(self) -> list[Group]:
        return self.rollout.held()

    def release(self) -> None:
        self.rollout.release()

    def metrics(self) -> dict:
        return self.rollout.metrics()

    def counters(self) -> dict:
        return self.rollout.counters()

    def close(self) -> None:
        self.rollout.close()


# env.name set: relayrl.episode_rollout.EpisodeSource (sync and async)
SOURCES = {"sync": SyncSource, "periodic": PeriodicSource, "async": AsyncSource}
