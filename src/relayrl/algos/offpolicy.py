"""Off-policy corrections for stale or mismatched samples: pure tensor functions.

Policies: π_θ (being trained, ``logp``), π_prox (the policy at the start of the training step,
``prox_logp``), π_behav (the one that sampled the token, ``behav_logp``, recorded by the engine
with the token's version). Shapes [B, T]; ``mask`` marks trained tokens. Per-token losses come
back unaggregated; aggregate them with the original mask so masked tokens still count in the
divisor ("normalise by the original token count", algorithms.md §2).

A correction composes with any policy loss (``losses.POLICY_LOSSES``): it says which policy the
loss's ratio is taken against (the *anchor*: π_old, or π_behav), a detached per-token weight the
loss is multiplied by, and whether the loss keeps its trust region (``CORRECTIONS``). A new
correction is one function and one registry line; the trainer has no branch per name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from relayrl.algos.losses import LOG_CLAMP, ppo_clip


def approx_prox_logp(logp: Tensor, behav_logp: Tensor, versions: Tensor, v_prox: int, v_theta: int) -> Tensor:
    """log π_prox ≈ log π_behav + α (log π_θ − log π_behav), α = (v_prox − v_behav)/(v_θ − v_behav)
    per token (AReaL's log-linear interpolation; no extra forward pass). α is clamped to [0, 1];
    a token sampled by the current policy (v_behav = v_θ) gets α = 0, i.e. π_prox = π_behav.

    Convention: a token of version −1 (prompt, padding: sampled by no policy, never trained) gets
    α = 0 too, i.e. its recorded behaviour log-prob (0 off the mask). Before, v = −1 entered the
    formula as a version and got a non-zero α; aligned with the rule that only generated tokens
    have a behaviour policy to interpolate from."""
    v = versions.to(logp.dtype)
    span = v_theta - v
    alpha = torch.where((span > 0) & (v >= 0), (v_prox - v) / span.clamp(min=1e-9), torch.zeros_like(v))
    alpha = alpha.clamp(0.0, 1.0)
    return (behav_logp + alpha * (logp.detach() - behav_logp)).detach()


def decoupled_ppo(
    logp: Tensor,
    prox_logp: Tensor,
    behav_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    w_max: float = 5.0,
    w_min: float | None = None,
    w_mode: str = "mask",
    offpolicy: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Decoupled PPO (AReaL): ℓ_t = w_t · PPO-clip(u_t, A), u = π_θ/π_prox, w = π_prox/π_behav (detached).

    The trust region is around π_prox, not the stale behaviour policy; w corrects for sampling
    from π_behav. Tokens with w outside [w_min, w_max] are dropped (``w_mode='mask'``) or their
    weight is clamped into the range (``'clamp'``). ``offpolicy`` (bool, optional) limits the
    correction to those tokens: the others (sampled by the current policy) get w = 1, so each
    token's term depends on that token alone, never on which other rows share its micro-batch.
    """
    weight, keep, w = decoupled_weights(prox_logp, behav_logp, offpolicy, w_max, w_min, w_mode)
    loss, m = ppo_clip(logp, prox_logp.detach(), adv, mask, clip_low, clip_high, dual_clip)
    n = mask.sum().clamp(min=1)
    metrics = {**m, "behav_weight_mean": (w * mask).sum() / n, "behav_masked_frac": ((1 - keep) * mask).sum() / n}
    return loss * weight, metrics


def decoupled_weights(prox_logp: Tensor, behav_logp: Tensor, offpolicy: Tensor | None = None, w_max: float = 5.0,
                      w_min: float | None = None, w_mode: str = "mask") -> tuple[Tensor, Tensor, Tensor]:
    """(weight, keep, w) of decoupled PPO: w = π_prox/π_behav (detached; 1 on tokens outside
    ``offpolicy`` when given), kept within [w_min, w_max] by masking or clamping."""
    w = torch.exp((prox_logp - behav_logp).clamp(-LOG_CLAMP, LOG_CLAMP)).detach()
    if offpolicy is not None:
        w = torch.where(offpolicy, w, torch.ones_like(w))
    lo = 0.0 if w_min is None else w_min
    if w_mode == "mask":
        keep = ((w <= w_max) & (w >= lo)).to(prox_logp.dtype)
        return w * keep, keep, w
    if w_mode == "clamp":
        return w.clamp(lo, w_max), torch.ones_like(w), w
    raise ValueError(f"w_mode must be 'mask' or 'clamp', got {w_mode!r}")


def tis_weights(
    old_logp: Tensor,
    behav_logp: Tensor,
    mask: Tensor,
    cap: float = 2.0,
    level: str = "token",
    mode: str = "truncate",
    normalize: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance sampling weights for the engine/trainer mismatch (detached).

    token:    w_t = min(π_old/π_behav, C) per token.
    sequence: w = min(exp(Σ_t log π_old/π_behav), C), the same for every token of a sequence.
    mode 'mask' rejects instead: weight 0 where the ratio exceeds C, else 1.
    ``normalize`` rescales the weights to mean 1 over the masked tokens.
    """
    log_ratio = (old_logp - behav_logp) * mask
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(old_logp)
    elif level != "token":
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    ratio = torch.exp(log_ratio.clamp(-LOG_CLAMP, LOG_CLAMP))
    if mode == "truncate":
        w = ratio.clamp(max=cap)
    elif mode == "mask":
        w = (ratio <= cap).to(old_logp.dtype)
    else:
        raise ValueError(f"mode must be 'truncate' or 'mask', got {mode!r}")
    w = w * mask
    n = mask.sum().clamp(min=1)
    if normalize:
        w = w / (w.sum() / n).clamp(min=1e-8)
    metrics = {"tis_weight_mean": w.sum() / n, "tis_capped_frac": ((ratio > cap).to(w.dtype) * mask).sum() / n}
    return w.detach(), metrics


def m2po(logp: Tensor, behav_logp: Tensor, adv: Tensor, mask: Tensor, tau: float = 0.04,
         keep: Tensor | None = None) -> tuple[Tensor, dict]:
    """M2PO (second-moment trust region): ℓ_t = −M_t · r_t · A_t with r = π_θ/π_behav, no ε-clip.

    M is ``m2po_mask`` over the tensors given, or ``keep`` when the caller computed it over a
    larger batch (the trainer does, over the whole optimiser batch, so the mask does not depend
    on the micro-batch split). Aggregate with the original mask (divide by all tokens).
    """
    log_r = (logp - behav_logp).clamp(-LOG_CLAMP, LOG_CLAMP)
    if keep is None:
        keep = m2po_mask(log_r.detach(), adv, mask, tau)
    sq = (log_r.detach() ** 2) * mask
    loss, _ = ppo_clip(logp, behav_logp, adv, mask, None, None, None)  # no trust region: -r·A
    nn = mask.sum().clamp(min=1)
    return loss * keep, {"m2po_masked_frac": (mask - keep).sum() / nn,
                         "m2po_m2": (sq * keep).sum() / keep.sum().clamp(min=1)}


@torch.no_grad()
def m2po_mask(log_r: Tensor, adv: Tensor, mask: Tensor, tau: float = 0.04) -> Tensor:
    """M2PO's token mask: among "trust-region" tokens (A > 0 and r > 1, or A < 0 and r < 1) the
    one with the largest (log r)² is masked, repeatedly, until the mean (log r)² over the
    remaining trained tokens is ≤ τ."""
    sq = (log_r ** 2) * mask
    valid = mask.bool()
    cand = valid & (((adv > 0) & (log_r > 0)) | ((adv < 0) & (log_r < 0)))
    n, total = mask.sum(), sq.sum()
    order = torch.argsort(sq[cand], descending=True)
    removed = torch.cat([sq.new_zeros(1), torch.cumsum(sq[cand][order], 0)])  # removing the k largest
    k = torch.arange(removed.numel(), dtype=sq.dtype)
    ok = (total - removed) <= tau * (n - k).clamp(min=1)
    n_drop = int(torch.nonzero(ok)[0]) if ok.any() else removed.numel() - 1
    keep = mask.clone()
    cand_idx = torch.nonzero(cand, as_tuple=False)[order[:n_drop]]
    keep[cand_idx[:, 0], cand_idx[:, 1]] = 0
    return keep


def ess_lr_scale(seq_log_w: Tensor, rho_base: float = 1.0) -> tuple[Tensor, Tensor]:
    """Step-size scale from the effective sample size of sequence IS weights (VCPO, "Stable Asynchrony").

    ESS = (Σw)²/Σw², ρ = ESS/B, scale = sqrt(min(1, ρ/ρ_base)); computed in log space.
    Returns (scale, ess); multiply the learning rate by ``scale`` for this step only.
    """
    lse1 = torch.logsumexp(seq_log_w, 0)
    lse2 = torch.logsumexp(2 * seq_log_w, 0)
    ess = torch.exp(2 * lse1 - lse2)
    rho = ess / seq_log_w.numel()
    return torch.sqrt(torch.clamp(rho / rho_base, max=1.0)), ess


# -- corrections as compositions -------------------------------------------------------------------


@dataclass(frozen=True)
class Knobs:
    """The corrections' settings (plain numbers: algo.tis_cap, algo.tis_level, algo.m2po_tau)."""

    tis_cap: float = 2.0
    tis_level: str = "token"
    m2po_tau: float = 0.04
    w_max: float = 5.0


@dataclass(frozen=True)
class Correction:
    """``apply(old, behav, adv, mask, stale, keep, knobs) -> (anchor_logp, weight or None, trust_region)``:
    the loss's ratio is π_θ/π_anchor, its per-token value is multiplied by ``weight`` (detached),
    and ``trust_region=False`` removes the loss's ε-clip (both bounds None, no dual clip).
    ``stale``: bool [B, T], tokens sampled by an older policy than the trainer's (None when the
    caller has no versions). ``batch_mask(log_r, adv, mask, knobs) -> keep``, when set, is computed
    once over the whole optimiser batch from π_old (recomputed first) and passed as ``keep``."""

    apply: Callable
    batch_mask: Callable | None = None


def _none(old, behav, adv, mask, stale, keep, k: Knobs):
    """No correction: PPO's ratio against π_old; stale tokens are trained as if fresh."""
    return old, None, True


def _decoupled(old, behav, adv, mask, stale, keep, k: Knobs):
    """Decoupled PPO: trust region around π_prox = π_old, weight π_prox/π_behav ≤ w_max on stale tokens."""
    if stale is None:
        return old, None, True
    return old, decoupled_weights(old, behav, stale, k.w_max)[0], True


def _tis(old, behav, adv, mask, stale, keep, k: Knobs):
    """TIS: weight min(π_old/π_behav, C) on every token (engine/trainer mismatch too)."""
    return old, tis_weights(old, behav, mask, k.tis_cap, k.tis_level)[0], True


def _m2po(old, behav, adv, mask, stale, keep, k: Knobs):
    """M2PO: ratio against π_behav with no ε-clip, the second-moment mask as the weight."""
    if keep is None:
        keep = m2po_mask((old - behav) * mask, adv, mask, k.m2po_tau)
    return behav, keep, False


def _m2po_batch_mask(log_r, adv, mask, k: Knobs):
    return m2po_mask(log_r, adv, mask, k.m2po_tau)


CORRECTIONS = {
    "none": Correction(_none),
    "decoupled": Correction(_decoupled),
    "tis": Correction(_tis),
    "m2po": Correction(_m2po, batch_mask=_m2po_batch_mask),
}
