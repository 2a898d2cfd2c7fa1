"""The asynchronous rollout controller over an engine with random generation times (hypothesis):
staleness never exceeds η, every prompt drawn is trained exactly once or still held, η = 0 is
synchronous, and partial responses keep their tokens across versions."""

import itertools
import time
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from relayrl.async_rollout import AsyncRollout, oldest_version
from relayrl.data import PromptSampler
from relayrl.records import Group, Prompt, SamplingParams, Trajectory
from tests.fake_engine import FakeEngine

B, G = 3, 2


def run(eta: int, partial: bool, stale: str, seed: int, steps: int, n_prompts: int = 5, train_s: float = 0.0,
        delay: float = 0.0):
    prompts = [Prompt(f"p{i}", [{"role": "user", "content": str(i)}]) for i in range(n_prompts)]
    sampler = PromptSampler(prompts, seed)
    drawn: list[str] = []
    tags = itertools.count()

    def take(n):
        ps = sampler.take(n)
        drawn.extend(p.id for p in ps)
        return ps

    def new_groups(ps):
        tag = next(tags)
        gids = [f"t{tag}.{k}/{p.id}" for k, p in enumerate(ps)]
        return [Group(p, gid, [Trajectory(p, gid, i, [1, 2]) for i in range(G)]) for p, gid in zip(ps, gids)]

    eng = FakeEngine(seed, max_len=12, width=2, delay=delay)
    ro = AsyncRollout(eng, take, new_groups, SamplingParams(10), B, eta, partial=partial, stale=stale)
    batches = []
    try:
        for v in range(steps):
            groups, _ = ro.next_batch(v)
            batches.append((v, groups))
            time.sleep(train_s)  # the trainer's turn: generation goes on meanwhile
            ro.publish(lambda v=v: eng.load_weights({}, v + 1), v + 1)
        held = ro.held()
    finally:
        ro.close()
    return batches, held, drawn, ro


@settings(max_examples=60, deadline=None)
@given(eta=st.integers(0, 4), partial=st.booleans(), stale=st.sampled_from(["requeue", "discard"]),
       seed=st.integers(0, 10**6))
def test_staleness_bound_and_every_prompt_once(eta, partial, stale, seed):
    batches, held, drawn, ro = run(eta, partial, stale, seed, steps=8)
    trained = []
    for v, groups in batches:
        assert len(groups) == B
        for g in groups:
            assert v - oldest_version(g) <= eta  # never trained beyond the bound
            for t in g.trajectories:
                assert t.done and len(t.response_ids) == len(t.versions) == len(t.behav_logprobs)
                assert t.versions == sorted(t.versions) and max(t.versions) <= v
        trained += groups
    assert len({g.group_id for g in trained}) == len(trained)  # no group trained twice
    # every prompt drawn from the sampler (once per epoch) is trained, still held, or counted as discarded
    assert ro.stale_discarded == 0 or stale == "discard"
    accounted = Counter(g.prompt.id for g in trained + held)
    assert sum((Counter(drawn) - accounted).values()) == ro.stale_discarded
    assert not accounted - Counter(drawn)
    # held groups carry their partial tokens and nothing is in flight
    assert ro.inflight == {} and all(len(t.response_ids) == len(t.versions) for g in held for t in g.trajectories)


@settings(max_examples=15, deadline=None)
@given(partial=st.booleans(), seed=st.integers(0, 10**6))
def test_eta_zero_is_synchronous(partial, seed):
    batches, held, drawn, ro = run(0, partial, "requeue", seed, steps=6)
    for v, groups in batches:
        # step v trains exactly the prompts drawn for it, all tokens from version v, none dropped
        assert [g.prompt.id for g in groups] == drawn[v * B : (v + 1) * B]
        assert {x for g in groups for t in g.trajectories for x in t.versions} == {v}
    assert ro.stale_requeued == ro.stale_discarded == 0 and held == [] and len(drawn) == 6 * B


def test_partial_responses_span_versions():
    """With partial rollouts and η ≥ 1, responses cut at a publish continue under the next version."""
    batches, _, _, ro = run(2, True, "requeue", seed=1, steps=10, train_s=0.02, delay=0.002)
    mixed = [t for _, gs in batches for g in gs for t in g.trajectories if len(set(t.versions)) > 1]
    assert mixed and ro.resumed > 0


def test_long_groups_are_not_overtaken_until_stale():
    """Survivor bias: with oldest-ready-first batches, groups admitted later but finishing sooner
    overtook a long group until it was more than η versions old; it was then regenerated (or
    dropped), so long responses were trained less often than they were started. Groups at their
    staleness deadline now go first (and a batch keeps room for those still generating)."""
    requeued = 0
    for seed in range(6):
        _, _, _, ro = run(1, False, "requeue", seed, steps=25, n_prompts=40, train_s=0.004, delay=0.001)
        requeued += ro.stale_requeued
    assert requeued == 0


def test_a_group_without_tokens_is_not_requeued_forever():
    """A group whose responses all failed before their first token has no oldest version: it read
    as version 0, hence stale for ever after version η, and was regenerated endlessly."""
    import threading

    from relayrl.records import Completion, FinishReason

    class FailingEngine(FakeEngine):
        def get(self, timeout=None):
            with self.lock:
                out = [Completion(rid, [], [], [], FinishReason.FAILED) for rid in self.live]
                self.live.clear()
            return out

    prompts = [Prompt(f"p{i}", [{"role": "user", "content": str(i)}]) for i in range(4)]
    sampler = PromptSampler(prompts, 0)
    new = lambda ps: [Group(p, f"g{id(p)}{k}", [Trajectory(p, f"g{id(p)}{k}", i, [1]) for i in range(G)])  # noqa: E731
                      for k, p in enumerate(ps)]
    ro = AsyncRollout(FailingEngine(0), sampler.take, new, SamplingParams(10), B, 1, version=5)
    got = []
    t = threading.Thread(target=lambda: got.append(ro.next_batch(5)), daemon=True)
    t.start()
    t.join(10)
    ro.close()
    assert got and len(got[0][0]) == B and ro.stale_requeued == 0
