"""The staleness manager: the capacity rule by hand, and properties over random generation times."""

import heapq
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relayrl.rollout.staleness import StalenessManager


def test_capacity_rule_by_hand():
    m = StalenessManager(eta=1, batch_size=4, max_concurrent=6)
    assert m.capacity() == 6  # (1 + 0 + 1) * 4 = 8, but at most 6 running
    assert m.try_start(10) == 6
    for _ in range(4):
        m.finish(accepted=True)
    assert m.capacity() == 2  # limit 8 - (accepted 4 + running 2) = 2; concurrency 6 - 2 = 4
    m.set_version(1)  # limit (1 + 1 + 1) * 4 = 12 → 12 - 4 - 2 = 6, concurrent 6 - 2 = 4
    assert m.capacity() == 4


def test_eta_zero_allows_one_batch_per_version():
    m = StalenessManager(eta=0, batch_size=3)
    assert m.try_start(5) == 3
    for _ in range(3):
        m.finish(True)
    assert m.try_start() == 0
    m.set_version(1)
    assert m.try_start(5) == 3


def test_freshness_and_drop_returns_quota():
    m = StalenessManager(eta=2, batch_size=2, version=5)
    assert m.c.accepted == 10  # resumed at version 5
    assert m.is_fresh(3) and not m.is_fresh(2)
    m.try_start(1)
    m.finish(True)
    m.drop_stale()
    assert m.c.accepted == 10 and m.c.stale_dropped == 1


def test_state_dict_roundtrip_forgets_running():
    m = StalenessManager(eta=1, batch_size=2)
    m.try_start(3)
    m.finish(True)
    m2 = StalenessManager(eta=1, batch_size=2)
    m2.load_state_dict(m.state_dict())
    assert m2.c.accepted == 1 and m2.c.running == 0


def test_thread_safety_never_overshoots():
    m = StalenessManager(eta=2, batch_size=50, max_concurrent=1000)
    granted = []
    ts = [threading.Thread(target=lambda: granted.append(sum(m.try_start(1) for _ in range(100)))) for _ in range(8)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert sum(granted) == 150 == m.c.running


def simulate(eta: int, batch: int, durations: list[int], steps: int):
    """Discrete-event run: the producer starts whatever the manager allows, recording the version
    each sample started at; samples finish after random times; the trainer takes the B oldest
    samples once they are all done (it waits for a slow one, it never drops). Nothing here looks
    at the staleness: any bound on it comes from the manager's capacity rule alone."""
    m = StalenessManager(eta, batch)
    clock, running, done, started, trained, d = 0, [], set(), [], [], 0
    while m.version < steps:
        for _ in range(m.try_start(10**6)):
            heapq.heappush(running, (clock + durations[d % len(durations)], len(started)))
            started.append(m.version)
            d += 1
        clock, sid = heapq.heappop(running)
        m.finish(True)
        done.add(sid)
        while m.version < steps and all(i in done for i in range(len(trained), len(trained) + batch)):
            trained += [(i, m.version - started[i], m.version) for i in range(len(trained), len(trained) + batch)]
            m.set_version(m.version + 1)
    return m, trained


@settings(max_examples=60, deadline=None)
@given(eta=st.integers(0, 4), batch=st.integers(1, 6), durations=st.lists(st.integers(1, 50), min_size=1, max_size=30))
def test_property_staleness_never_exceeds_eta(eta, batch, durations):
    m, trained = simulate(eta, batch, durations, steps=6)
    assert all(stale <= eta for _, stale, _ in trained)  # trained version - start version, nothing dropped
    ids = [sid for sid, _, _ in trained]
    assert len(ids) == len(set(ids)) == 6 * batch  # nothing trained twice, each step full


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 6), durations=st.lists(st.integers(1, 50), min_size=1, max_size=30))
def test_property_eta_zero_is_synchronous(batch, durations):
    m, trained = simulate(0, batch, durations, steps=5)
    # every step trains exactly the samples started at that step's version: sync
    assert all(stale == 0 for _, stale, _ in trained)
    by_step = {}
    for sid, _, v in trained:
        by_step.setdefault(v, []).append(sid)
    assert [sorted(by_step[v]) for v in range(5)] == [list(range(v * batch, (v + 1) * batch)) for v in range(5)]


def test_invalid_arguments():
    with pytest.raises(ValueError):
        StalenessManager(eta=-1, batch_size=2)
