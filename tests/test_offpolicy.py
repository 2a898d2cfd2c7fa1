"""Hand-computed checks of the off-policy corrections."""

import math

import pytest
import torch

from relayrl.algos.offpolicy import (
    approx_prox_logp,
    decoupled_ppo,
    ess_lr_scale,
    m2po,
    tis_weights,
)

L = math.log


def test_decoupled_ppo_weights_and_trust_region():
    # prox = 0; behav = log .5 → w = 2; u = 1.1 inside the region: ℓ = -2 * 1.1
    # u = 1.5 clipped at 1.2: ℓ = -2 * 1.2 | behav = log .1 → w = 10 > 5: masked (0), or clamped to 5
    logp = torch.tensor([[L(1.1), L(1.5), L(1.1)]])
    prox = torch.zeros(1, 3)
    behav = torch.tensor([[L(0.5), L(0.5), L(0.1)]])
    adv, mask = torch.ones(1, 3), torch.ones(1, 3)
    loss, m = decoupled_ppo(logp, prox, behav, adv, mask, 0.2, 0.2)
    assert torch.allclose(loss, torch.tensor([[-2.2, -2.4, 0.0]]), atol=1e-5)
    assert m["behav_masked_frac"].item() == pytest.approx(1 / 3)
    loss, _ = decoupled_ppo(logp, prox, behav, adv, mask, 0.2, 0.2, w_mode="clamp")
    assert loss[0, 2].item() == pytest.approx(-5 * 1.1, rel=1e-5)


def test_decoupled_ppo_on_policy_equals_ppo_clip():
    from relayrl.algos.losses import ppo_clip

    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    old = torch.tensor([[-1.1, -1.5, -0.5]])
    adv, mask = torch.tensor([[1.0, -1.0, 2.0]]), torch.ones(1, 3)
    a, _ = decoupled_ppo(logp, old, old, adv, mask, 0.2, 0.28)
    b, _ = ppo_clip(logp, old, adv, mask, 0.2, 0.28)
    assert torch.allclose(a, b)


def test_approx_prox_interpolates_by_version():
    # v_behav 3, v_prox 5, v_θ 7 → α = 2/4: -2 + 0.5 * (-1 - -2) = -1.5; a current token (v 7) → π_behav
    logp = torch.tensor([[-1.0, -1.0]])
    behav = torch.tensor([[-2.0, -2.0]])
    out = approx_prox_logp(logp, behav, torch.tensor([[3, 7]]), v_prox=5, v_theta=7)
    assert torch.allclose(out, torch.tensor([[-1.5, -2.0]]))


def test_tis_token_sequence_mask_and_normalize():
    old = torch.tensor([[L(3.0), L(0.5)]])
    behav = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    w, m = tis_weights(old, behav, mask, cap=2.0)
    assert torch.allclose(w, torch.tensor([[2.0, 0.5]]))
    assert m["tis_capped_frac"].item() == pytest.approx(0.5)
    w, _ = tis_weights(old, behav, mask, cap=2.0, level="sequence")  # exp(log 3 + log .5) = 1.5
    assert torch.allclose(w, torch.tensor([[1.5, 1.5]]))
    w, _ = tis_weights(old, behav, mask, cap=2.0, mode="mask")
    assert torch.allclose(w, torch.tensor([[0.0, 1.0]]))
    w, _ = tis_weights(old, behav, mask, cap=2.0, normalize=True)  # [2, .5] / 1.25
    assert torch.allclose(w, torch.tensor([[1.6, 0.4]]))


def test_m2po_masks_largest_trust_region_token_until_second_moment_is_small():
    # log r = [.5, -.3, .1, 0], A = [1, -1, -1, 1]: candidates t0, t1; (log r)^2 mean .35/4 > .04;
    # drop t0 → .10/3 = .033 ≤ .04. Loss -M r A: [0, e^-.3, e^.1, -1]
    behav = torch.zeros(1, 4)
    logp = torch.tensor([[0.5, -0.3, 0.1, 0.0]])
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    loss, m = m2po(logp, behav, adv, torch.ones(1, 4), tau=0.04)
    assert torch.allclose(loss, torch.tensor([[0.0, math.exp(-0.3), math.exp(0.1), -1.0]]), atol=1e-6)
    assert m["m2po_masked_frac"].item() == pytest.approx(0.25)


def test_m2po_keeps_everything_when_already_within_tau():
    logp = torch.tensor([[0.1, -0.1]])
    loss, m = m2po(logp, torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), tau=0.04)
    assert m["m2po_masked_frac"].item() == 0.0


def test_ess_scale_hand_computed():
    # w = [1, 1, 2, 2]: ESS = 36 / 10 = 3.6, ρ = .9, scale = sqrt(.9)
    scale, ess = ess_lr_scale(torch.tensor([0.0, 0.0, L(2), L(2)]))
    assert ess.item() == pytest.approx(3.6, rel=1e-5)
    assert scale.item() == pytest.approx(math.sqrt(0.9), rel=1e-5)
    scale, _ = ess_lr_scale(torch.zeros(8))  # equal weights: ESS = B, no scaling
    assert scale.item() == pytest.approx(1.0)
