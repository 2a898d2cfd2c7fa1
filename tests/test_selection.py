"""Prompt selection and adaptive budgets: the pure math by hand, the sampler's epochs and resume,
and advantages over groups of different sizes."""

from collections import Counter

import numpy as np
import pytest
import torch

from relayrl.data import selection as sel
from relayrl.algos.advantages import dr_grpo, grpo, rloo
from relayrl.records import Prompt
from relayrl.data.prompt_sampler import PromptSampler, SamplerState, SelectionError


def test_decay_prior_and_posterior_by_hand():
    assert sel.decayed(4.0, 2.0, since=3, now=5, forget=0.5) == (1.0, 0.5)  # 0.5² of each
    assert sel.decayed(4.0, 2.0, since=5, now=5, forget=0.5) == (4.0, 2.0)
    assert sel.prior(0.0, 0.0, 2.0) == (1.0, 1.0)  # an empty group: mean 1/2
    assert sel.prior(3.0, 1.0, 3.0) == pytest.approx((3 * 4 / 6, 3 * 2 / 6))  # Laplace mean (3+1)/(4+2)
    assert sel.posterior((1.0, 1.0), 2.0, 5.0) == (3.0, 6.0)


def test_wanted_extra_and_grant_by_hand():
    assert sel.wanted_extra([1, 1, 1, 1], 16) == 0  # solved: no variance
    assert sel.wanted_extra([0, 0, 0, 0], 16) == 0  # hopeless
    assert sel.wanted_extra([1, 0, 0, 0], 16) == 9  # p = 1/4: ⌈12 · 4 · 1/4 · 3/4⌉ = ⌈9⌉
    assert sel.wanted_extra([1, 1, 0, 0], 16) == 12  # p = 1/2: all of n_max − n
    assert sel.wanted_extra([1, 0, 0], 8) == 5  # ⌈5 · 4 · 1/3 · 2/3⌉ = ⌈4.44⌉
    assert sel.wanted_extra([0.5, 0.0, 1.0, 0.5], 8) == 4  # fractional rewards: p = 1/2
    assert sel.grant(9, reserve=4, surplus=3) == (7, 0)  # own reserve, then the surplus
    assert sel.grant(2, reserve=4, surplus=1) == (2, 3)  # the unused reserve goes to the surplus
    assert sel.grant(0, reserve=4, surplus=0) == (0, 4)  # a group that stops gives its reserve away


def test_vade_prefers_uncertain_prompts_and_cures_weights_by_hand():
    rng = np.random.default_rng(0)
    alpha = np.array([999.0, 500.0, 1.0, 480.0])
    beta = np.array([1.0, 500.0, 999.0, 520.0])  # solved, a coin, hopeless, almost a coin
    assert sel.vade_pick(alpha, beta, 2, rng) == [1, 3]
    w = sel.cures_weights(np.array([1.0, 1.0, 1.0]), np.array([1.0, 3.0, 1e6]))
    assert w == pytest.approx([0.5, (0.25 * 0.75) ** 0.5, 0.025])  # the last one floored at 0.05 × 1/2
    picks = Counter(j for s in range(2000) for j in sel.cures_pick(np.array([1.0, 1.0, 1.0]),
                                                                   np.array([1.0, 3.0, 1e6]), 1,
                                                                   np.random.default_rng(s)))
    # one draw ∝ weights: 0.5 / 0.933, 0.433 / 0.933, 0.025 / 0.933
    assert picks[0] / 2000 == pytest.approx(0.536, abs=0.04) and picks[2] / 2000 == pytest.approx(0.027, abs=0.015)


def prompts(n, key=None):
    return [Prompt(f"p{i}", [{"role": "user", "content": str(i)}], metadata={} if key is None else {key: i % 3})
            for i in range(n)]


def test_uniform_sampler_keeps_its_epoch_order():
    ps = prompts(10)
    a = PromptSampler(ps, seed=3)
    first = [p.id for p in a.take(25)]
    assert all(sorted(first[e * 10:(e + 1) * 10]) == sorted(p.id for p in ps) for e in range(2))
    b = PromptSampler(ps, seed=3, selection="uniform")
    assert [p.id for p in b.take(4)] + [p.id for p in b.take(21)] == first


@pytest.mark.parametrize("how", ["vade", "cures"])
def test_selection_draws_every_prompt_once_per_epoch(how):
    ps = prompts(23)
    s = PromptSampler(ps, seed=1, selection=how, pool=3)
    drawn = []
    for k in range(12):
        got = s.take(4)
        for p in got:
            s.observe(p, [float(int(p.id[1:]) % 2), 0.0, 1.0], version=k)
        drawn += [p.id for p in got]
    for e in range(2):  # 48 draws: two whole epochs of 23, then 2 of the third
        assert sorted(drawn[e * 23:(e + 1) * 23]) == sorted(p.id for p in ps)
    assert s.state.consumed == 48


def test_vade_learns_which_prompts_teach():
    """Half the prompts are always solved; after seeing each once, vade picks the others."""
    ps = prompts(400)
    solved = {p.id for p in ps[:200]}
    s = PromptSampler(ps, seed=0, selection="vade", pool=4, forget=1.0)

    def outcome(p):
        return [1.0] * 8 if p.id in solved else [1.0, 0.0] * 4

    for k in range(50):  # no evidence about individual prompts in the first pass, but the pooled prior...
        for p in s.take(8):
            s.observe(p, outcome(p), version=k)
    # ...is one group here, so the first pass is a coin toss; in the second epoch prompts have evidence
    late = []
    for k in range(50, 75):
        got = s.take(8)
        late += got
        for p in got:
            s.observe(p, outcome(p), version=k)
    assert sum(p.id not in solved for p in late) / len(late) > 0.9


def test_a_group_key_gives_unseen_prompts_their_groups_prior():
    """Prompts in group 0 are solved, the others are coins; never-seen prompts of group 0 are avoided."""
    ps = prompts(3000, key="level")
    s = PromptSampler(ps, seed=0, selection="vade", key="level", forget=1.0)
    for k in range(40):
        got = s.take(8)
        for p in got:
            s.observe(p, [1.0] * 8 if p.metadata["level"] == 0 else [1.0, 0.0] * 4, version=k)
    assert sum(p.metadata["level"] == 0 for p in got) <= 1 and s.metrics()["selection/prompts_tracked"] == 320
    with pytest.raises(SelectionError, match=r"data.selection_key='levle': prompt 'p0' has no metadata field"):
        PromptSampler(ps, seed=0, selection="vade", key="levle")


def test_selection_resumes_exactly_from_its_snapshot():
    ps = prompts(50, key="level")
    a = PromptSampler(ps, seed=5, selection="vade", key="level", pool=4, forget=0.8)
    seq = []
    for k in range(20):
        got = a.take(3)
        seq.append([p.id for p in got])
        for p in got:
            a.observe(p, [1.0, 0.0, float(k % 2)], version=k)
        if k == 8:
            saved = SamplerState(**a.snapshot().__dict__)
    b = PromptSampler(ps, seed=5, selection="vade", key="level", pool=4, forget=0.8, state=saved)
    for k in range(9, 20):
        got = b.take(3)
        assert [p.id for p in got] == seq[k]
        for p in got:
            b.observe(p, [1.0, 0.0, float(k % 2)], version=k)
    assert b.state == a.state


def test_advantages_of_groups_of_different_sizes_by_hand():
    """Adaptive budgets give groups of 2 and 6 responses in one batch: each is normalised over its own."""
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    group = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1])
    # group 0: mean 1/2, std (Bessel) sqrt(1/2); group 1: mean 1/3, std sqrt((2·(2/3)² + 4·(1/3)²)/5) = sqrt(4/15)
    s0, s1 = 0.5 ** 0.5, (4 / 15) ** 0.5
    expect = [0.5 / s0, -0.5 / s0] + [(2 / 3) / s1] * 2 + [(-1 / 3) / s1] * 4
    assert grpo(rewards, group).tolist() == pytest.approx(expect, rel=1e-5)
    assert dr_grpo(rewards, group).tolist() == pytest.approx([0.5, -0.5] + [2 / 3] * 2 + [-1 / 3] * 4)
    # RLOO: G/(G−1) (R − mean): 2 · (±1/2) and 6/5 · (2/3, −1/3)
    assert rloo(rewards, group).tolist() == pytest.approx([1.0, -1.0] + [0.8] * 2 + [-0.4] * 4)
