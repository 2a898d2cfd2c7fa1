"""Hand-computed checks of GSPO, GSPO-token and CISPO, the aggregation conventions, and every policy
loss composed with every off-policy correction (algos/losses.py, algos/offpolicy.py)."""

import math

import pytest
import torch

from relayrl.algos import AGGREGATIONS, CORRECTIONS, POLICY_LOSSES
from relayrl.algos.losses import cispo, count_seqs, gspo, gspo_token
from relayrl.algos.offpolicy import Knobs, approx_prox_logp

T = torch.tensor
L = math.log


def test_gspo_sequence_ratio_and_clip_hand_computed():
    # log r = [log 1.1, log 1.3]: s = sqrt(1.43) = 1.19583; A = 1 inside (0.8, 1.2): ℓ = -1.19583 on each token
    logp, anchor = T([[L(1.1), L(1.3)]]), torch.zeros(1, 2)
    loss, m = gspo(logp, anchor, torch.ones(1, 2), torch.ones(1, 2), 0.2, 0.2)
    assert torch.allclose(loss, torch.full((1, 2), -math.sqrt(1.43)), atol=1e-5) and m["clip_frac"].item() == 0
    loss, m = gspo(logp, anchor, torch.ones(1, 2), torch.ones(1, 2), 0.2, 0.1)  # ceiling 1.1 binds
    assert torch.allclose(loss, torch.full((1, 2), -1.1)) and m["clip_frac"].item() == 1.0
    # A is the sequence's token mean of the advantages: [2, 0] → 1; a masked token takes no part
    loss, _ = gspo(T([[L(1.1), L(1.3), 5.0]]), torch.zeros(1, 3), T([[2.0, 0.0, 9.0]]), T([[1.0, 1.0, 0.0]]), 0.2, 0.2)
    assert loss[0, 0].item() == pytest.approx(-math.sqrt(1.43), rel=1e-5)


def test_gspo_token_equals_gspo_for_sequence_advantages():
    """Value and gradient, aggregated with seq_mean_token_mean (the GSPO paper's mean over sequences):
    ∂ℓ/∂log π_t = -A_i·s_i/|y_i| for both forms."""
    g = torch.Generator().manual_seed(0)
    old = torch.randn(3, 5, generator=g) - 2
    mask = T([[1.0] * 5, [1.0, 1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0, 0.0]])
    adv = T([[1.0], [-0.5], [2.0]]).expand(3, 5)
    grads, values = [], []
    for fn in (gspo, gspo_token):
        logp = (old + 0.05 * torch.randn(3, 5, generator=torch.Generator().manual_seed(1))).requires_grad_()
        loss, _ = fn(logp, old, adv, mask, 0.2, 0.2)
        total = AGGREGATIONS["seq_mean_token_mean"](loss, mask, mask.sum().item(), 3, 5)
        total.backward()
        grads.append(logp.grad * mask)
        values.append(total.item())
    assert values[0] == pytest.approx(values[1], rel=1e-6)
    assert torch.allclose(grads[0], grads[1], atol=1e-7) and grads[0].abs().sum() > 0
    # by hand for row 2: s = exp(mean log r), gradient -A·s/2 on each of its 2 tokens, / 3 sequences
    s2 = math.exp(((old.new_tensor(0) + 0.05 * torch.randn(3, 5, generator=torch.Generator().manual_seed(1)))[2, :2]
                   ).mean().item())
    assert grads[0][2, 0].item() == pytest.approx(-2.0 * s2 / 2 / 3, rel=1e-5)


def _gspo_grad(fn, log_r, adv, clip=(3e-4, 4e-4)):
    """(value, ∂/∂log π_θ) of ``fn`` over one row aggregated with seq_mean_token_mean (anchor 0)."""
    logp = T([log_r]).requires_grad_()
    mask = torch.ones_like(logp)
    loss, _ = fn(logp, torch.zeros_like(logp), torch.full_like(logp, adv), mask, *clip)
    total = AGGREGATIONS["seq_mean_token_mean"](loss, mask, mask.sum().item(), 1, logp.shape[1])
    total.backward()
    return total.item(), logp.grad[0].tolist()


@pytest.mark.parametrize("fn", [gspo, gspo_token], ids=["gspo", "gspo_token"])
def test_gspo_forms_take_no_gradient_where_the_log_s_clamp_binds(fn):
    # log r = (25, 0): log s = 12.5, clamped to 10, so ℓ = max(-e^10·A, -clip(e^10)·A) = e^10 (A = -1,
    # unclipped) and ∂ℓ/∂log π = 0 (the clamp's derivative, as verl's compute_policy_loss_gspo)
    value, grad = _gspo_grad(fn, [25.0, 0.0], -1.0)
    assert value == pytest.approx(math.exp(10.0), rel=1e-6) and grad == [0.0, 0.0]
    # unclamped: log r = (0.3, -0.1), s = e^0.1, A = -1: ℓ = s (unclipped), ∂/∂log π_t = s/|y| = 0.552585
    value, grad = _gspo_grad(fn, [0.3, -0.1], -1.0)
    assert value == pytest.approx(math.exp(0.1), rel=1e-6)
    assert grad == pytest.approx([math.exp(0.1) / 2] * 2, rel=1e-6)
    # and A = +1 with no trust region: ℓ = -s, ∂/∂log π_t = -s/2
    value, grad = _gspo_grad(fn, [0.3, -0.1], 1.0, (None, None))
    assert value == pytest.approx(-math.exp(0.1), rel=1e-6) and grad == pytest.approx([-math.exp(0.1) / 2] * 2, rel=1e-6)


def test_cispo_clips_and_detaches_the_weight_hand_computed():
    # r = [1.5, 0.5], A = [1, -1], no lower bound, ε_high 0.28: w = [1.28, 0.5];
    # ℓ = -w·A·log π = [-1.28·log .3, 0.5·log .2]; ∂ℓ/∂log π = -w·A = [-1.28, 0.5]
    logp = T([[L(0.3), L(0.2)]]).requires_grad_()
    anchor = T([[L(0.2), L(0.4)]])
    loss, m = cispo(logp, anchor, T([[1.0, -1.0]]), torch.ones(1, 2), None, 0.28)
    assert torch.allclose(loss, T([[-1.28 * L(0.3), 0.5 * L(0.2)]]), atol=1e-5)
    assert m["clip_frac"].item() == 0.5
    loss.sum().backward()
    assert torch.allclose(logp.grad, T([[-1.28, 0.5]]), atol=1e-5)
    loss, _ = cispo(logp, anchor, T([[1.0, -1.0]]), torch.ones(1, 2), 0.2, 0.28)  # with a floor 0.8: w = [1.28, 0.8]
    assert loss[0, 1].item() == pytest.approx(0.8 * L(0.2), rel=1e-5)


def test_fully_masked_rows_do_not_count_in_num_seqs():
    """Convention (aligned with verl): a row with no trained token (a truncated response under
    algo.overlong=filter) does not dilute the sequence means."""
    loss = T([[1.0, 3.0], [4.0, 9.0], [7.0, 7.0]])
    mask = T([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    assert count_seqs(mask).item() == 2
    # (2 + 4) / 2 sequences, not / 3
    assert AGGREGATIONS["seq_mean_token_mean"](loss, mask, 3, count_seqs(mask).item(), 2).item() == pytest.approx(3.0)


def test_approx_prox_gives_version_minus_one_tokens_their_behaviour_logprob():
    """Convention: a token sampled by no policy (version −1: prompt, padding) has α = 0."""
    out = approx_prox_logp(T([[-1.0, -1.0]]), T([[0.0, -2.0]]), T([[-1, 3]]), v_prox=5, v_theta=7)
    assert torch.allclose(out, T([[0.0, -1.5]]))


# -- every loss × every correction -----------------------------------------------------------------

def _inputs():
    g = torch.Generator().manual_seed(3)
    old = torch.randn(3, 4, generator=g) - 1.5
    behav = old + torch.randn(3, 4, generator=g) * 0.9  # some weights π_old/π_behav above 2 and 5
    logp = (old + 0.3 * torch.randn(3, 4, generator=g)).requires_grad_()
    adv = torch.randn(3, 4, generator=g)
    mask = T([[1.0] * 4, [1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    stale = T([[True] * 4, [False] * 4, [True, False, False, False]]) & mask.bool()
    return logp, old, behav, adv, mask, stale


def _by_hand(name, old, behav, adv, mask, stale):
    """(anchor, weight, trust region) of algorithms.md §2, written out."""
    w = torch.exp(old - behav)
    if name == "none":
        return old, torch.ones_like(w), True
    if name == "decoupled":  # π_prox/π_behav on stale tokens, dropped above 5; 1 on fresh ones
        return old, torch.where(stale, w * (w <= 5), torch.ones_like(w)), True
    if name == "tis":
        return old, w.clamp(max=2.0) * mask, True
    # M2PO (τ = 0.2 here): no ε-clip, the ratio against π_behav, weight 1 but on the masked tokens. By hand, from
    # (log r)² = (old − behav)² on the 9 trained tokens, × marking the trust region (A > 0 and r > 1, or A < 0 and
    # r < 1): [.6056×, .0724, .1424×, .0052× | .6952×, .5389×, .1986×, · | .3723, .9086×, ·, ·], sum 3.5393, mean
    # .393 > τ. Masking the largest × first: .9086 → 2.6306/8 = .329; .6952 → 1.9354/7 = .276; .6056 →
    # 1.3298/6 = .222; .5389 → .7909/5 = .158 ≤ τ: four masked
    return behav, T([[0.0, 1.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]]), False


@pytest.mark.parametrize("loss_name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("correction", sorted(CORRECTIONS))
def test_every_loss_composes_with_every_correction(loss_name, correction):
    logp, old, behav, adv, mask, stale = _inputs()
    anchor, weight, trust = CORRECTIONS[correction].apply(old, behav, adv, mask, stale, None, Knobs(m2po_tau=0.2))
    want_anchor, want_w, want_trust = _by_hand(correction, old, behav, adv, mask, stale)
    w = torch.ones_like(mask) if weight is None else weight
    assert torch.equal(anchor, want_anchor) and trust == want_trust
    assert torch.allclose(w * mask, want_w * mask)
    if correction in ("decoupled", "tis"):
        assert ((w * mask) != mask).any()  # the inputs reach the bound or the cap: something to check
    clip = (0.2, 0.28, None) if trust else (None, None, None)
    loss, m = POLICY_LOSSES[loss_name](logp, anchor, adv, mask, *clip)
    assert torch.isfinite(loss).all() and set(m) >= {"clip_frac", "clip_frac_dual"}
    if not trust:  # without a trust region no loss clips
        assert m["clip_frac"].item() == 0


def test_m2po_never_masks_a_token_outside_the_trust_region():
    """τ = 0.1 on ``_inputs`` ((log r)² in ``_by_hand``): masking the 7 trust-region tokens leaves the 2 outside
    it, (.0724 + .3723)/2 = .222 > τ, and they stay: a token the loss already pushes back towards π_behav (.3723:
    A < 0, r > 1) is never masked, however far off."""
    logp, old, behav, adv, mask, stale = _inputs()
    _, keep, _ = CORRECTIONS["m2po"].apply(old, behav, adv, mask, stale, None, Knobs(m2po_tau=0.1))
    assert torch.equal(keep, T([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))
