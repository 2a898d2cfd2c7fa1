"""Scheduling policies and length estimates, by hand."""

import pytest

from relayrl.rollout.scheduling import (
    LengthModel,
    Pending,
    expected_remaining,
    gittins_index,
    order,
)


def _model():
    m = LengthModel(default=50)
    m.observe("short", "g-short", 10)
    m.observe("long", "g-long-old", 100)
    m.observe("long", "g-long-old", 80)
    return m


def test_estimates_prefer_siblings_then_prompt_history_then_recent():
    m = _model()
    m.observe("long", "g-long", 40)  # a finished sibling in the current group wins over history
    assert m.samples("long", "g-long") == [40]
    assert m.samples("long", "g-new") == [100, 80, 40]
    assert m.samples("unseen", "g-x") == [10, 100, 80, 40]
    assert LengthModel(default=7).samples("a", "b") == [7]


def test_policies_order_by_hand():
    m = _model()
    ps = [Pending("a", "short", "g-short", arrival=0), Pending("b", "long", "g-long", arrival=1),
          Pending("c", "long", "g-long", generated=30, arrival=2, partial=True)]
    assert [p.request_id for p in order(ps, "fifo", m)] == ["a", "b", "c"]
    assert [p.request_id for p in order(ps, "partial_first", m)] == ["c", "a", "b"]
    # expected totals: short 10, long 90 → long ones first (ties by arrival)
    assert [p.request_id for p in order(ps, "longest_first", m)] == ["b", "c", "a"]
    # expected remaining: a 10, b 90, c (100-30 + 80-30)/2 = 60
    assert [p.request_id for p in order(ps, "srpt", m)] == ["a", "c", "b"]
    with pytest.raises(ValueError, match="fifo"):
        order(ps, "lifo", m)


def test_expected_remaining_and_gittins_by_hand():
    assert expected_remaining([10, 20, 60], 15) == pytest.approx((5 + 45) / 2)
    assert expected_remaining([10], 25) == 25  # past all history: as much again
    # R = {5, 45}: Δ=5 → (1/2)/((5+5)/2) = 0.1; Δ=45 → 1/((5+45)/2) = 0.04 → index 0.1
    assert gittins_index([10, 20, 60], 15) == pytest.approx(0.1)
    # a request certain to need 5 more beats one that needs 5 or 95 equally likely (same SRPT mean 50 vs 5)
    assert gittins_index([5], 0) > gittins_index([5, 95], 0)


def test_a_step_barrier_submits_longest_expected_first():
    """The episode runner hands the engine one submission in ``rollout.schedule`` order: with
    longest_first the prompt with the longest history first, srpt the shortest."""
    from relayrl.rollout.runner import EpisodeRunner
    from relayrl.records import Group, Prompt, SamplingParams, Trajectory
    from tests.fake_engine import FakeEngine
    from tests.test_rollout_driver import Tok

    for schedule, first in (("fifo", "g-short"), ("longest_first", "g-long"), ("srpt", "g-short")):
        groups = []
        for pid in ("short", "long", "mid"):
            p = Prompt(pid, [{"role": "user", "content": pid}])
            groups.append(Group(p, f"g-{pid}", [Trajectory(p, f"g-{pid}", i, [1, 2]) for i in range(2)]))
        eng = FakeEngine(seed=0)
        runner = EpisodeRunner(eng, Tok(), None, None, lambda text, prompt: (0.0, False), schedule)
        for pid, n in (("short", 5), ("long", 90), ("mid", 40)):
            runner.lengths.observe(pid, f"old-{pid}", n)

        async def barrier():
            import asyncio
            await asyncio.gather(*(runner.group(g, SamplingParams(10)) for g in groups))

        try:
            runner.run(barrier())
        finally:
            runner.close()
        assert eng.submitted[0].startswith(first), (schedule, eng.submitted)
        assert all(t.complete for g in groups for t in g.trajectories)
    assert [s.rsplit("/", 1)[0] for s in eng.submitted[::2]] == ["g-short", "g-mid", "g-long"]  # srpt: shortest first


def test_length_model_memory_is_bounded():
    """Per-group statistics were never forgotten in sync/periodic mode: memory grew every step."""
    from relayrl.rollout.scheduling import LengthModel

    m = LengthModel(max_groups=100, max_prompts=50)
    for i in range(10_000):
        m.observe(f"p{i % 500}", f"g{i}", i % 90)
    assert len(m.by_group) == 100 and len(m.by_prompt) == 50
    assert m.samples("p499", "g9999") == [9999 % 90]  # the newest is kept
