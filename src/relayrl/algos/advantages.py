"""Outcome-reward advantage estimators: pure functions of per-response rewards and group ids.

``rewards``: float tensor [N]; ``group``: long tensor [N] of group indices 0..K-1.
Returns a float tensor [N] (broadcast over response tokens by the caller).
Formulas: ../shared/spec/algorithms.md §1 (verl ``core_algos.py`` conventions).
"""

from __future__ import annotations

import torch
from torch import Tensor

EPS = 1e-6


def group_stats(rewards: Tensor, group: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-response group size, mean and Bessel-corrected std (std of a group of 1 is 1)."""
    k = int(group.max()) + 1 if group.numel() else 0
    r = rewards.double()
    count = torch.zeros(k, dtype=torch.float64).index_add_(0, group, torch.ones_like(r))
    mean = torch.zeros(k, dtype=torch.float64).index_add_(0, group, r) / count
    sq = torch.zeros(k, dtype=torch.float64).index_add_(0, group, (r - mean[group]) ** 2)
    std = torch.where(count > 1, (sq / (count - 1).clamp(min=1)).sqrt(), torch.ones_like(count))
    return count[group], mean[group], std[group]


def grpo(rewards: Tensor, group: Tensor) -> Tensor:
    """(R - mean_g) / (std_g + eps). A group of one has mean 0 and std 1, so A = R."""
    n, mean, std = group_stats(rewards, group)
    mean = torch.where(n > 1, mean, torch.zeros_like(mean))
    return ((rewards.double() - mean) / (std + EPS)).to(rewards.dtype)


def dr_grpo(rewards: Tensor, group: Tensor) -> Tensor:
    """R - mean_g, no std scaling (Dr. GRPO). Pair with agg='seq_mean_token_sum_norm'."""
    n, mean, _ = group_stats(rewards, group)
    mean = torch.where(n > 1, mean, torch.zeros_like(mean))
    return (rewards.double() - mean).to(rewards.dtype)


def rloo(rewards: Tensor, group: Tensor) -> Tensor:
    """Leave-one-out baseline: R_i - mean_{j != i} R_j = G/(G-1) (R_i - mean_g). A group of one: A = R."""
    n, mean, _ = group_stats(rewards, group)
    scale = torch.where(n > 1, n / (n - 1).clamp(min=1), torch.ones_like(n))
    mean = torch.where(n > 1, mean, torch.zeros_like(mean))
    return (scale * (rewards.double() - mean)).to(rewards.dtype)


ADVANTAGES = {"grpo": grpo, "dr_grpo": dr_grpo, "rloo": rloo}
