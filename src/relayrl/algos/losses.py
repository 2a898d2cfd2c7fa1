"""Per-token policy losses, KL estimators and loss aggregation: pure tensor functions.

Shapes: [B, T] over response tokens; ``mask`` is 1 on trained tokens, 0 elsewhere.
Every policy loss has the same signature,

    loss(logp, anchor_logp, adv, mask, clip_low, clip_high, dual_clip) -> (per_token_loss, metrics)

with the ratio r = π_θ/π_anchor taken against ``anchor_logp`` (π_old, or π_behav: the off-policy
correction chooses, ``offpolicy.CORRECTIONS``) and the trust region [1 − clip_low, 1 + clip_high]
(``None`` on a side: no bound there). So every loss combines with every correction, and the
correction's importance weight multiplies the per-token loss the loss returns.
Aggregation turns per-token loss into a scalar using *global* counts passed in, so the result is
the same whatever the micro-batch split (algorithms.md §3). Metrics are tensors; callers decide
when to synchronise.

Conventions (decided where relayrl and verl ``core_algos.py`` differ):
- ``clip_frac`` counts the tokens where the ε-clip binds; dual-clipped tokens (A < 0, r > c) are
  counted apart in ``clip_frac_dual`` (verl's ``pg_clipfrac`` / ``pg_clipfrac_lower``). Aligned
  with verl: the two say different things (a trust region doing its work, and tokens far off the
  policy whose loss is capped), and one number hid the second.
- The k3 KL is **not** clamped (verl clamps it to ±10): a clamp zeroes the KL gradient exactly on
  the tokens that drifted furthest from the reference. The log-ratio inside the exponential is
  clamped to ±20, which keeps it finite. Kept.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOG_CLAMP = 20.0


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum()


def _ratio(logp: Tensor, anchor_logp: Tensor) -> Tensor:
    return torch.exp((logp - anchor_logp).clamp(-LOG_CLAMP, LOG_CLAMP))


def clip_ratio(ratio: Tensor, clip_low: float | None, clip_high: float | None) -> Tensor:
    """clip(r, 1 − ε_low, 1 + ε_high); a ``None`` bound is no bound on that side."""
    lo = None if clip_low is None else 1.0 - clip_low
    hi = None if clip_high is None else 1.0 + clip_high
    return ratio if lo is None and hi is None else ratio.clamp(min=lo, max=hi)


def _clip_metrics(ratio: Tensor, clipped: Tensor, mask: Tensor, dual: Tensor | None = None) -> dict[str, Tensor]:
    n = mask.sum().clamp(min=1)
    out = {"clip_frac": masked_sum(clipped.float(), mask) / n, "ratio_mean": masked_sum(ratio.detach(), mask) / n}
    out["clip_frac_dual"] = masked_sum(dual.float(), mask) / n if dual is not None else out["clip_frac"] * 0
    return out


def ppo_clip(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    clip_low: float | None = 0.2,
    clip_high: float | None = 0.2,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with separate ε_low/ε_high and optional dual clip (c > 1, for A < 0).

    ℓ = max(-r·A, -clip(r, 1-ε_low, 1+ε_high)·A); if A < 0: ℓ = min(ℓ, -c·A).
    """
    ratio = _ratio(logp, old_logp)
    unclipped = -ratio * adv
    clipped = -clip_ratio(ratio, clip_low, clip_high) * adv
    loss = torch.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    dual = None
    if dual_clip is not None:
        lower = -dual_clip * adv
        dual = (adv < 0) & (loss > lower)
        loss = torch.where(dual, lower, loss)
    return loss, _clip_metrics(ratio, is_clipped, mask, dual)


SEQ_LOG_CLAMP = 10.0  # GSPO's bound on log s (verl's compute_policy_loss_gspo)


def _seq_log_ratio(logp: Tensor, anchor_logp: Tensor, mask: Tensor) -> Tensor:
    """log s_i = (1/|y_i|) Σ_t log r_t over the sequence's trained tokens (GSPO), not yet clamped."""
    return ((logp - anchor_logp) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)


def gspo(logp: Tensor, anchor_logp: Tensor, adv: Tensor, mask: Tensor, clip_low: float | None = 3e-4,
         clip_high: float | None = 4e-4, dual_clip: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (sequence level): s_i = exp(mean_t log r_t), A_i = the token mean of the sequence's
    advantages, ℓ_i = max(-s_i·A_i, -clip(s_i)·A_i), given to each of its tokens (aggregate with
    seq_mean_token_mean for the paper's mean over sequences). ``dual_clip`` is not part of GSPO."""
    s = torch.exp(_seq_log_ratio(logp, anchor_logp, mask).clamp(max=SEQ_LOG_CLAMP))
    a = (adv * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    unclipped, clipped = -s * a, -clip_ratio(s, clip_low, clip_high) * a
    loss = torch.maximum(unclipped, clipped).expand_as(logp)
    return loss, _clip_metrics(s.expand_as(logp), (clipped > unclipped).expand_as(logp), mask)


def gspo_token(logp: Tensor, anchor_logp: Tensor, adv: Tensor, mask: Tensor, clip_low: float | None = 3e-4,
               clip_high: float | None = 4e-4, dual_clip: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO-token, for per-token advantages: s_{i,t} = sg[s_i]·π_θ(y_t)/sg[π_θ(y_t)] (the value of
    s_i, the gradient of one token), ℓ = max(-s·A_t, -clip(s)·A_t). With an advantage constant
    over each sequence and seq_mean_token_mean it equals ``gspo`` in value and gradient, under the
    clamp log s ≤ 10 too: the clamp is taken on log s_{i,t} = sg[log s_i] + log π_θ(y_t) − sg[log π_θ(y_t)]
    (verl's compute_policy_loss_gspo), so where it binds the token has no gradient, as in ``gspo``.
    (Clamping sg[log s_i] alone would leave the gradient e^10·∇log π_θ on every token of such a row.)"""
    log_s = _seq_log_ratio(logp, anchor_logp, mask).detach() + logp - logp.detach()
    s = torch.exp(log_s.clamp(max=SEQ_LOG_CLAMP))
    unclipped, clipped = -s * adv, -clip_ratio(s, clip_low, clip_high) * adv
    return torch.maximum(unclipped, clipped), _clip_metrics(s, clipped > unclipped, mask)


def cispo(logp: Tensor, anchor_logp: Tensor, adv: Tensor, mask: Tensor, clip_low: float | None = None,
          clip_high: float | None = 0.28, dual_clip: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1): ℓ = -sg(clip(r, 1-ε_low, 1+ε_high))·A·log π_θ: the importance weight is
    clipped and detached, so every token keeps its gradient A·∇log π (scaled), none is dropped.
    The paper sets no lower bound (``clip_low=None``). ``dual_clip`` is not part of CISPO."""
    ratio = _ratio(logp, anchor_logp).detach()
    w = clip_ratio(ratio, clip_low, clip_high)
    return -w * adv * logp, _clip_metrics(ratio, w != ratio, mask)


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token KL(π_θ || π_ref) estimate from sampled-token log-probs (Schulman's k1/k2/k3).
    k3 is not clamped (see the module's conventions); its log-ratio is, to ±20."""
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        d = (ref_logp - logp).clamp(-LOG_CLAMP, LOG_CLAMP)
        return torch.exp(d) - d - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}; valid: k1, k2, k3")


def token_mean(loss: Tensor, mask: Tensor, num_tokens: float, num_seqs: float, norm_len: float) -> Tensor:
    """Σ ℓ over all trained tokens of the optimiser batch / their count (DAPO)."""
    return masked_sum(loss, mask) / max(num_tokens, 1.0)


def seq_mean_token_mean(loss: Tensor, mask: Tensor, num_tokens: float, num_seqs: float, norm_len: float) -> Tensor:
    """Mean over sequences of each sequence's token mean (original GRPO, GSPO). ``num_seqs`` counts
    the sequences with at least one trained token (see ``count_seqs``)."""
    per_seq = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_seq.sum() / max(num_seqs, 1.0)


def seq_mean_token_sum_norm(
    loss: Tensor, mask: Tensor, num_tokens: float, num_seqs: float, norm_len: float
) -> Tensor:
    """Σ ℓ / (num_seqs · L_const): a constant divisor, no length bias (Dr. GRPO)."""
    return masked_sum(loss, mask) / (max(num_seqs, 1.0) * norm_len)


def count_seqs(mask: Tensor) -> Tensor:
    """The ``num_seqs`` of the sequence-mean aggregations: rows with at least one trained token.
    Convention (aligned with verl, which skips them): a fully masked row (a truncated response
    under ``algo.overlong=filter``) does not count, so leaving responses out of the loss does not
    shrink the others' weight."""
    return (mask.sum(-1) > 0).sum()


POLICY_LOSSES = {"ppo_clip": ppo_clip, "gspo": gspo, "gspo_token": gspo_token, "cispo": cispo}
# each loss's trust region (ε_low, ε_high) when algo.clip_low / algo.clip_high are not set (None: no bound)
CLIP_DEFAULTS = {"ppo_clip": (0.2, 0.28), "gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4), "cispo": (None, 0.28)}
# the losses that take algo.dual_clip
DUAL_CLIP_LOSSES = ("ppo_clip",)
AGGREGATIONS = {
    "token_mean": token_mean,
    "seq_mean_token_mean": seq_mean_token_mean,
    "seq_mean_token_sum_norm": seq_mean_token_sum_norm,
}
