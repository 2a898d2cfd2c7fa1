"""The one rollout driver (``episode_rollout``) over an engine with random generation times
(hypothesis), in every mode: staleness never exceeds its bound, every prompt drawn is trained
exactly once or still held, η = 0 is synchronous, partial responses keep their tokens across
versions, over-provisioned steps take the first complete groups and carry the rest, periodic
weights change only between batches, and a checkpoint's held groups resume without loss."""

import itertools
import threading
import time
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from relayrl.data.datasets import PromptSampler
from relayrl.rollout.driver import EpisodeRollout
from relayrl.rollout.groups import oldest_version
from relayrl.rollout.runner import EpisodeRunner
from relayrl.records import (Completion, FinishReason, Group, Prompt, SamplingParams, Trajectory, group_from_dict,
                             group_to_dict)
from tests.fake_engine import FakeEngine

B, G = 3, 2


class Tok:
    eos_token_id = 2

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


def score(text, prompt):
    return float(len(text) % 3 == 0), False


def rollout(eng, eta, *, partial=False, extra=0, park=False, drain=False, n_prompts=5, seed=0, version=0,
            carried=(), drawn=None, max_groups=None, params=SamplingParams(10), scorer=score, size=G, created=None,
            **kw):
    prompts = [Prompt(f"p{i}", [{"role": "user", "content": str(i)}]) for i in range(n_prompts)]
    sampler = PromptSampler(prompts, seed)
    drawn = [] if drawn is None else drawn
    tags = itertools.count()

    def take(n):
        ps = sampler.take(n)
        drawn.extend(p.id for p in ps)
        return ps

    def new_groups(ps):
        tag = next(tags)
        gids = [f"t{version}.{tag}.{k}/{p.id}" for k, p in enumerate(ps)]
        out = [Group(p, gid, [Trajectory(p, gid, i, [1, 2]) for i in range(size)]) for p, gid in zip(ps, gids)]
        if created is not None:
            created.extend(out)
        return out

    runner = EpisodeRunner(eng, Tok(), None, None, scorer)
    ro = EpisodeRollout(runner, take, new_groups, params, B, eta, partial=partial, extra=extra,
                        park_while_training=park, drain_before_publish=drain, version=version, carried=carried,
                        max_groups=max_groups, **kw)
    return ro, drawn


def drive(ro, eng, steps, train_s=0.0, check_load=None):
    batches = []
    try:
        for _ in range(steps):
            v = ro.version
            groups, _ = ro.next_batch()
            batches.append((v, groups))
            if ro.park:  # sync: nothing generates while the trainer has the cores
                assert eng.num_pending() == 0 and not ro.runner.inflight
            time.sleep(train_s)  # the trainer's turn: generation goes on meanwhile (overlapped modes)

            def load(v=v):
                if check_load:
                    check_load(ro)
                eng.load_weights({}, v + 1)

            ro.publish(load)
        held = ro.held()
        assert not ro.runner.inflight and eng.num_pending() == 0  # held: nothing in flight
    finally:
        ro.close()
        ro.runner.close()
    return batches, held


def check_trained(batches, bound):
    trained = []
    for v, groups in batches:
        assert len(groups) == B
        for g in groups:
            assert v - oldest_version(g) <= bound  # never trained beyond the bound
            for t in g.trajectories:
                assert t.complete and t.done and len(t.response_ids) == len(t.versions) == len(t.behav_logprobs)
                assert t.versions == sorted(t.versions) and max(t.versions) <= v
        trained += groups
    assert len({g.group_id for g in trained}) == len(trained)  # no group trained twice
    return trained


def check_accounted(trained, held, drawn):
    """Every prompt drawn from the sampler (once per epoch) is trained or still held, nothing else."""
    assert Counter(g.prompt.id for g in trained + held) == Counter(drawn)


@settings(max_examples=40, deadline=None)
@given(eta=st.integers(0, 4), partial=st.booleans(), seed=st.integers(0, 10**6))
def test_async_staleness_bound_and_every_prompt_once(eta, partial, seed):
    eng = FakeEngine(seed, max_len=12, width=2)
    ro, drawn = rollout(eng, eta, partial=partial, seed=seed)
    batches, held = drive(ro, eng, steps=8)
    check_accounted(check_trained(batches, eta), held, drawn)
    assert all(len(t.response_ids) == len(t.versions) for g in held for t in g.trajectories)


@settings(max_examples=15, deadline=None)
@given(partial=st.booleans(), seed=st.integers(0, 10**6))
def test_eta_zero_is_synchronous(partial, seed):
    eng = FakeEngine(seed, max_len=12, width=2)
    ro, drawn = rollout(eng, 0, partial=partial, park=True, seed=seed, max_groups=6 * B)
    batches, held = drive(ro, eng, steps=6)
    for v, groups in batches:
        # step v trains exactly the prompts drawn for it, all tokens from version v
        assert sorted(g.prompt.id for g in groups) == sorted(drawn[v * B: (v + 1) * B])
        assert {x for g in groups for t in g.trajectories for x in t.versions} == {v}
    assert held == [] and len(drawn) == 6 * B  # nothing generated past the last step


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10**6), extra=st.integers(1, 4))
def test_over_provisioned_sync_takes_first_complete_and_carries_the_rest(seed, extra):
    """APRIL: B + extra groups in flight; a step takes B complete ones, the rest are cut at the step
    (held while the trainer has the cores), continued under the new weights and trained within
    ⌈extra / B⌉ steps; with the run's length given, nothing is generated past its last step."""
    eng = FakeEngine(seed, max_len=12, width=2, delay=0.0005)
    ro, drawn = rollout(eng, 0, partial=True, extra=extra, park=True, seed=seed, n_prompts=7)
    deadline = time.time() + 10
    while ro.next_seq < B + extra:  # the first step puts B + extra groups in flight, no more
        assert time.time() < deadline
        time.sleep(0.001)
    assert ro.next_seq == B + extra == len(drawn)
    batches, held = drive(ro, eng, steps=8)
    check_accounted(check_trained(batches, -(-extra // B)), held, drawn)
    ro, drawn = rollout(FakeEngine(seed), 0, partial=True, extra=extra, park=True, seed=seed, max_groups=8 * B)
    batches, held = drive(ro, ro.runner.engine.engine, steps=8)
    check_accounted(check_trained(batches, -(-extra // B)), held, drawn)
    assert held == [] and len(drawn) == 8 * B


def test_over_provisioning_continues_cut_responses_across_versions():
    mixed = continued = 0
    for seed in range(4):
        eng = FakeEngine(seed, max_len=30, width=2, delay=0.0005)
        ro, _ = rollout(eng, 0, partial=True, extra=3, park=True, seed=seed, n_prompts=9)
        batches, _ = drive(ro, eng, steps=6)
        mixed += sum(len(set(t.versions)) > 1 for _, gs in batches for g in gs for t in g.trajectories)
        continued += ro.runner.continued
    assert mixed and continued


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10**6), partial=st.booleans())
def test_periodic_batches_are_one_version_behind(seed, partial):
    """η = 1: the next batch generates while this one trains; without partial rollouts the weights
    change only once nothing is in flight, so each batch after the first has one version."""
    def nothing_in_flight(ro):
        assert not ro.running and not ro.runner.inflight

    eng = FakeEngine(seed, max_len=12, width=2, delay=0.0005)
    ro, drawn = rollout(eng, 1, partial=partial, drain=True, seed=seed, max_groups=6 * B)  # (the last steps
    batches, held = drive(ro, eng, steps=6, train_s=0.002,  # admit nothing: publish must not wait for them)
                          check_load=None if partial else nothing_in_flight)
    check_accounted(check_trained(batches, 1), held, drawn)
    if not partial:
        for v, groups in batches[1:]:
            assert {x for g in groups for t in g.trajectories for x in t.versions} == {v - 1}


def test_partial_responses_span_versions():
    """With partial rollouts and η ≥ 1, responses cut at a publish continue under the next version."""
    eng = FakeEngine(1, max_len=12, width=2, delay=0.002)
    ro, _ = rollout(eng, 2, partial=True, seed=1)
    batches, _ = drive(ro, eng, steps=10, train_s=0.02)
    mixed = [t for _, gs in batches for g in gs for t in g.trajectories if len(set(t.versions)) > 1]
    assert mixed and ro.runner.continued > 0


def test_a_long_group_is_waited_for_not_overtaken():
    """Survivor bias: short groups admitted later used to overtake a long one until it was too stale
    to train, and it was regenerated or dropped. Now a group at its bound is waited for."""
    class OneSlow(FakeEngine):
        def submit(self, requests):
            super().submit(requests)
            with self.lock:
                for r in requests:
                    if r.request_id.startswith("t0.0.0/"):  # the first group: 10x longer
                        self.live[r.request_id]["target"] = min(r.params.max_new_tokens, 200)

    eng = OneSlow(0, max_len=8, width=4, delay=0.0005)
    prompts_seen = []
    # the length limit is given before the first groups are admitted, so the first group gets its 200
    ro, drawn = rollout(eng, 1, seed=0, n_prompts=20, drawn=prompts_seen, params=SamplingParams(300))
    batches, held = drive(ro, eng, steps=6, train_s=0.001)
    trained = check_trained(batches, 1)
    slow = [(v, g) for v, gs in batches for g in gs if g.group_id.startswith("t0.0.0/")]
    assert len(slow) == 1 and slow[0][0] <= 1  # trained, by the version its bound allows
    assert all(len(t.response_ids) == 200 for t in slow[0][1].trajectories)  # it was the 10x slow one
    assert all(len(t.response_ids) <= 8 for v, gs in batches for g in gs if g is not slow[0][1] for t in g.trajectories)
    check_accounted(trained, held, drawn)


def test_a_group_without_tokens_is_trained_not_looped():
    """A group whose responses all failed before their first token has no oldest version; it must
    still come out (and be dropped by the loop), not wait or be regenerated for ever."""
    class FailingEngine(FakeEngine):
        def get(self, timeout=None):
            time.sleep(0.001)
            with self.lock:
                out = [Completion(rid, [], [], [], FinishReason.FAILED) for rid in self.live]
                self.live.clear()
            return out

    eng = FailingEngine(0)
    ro, _ = rollout(eng, 1, version=5)
    got = []
    t = threading.Thread(target=lambda: got.append(ro.next_batch()), daemon=True)
    t.start()
    t.join(10)
    ro.close()
    ro.runner.close()
    assert got and len(got[0][0]) == B
    assert all(t.finish_reason == FinishReason.FAILED for g in got[0][0] for t in g.trajectories)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10**6), eta=st.integers(0, 3), partial=st.booleans())
def test_held_groups_resume_without_loss_within_the_bound(seed, eta, partial):
    """A checkpoint's groups (complete, cut mid-response, not started) go into a new driver — the
    resumed run — which trains them first; across both, every prompt is trained once or held, cut
    responses go on from their tokens, and the bound holds over the resume."""
    eng = FakeEngine(seed, max_len=20, width=2, delay=0.0005)
    ro, drawn = rollout(eng, eta, partial=partial, park=eta == 0, seed=seed, n_prompts=6)
    first, held = drive(ro, eng, steps=3, train_s=0.001)
    cut = {t.request_id: list(t.response_ids) for g in held for t in g.trajectories if t.response_ids}
    eng2 = FakeEngine(seed + 1, max_len=20, width=2, delay=0.0005)
    eng2.load_weights({}, 3)
    ro2, drawn2 = rollout(eng2, eta, partial=partial, park=eta == 0, seed=seed + 7, n_prompts=6, version=3,
                          carried=held)
    second, held2 = drive(ro2, eng2, steps=3, train_s=0.001)
    trained = check_trained(first + second, eta)
    check_accounted(trained, held2, drawn + drawn2)
    for g in trained + held2:
        for t in g.trajectories:
            if t.request_id in cut:  # continued from its carried tokens
                assert t.response_ids[: len(cut[t.request_id])] == cut[t.request_id]


@settings(max_examples=24, deadline=None)
@given(mode=st.sampled_from(["sync", "periodic", "async"]), partial=st.booleans(), seed=st.integers(0, 10**6))
def test_dynamic_sampling_trains_only_groups_that_teach_and_accounts_for_every_prompt(mode, partial, seed):
    """Zero-variance groups (about two thirds of them here) are left out before acceptance and replaced:
    every trained group has reward variance, the staleness bound holds, every prompt drawn is trained,
    held or filtered (recorded), and the generation they cost is counted. (The cap is out of reach: a
    trainer thread starved by a loaded machine lets up to (η+1)·B groups be accepted in one window,
    which filters ~2·(η+1)·B on average and, 3% of the time, past a cap of 10·B.)"""
    eta = {"sync": 0, "periodic": 1, "async": 2}[mode]
    eng = FakeEngine(seed, max_len=12, width=2)
    ro, drawn = rollout(eng, eta, partial=partial, park=mode == "sync", drain=mode == "periodic", seed=seed,
                        max_groups=5 * B if mode != "async" else None, filter_groups=True, filter_max=1000)
    batches, held = drive(ro, eng, steps=5)
    trained = check_trained(batches, eta)
    assert all(len(set(g.rewards)) > 1 for g in trained)
    filtered, m = ro.take_filtered()
    assert Counter([g.prompt.id for g in trained + held] + filtered) == Counter(drawn)
    assert m["dynamic/filtered_groups"] == len(filtered) == m["dynamic/filtered_total"]
    assert (m["dynamic/filtered_tokens"] > 0) == bool(filtered) and m["dynamic/accepted_unfiltered_total"] == 0
    assert ro.counters()["filtered_pending"] == []  # taken: the next step's record has them


def test_dynamic_sampling_gives_up_past_its_cap_rather_than_generate_forever():
    eng = FakeEngine(3, max_len=6, width=2)
    ro, drawn = rollout(eng, 0, park=True, scorer=lambda text, p: (1.0, None), filter_groups=True, filter_max=1)
    batches, _ = drive(ro, eng, steps=2)
    filtered, m = ro.take_filtered()
    assert [len(gs) for _, gs in batches] == [B, B]
    assert len(filtered) == 2 * B and m["dynamic/accepted_unfiltered_total"] == 2 * B  # B filtered per step


def check_budgets(created, first, size, most):
    """Every group sized by the rule: the first stage, then none without variance, up to ``most``; each
    window of B groups admitted together generates at most B × size episodes."""
    windows = Counter()
    for g in created:
        if not g.sized:  # still in its first stage (held)
            assert len(g.trajectories) == first
            continue
        stage1 = [t.reward for t in g.trajectories[:first]]
        assert first <= len(g.trajectories) <= most
        # solved or hopeless: stopped; with variance: more (its own reserve at least)
        assert (len(g.trajectories) == first) == (len(set(stage1)) == 1)
        windows[g.window] += len(g.trajectories)
    assert all(n <= B * size for n in windows.values()), windows


@settings(max_examples=24, deadline=None)
@given(mode=st.sampled_from(["sync", "periodic", "async"]), partial=st.booleans(), dynamic=st.booleans(),
       seed=st.integers(0, 10**6))
def test_adaptive_budgets_size_groups_within_their_window_in_every_mode(mode, partial, dynamic, seed):
    """rollout.budget=adaptive: groups start with 2 episodes, stop there without variance, else grow up
    to 8 from a window budget of B × 4; with dynamic sampling the stopped ones are filtered. The
    staleness bound holds and every prompt is trained, held or filtered."""
    eta = {"sync": 0, "periodic": 1, "async": 2}[mode]
    eng = FakeEngine(seed, max_len=12, width=3)
    created = []
    ro, drawn = rollout(eng, eta, partial=partial, park=mode == "sync", drain=mode == "periodic", seed=seed,
                        max_groups=5 * B if mode != "async" else None, size=4, created=created,
                        budget=(2, 4, 8), filter_groups=dynamic, filter_max=10)
    batches, held = drive(ro, eng, steps=5)
    trained = check_trained(batches, eta)
    check_budgets(created, 2, 4, 8)
    filtered, _ = ro.take_filtered()
    assert Counter([g.prompt.id for g in trained + held] + filtered) == Counter(drawn)
    if dynamic:
        assert all(len(set(g.rewards)) > 1 for g in trained)
    sizes = [len(g.trajectories) for g in trained]
    m = ro.metrics()
    assert m["budget/extra_total"] == sum(len(g.trajectories) - 2 for g in created if g.sized)
    assert m["budget/stopped_total"] == sum(g.sized and len(g.trajectories) == 2 for g in created)
    assert max(sizes) > 2 or m["budget/stopped_total"] == len(created)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10**6), eta=st.integers(0, 2), partial=st.booleans())
def test_groups_held_in_either_budget_stage_resume_and_keep_their_window(seed, eta, partial):
    """A checkpoint in the middle of first and second stages: the resumed driver finishes each group's
    stage (a group held with its first stage done but not sized is sized then), and draws from the
    saved window surplus; nothing is lost or trained twice."""
    eng = FakeEngine(seed, max_len=20, width=2, delay=0.0005)
    created = []
    ro, drawn = rollout(eng, eta, partial=partial, park=eta == 0, seed=seed, n_prompts=6, size=4, created=created,
                        budget=(2, 4, 8))
    first, held = drive(ro, eng, steps=3, train_s=0.001)
    counters, _ = ro.checkpoint_state()
    held = [group_from_dict(group_to_dict(g)) for g in held]  # through the checkpoint's JSON
    eng2 = FakeEngine(seed + 1, max_len=20, width=2, delay=0.0005)
    eng2.load_weights({}, 3)
    created2 = []
    ro2, drawn2 = rollout(eng2, eta, partial=partial, park=eta == 0, seed=seed + 7, n_prompts=6, version=3,
                          carried=held, size=4, created=created2, budget=(2, 4, 8), counters=counters)
    second, held2 = drive(ro2, eng2, steps=3, train_s=0.001)
    trained = check_trained(first + second, eta)
    check_accounted(trained, held2, drawn + drawn2)
    resumed = {g.group_id: g for g in trained + held2}
    check_budgets([resumed.get(g.group_id, g) for g in created] + created2, 2, 4, 8)


def test_a_carried_group_whose_first_stage_is_done_is_sized_on_resume():
    """Held between its first stage and its sizing (a checkpoint can land there): the resumed run sizes
    it, drawing on the saved surplus of its window, instead of training it as it is."""
    p = Prompt("c", [{"role": "user", "content": "c"}])
    done = [Trajectory(p, "old.0/c", i, [1, 2], [5, 2], [-0.1, -0.1], [0, 0], FinishReason.STOP, reward=float(i),
                       complete=True) for i in range(2)]
    carried = Group(p, "old.0/c", done, window=0, sized=False)
    eng = FakeEngine(0, max_len=6, width=2)
    eng.load_weights({}, 1)
    ro, _ = rollout(eng, 1, version=1, carried=[carried], size=4, budget=(2, 4, 8),
                    counters={"budget_banks": {"0": 3}, "budget_admitted": B})
    batches, _ = drive(ro, eng, steps=1)
    (g,) = [g for _, gs in batches for g in gs if g.group_id == "old.0/c"]
    assert len(g.trajectories) == 2 + 5  # rewards 0, 1: p = 1/2 wants 6; its reserve 2 and 3 of the surplus
    assert [t.response_ids for t in g.trajectories[:2]] == [[5, 2], [5, 2]]  # the first stage kept as it was
