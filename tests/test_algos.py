"""Hand-computed checks of the algorithm math (expected values worked out by hand in comments)."""

import math

import pytest
import torch

from relayrl.algos import ADVANTAGES, AGGREGATIONS, kl_penalty, lookup
from relayrl.algos.advantages import dr_grpo, grpo, rloo
from relayrl.algos.losses import ppo_clip

R = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.7])
G = torch.tensor([0, 0, 0, 0, 1])


def test_grpo_hand_computed():
    # group 0: mean 0.5, Bessel std sqrt(4 * 0.25 / 3) = 0.57735; group of one: A = R / (1 + eps)
    a = grpo(R, G)
    assert torch.allclose(a[:4], torch.tensor([0.866025, -0.866025, -0.866025, 0.866025]), atol=1e-5)
    assert a[4].item() == pytest.approx(0.7, abs=1e-5)


def test_dr_grpo_and_rloo_hand_computed():
    assert torch.allclose(dr_grpo(R, G), torch.tensor([0.5, -0.5, -0.5, 0.5, 0.7]))
    # R_0 - mean(0, 0, 1) = 2/3 = 4/3 * 0.5
    assert torch.allclose(rloo(R, G), torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.7]), atol=1e-6)


def test_all_equal_group_has_zero_advantage():
    r, g = torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0, 0, 0])
    for fn in ADVANTAGES.values():
        assert torch.all(fn(r, g) == 0)


def test_ppo_clip_cases():
    # r = 1.5, A = 1 → clipped at 1.2: ℓ = -1.2 | r = 0.5, A = -1 → clipped at 0.8: ℓ = 0.8
    # r = 0.5, A = 1 → unclipped -0.5        | r = 5, A = -1 → ℓ = 5, dual clip c = 3 → 3
    ratio = torch.tensor([[1.5, 0.5, 0.5, 5.0]])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    mask = torch.ones(1, 4)
    loss, m = ppo_clip(ratio.log(), torch.zeros(1, 4), adv, mask, 0.2, 0.2, None)
    assert torch.allclose(loss, torch.tensor([[-1.2, 0.8, -0.5, 5.0]]), atol=1e-6)
    assert m["clip_frac"].item() == pytest.approx(0.5)
    loss, m = ppo_clip(ratio.log(), torch.zeros(1, 4), adv, mask, 0.2, 0.2, 3.0)
    assert torch.allclose(loss, torch.tensor([[-1.2, 0.8, -0.5, 3.0]]), atol=1e-6)
    # convention (verl's): the dual-clipped token is counted apart, not in clip_frac
    assert m["clip_frac"].item() == pytest.approx(0.5) and m["clip_frac_dual"].item() == pytest.approx(0.25)


def test_clip_higher_is_asymmetric():
    # ε_low 0.2, ε_high 0.28: r = 1.25, A = 1 is inside the region (ℓ = -1.25); r = 0.75, A = -1 is clipped (0.8)
    ratio = torch.tensor([[1.25, 0.75]])
    loss, _ = ppo_clip(ratio.log(), torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), 0.2, 0.28)
    assert torch.allclose(loss, torch.tensor([[-1.25, 0.8]]), atol=1e-6)


def test_aggregations_hand_computed():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # token_mean: 10 / 4; seq_mean_token_mean: (2 + 4) / 2; sum_norm: 10 / (2 * 4)
    assert AGGREGATIONS["token_mean"](loss, mask, 4, 2, 4).item() == pytest.approx(2.5)
    assert AGGREGATIONS["seq_mean_token_mean"](loss, mask, 4, 2, 4).item() == pytest.approx(3.0)
    assert AGGREGATIONS["seq_mean_token_sum_norm"](loss, mask, 4, 2, 4).item() == pytest.approx(1.25)


def test_kl_estimators_hand_computed():
    logp, ref = torch.tensor([0.0]), torch.tensor([math.log(0.5)])
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(math.log(2))
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 + math.log(2) - 1)
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(logp, ref, "k9")


def test_registry_rejects_unknown_names():
    with pytest.raises(KeyError, match="grpo"):
        lookup(ADVANTAGES, "grpoo", "advantage estimator")
