"""Per-token policy losses, KL estimators and loss aggregation: pure tensor functions.

Shapes: [B, T] over response tokens; ``mask`` is 1 on trained tokens, 0 elsewhere.
Losses return ``(per_token_loss, metrics)``; aggregation turns per-token loss into a scalar
using *global* counts passed in, so the result is the same whatever the micro-batch split
(algorithms.md §3). Metrics are tensors; callers decide when to synchronise.
"""

from __future__ import annotations

import torch
from torch import Tensor


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum()


def ppo_clip(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with separate ε_low/ε_high and optional dual clip (c > 1, for A < 0).

    ℓ = max(-r·A, -clip(r, 1-ε_low, 1+ε_high)·A); if A < 0: ℓ = min(ℓ, -c·A).
    """
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -ratio * adv
    clipped = -ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    loss = torch.maximum(unclipped, clipped)
    is_clipped = (clipped > unclipped).float()
    if dual_clip is not None:
        lower = -dual_clip * adv
        dual = (adv < 0) & (loss > lower)
        loss = torch.where(adv < 0, torch.minimum(loss, lower), loss)
        is_clipped = torch.where(dual, torch.ones_like(is_clipped), is_clipped)
    n = mask.sum().clamp(min=1)
    metrics = {
        "clip_frac": masked_sum(is_clipped, mask) / n,
        "ratio_mean": masked_sum(ratio.detach(), mask) / n,
    }
    return loss, metrics


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token KL(π_θ || π_ref) estimate from sampled-token log-probs (Schulman's k1/k2/k3)."""
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        d = (ref_logp - logp).clamp(-20.0, 20.0)
        return torch.exp(d) - d - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}; valid: k1, k2, k3")


def token_mean(loss: Tensor, mask: Tensor, num_tokens: float, num_seqs: float, norm_len: float) -> Tensor:
    """Σ ℓ over all trained tokens of the optimiser batch / their count (DAPO)."""
    return masked_sum(loss, mask) / max(num_tokens, 1.0)


def seq_mean_token_mean(loss: Tensor, mask: Tensor, num_tokens: float, num_seqs: float, norm_len: float) -> Tensor:
    """Mean over sequences of each sequence's token mean (original GRPO, GSPO)."""
    per_seq = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_seq.sum() / max(num_seqs, 1.0)


def seq_mean_token_sum_norm(
    loss: Tensor, mask: Tensor, num_tokens: float, num_seqs: float, norm_len: float
) -> Tensor:
    """Σ ℓ / (num_seqs · L_const): a constant divisor, no length bias (Dr. GRPO)."""
    return masked_sum(loss, mask) / (max(num_seqs, 1.0) * norm_len)


POLICY_LOSSES = {"ppo_clip": ppo_clip}
AGGREGATIONS = {
    "token_mean": token_mean,
    "seq_mean_token_mean": seq_mean_token_mean,
    "seq_mean_token_sum_norm": seq_mean_token_sum_norm,
}
