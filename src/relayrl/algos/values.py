"""Token-level returns, GAE, whitening, explained variance and the clipped value loss: pure tensor
functions over [B, T] tensors aligned with the response tokens (algorithms.md §1 "gae", §2 "value loss").

``rewards`` holds the token-level rewards: the outcome reward on a response's last trained token,
an agent's step rewards on each turn's last trained token, and (with ``algo.kl_mode=reward``)
−β·KL on every trained token. ``mask`` is 1 on trained tokens; a masked token (tool results,
template tokens between turns, padding, the prompt) is not a step: it passes the running return,
the next value and the running advantage through unchanged, and a reward placed on it is ignored
(the batch builder puts rewards on trained tokens only).
"""

from __future__ import annotations

import torch
from torch import Tensor

WHITEN_EPS = 1e-8


def token_returns(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """G_t = r_t + γ·G_{t+1} over the trained tokens of each row (0 past the end), 0 off the mask."""
    out = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        on = mask[:, t] > 0
        running = torch.where(on, rewards[:, t] + gamma * running, running)
        out[:, t] = torch.where(on, running, torch.zeros_like(running))
    return out


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 1.0) -> tuple[Tensor, Tensor]:
    """(advantages, returns): δ_t = r_t + γV_{t+1} − V_t, A_t = δ_t + γλA_{t+1}, backwards over the
    trained tokens, V = 0 past the end; returns = A + V (the value targets). Not whitened."""
    adv = torch.zeros_like(rewards)
    last = rewards.new_zeros(rewards.shape[0])
    next_v = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        on = mask[:, t] > 0
        cur = rewards[:, t] + gamma * next_v - values[:, t] + gamma * lam * last
        last = torch.where(on, cur, last)
        next_v = torch.where(on, values[:, t], next_v)
        adv[:, t] = torch.where(on, cur, torch.zeros_like(cur))
    return adv, (adv + values) * mask


def masked_whiten(x: Tensor, mask: Tensor) -> Tensor:
    """(x − μ)/sqrt(σ² + 1e-8) over the masked entries (σ² with Bessel's correction), 0 off the mask.
    Fewer than two entries have no variance: all zeros then (algorithms.md says "error"; but a batch
    whose responses ``algo.overlong=filter`` all took out has nothing to train, and stopping the run
    for it would be wrong: its step changes nothing)."""
    n = mask.sum()
    if int(n) < 2:
        return x * 0
    mean = (x * mask).sum() / n
    var = (((x - mean) * mask) ** 2).sum() / (n - 1)
    return (x - mean) * torch.rsqrt(var + WHITEN_EPS) * mask


def explained_variance(returns: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """EV = 1 − Var(R − V)/Var(R) over the masked entries; 0 where the returns do not vary
    (nothing to explain: EVPO then takes the mean baseline, as EV > 0 is its rule)."""
    n = mask.sum().clamp(min=1)

    def var(x: Tensor) -> Tensor:
        mean = (x * mask).sum() / n
        return (((x - mean) * mask) ** 2).sum() / n

    v_r = var(returns)
    return torch.where(v_r > 0, 1 - var(returns - values) / v_r.clamp(min=1e-30), torch.zeros_like(v_r))


def group_token_mean(x: Tensor, mask: Tensor, group: Tensor) -> Tensor:
    """Per row, the mean of ``x`` over the masked entries of all rows of its group: [B, 1]."""
    k = int(group.max()) + 1 if group.numel() else 0
    sums = x.new_zeros(k).index_add_(0, group, (x * mask).sum(-1))
    counts = x.new_zeros(k).index_add_(0, group, mask.sum(-1))
    return (sums / counts.clamp(min=1))[group].unsqueeze(-1)


def group_explained_variance(returns: Tensor, values: Tensor, mask: Tensor, group: Tensor) -> Tensor:
    """EV per group (over its rows' masked entries), [K]; 0 for a group whose returns do not vary."""
    k = int(group.max()) + 1 if group.numel() else 0

    def var(x: Tensor) -> Tensor:
        dev = (x - group_token_mean(x, mask, group)) * mask
        counts = x.new_zeros(k).index_add_(0, group, mask.sum(-1)).clamp(min=1)
        return x.new_zeros(k).index_add_(0, group, (dev ** 2).sum(-1)) / counts

    v_r = var(returns)
    return torch.where(v_r > 0, 1 - var(returns - values) / v_r.clamp(min=1e-30), torch.zeros_like(v_r))


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
               clip: float | None = 0.5) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss per token: ½·max((V − R)², (clip(V, V_old ± ε) − R)²) (PPO's; ε = ``clip``,
    None: unclipped ½(V − R)²). ``clip_frac``: the share of masked tokens where the clipped term wins."""
    unclipped = (values - returns) ** 2
    if clip is None:
        return 0.5 * unclipped, {"clip_frac": (unclipped * 0 * mask).sum()}
    clipped_v = old_values + (values - old_values).clamp(-clip, clip)
    clipped = (clipped_v - returns) ** 2
    n = mask.sum().clamp(min=1)
    return 0.5 * torch.maximum(unclipped, clipped), {"clip_frac": ((clipped > unclipped).float() * mask).sum() / n}
