"""Reward shaping before the advantages: DAPO's overlong handling and the KL folded into the
reward (PPO's in-reward KL). Pure tensor functions; algorithms.md §4 (soft overlong punishment)
and §2 (KL to a reference policy)."""

from __future__ import annotations

import torch
from torch import Tensor

from relayrl.algos.losses import kl_penalty


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int) -> Tensor:
    """DAPO's soft overlong punishment per response, added to its reward: 0 for |y| ≤ L_max − L_c,
    ((L_max − L_c) − |y|)/L_c inside the last L_c tokens of the budget (−1 at L_max), −1 beyond.
    ``lengths``: [B] response lengths; ``max_len`` L_max; ``buffer`` L_c (1 ≤ L_c ≤ L_max)."""
    lengths = lengths.to(torch.float32)
    inside = ((max_len - buffer) - lengths) / buffer
    return torch.where(lengths > max_len, torch.full_like(lengths, -1.0), inside.clamp(-1.0, 0.0))


def fold_kl(rewards: Tensor, old_logp: Tensor, ref_logp: Tensor, mask: Tensor, coef: float,
            estimator: str = "k1") -> tuple[Tensor, dict[str, Tensor]]:
    """r_t − β·KL_t on every trained token (PPO's in-reward KL, verl's ``apply_kl_penalty``), the KL
    estimated from π_old (the policy at the start of the step) against π_ref; detached: it is a
    reward, not a loss. Returns the shaped rewards and ``kl_reward`` (the mean KL per trained token)."""
    kl = kl_penalty(old_logp, ref_logp, estimator).detach() * mask
    n = mask.sum().clamp(min=1)
    return rewards - coef * kl, {"kl_reward": kl.sum() / n}
