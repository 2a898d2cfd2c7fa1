"""Step-level credit for agents: pure functions of per-step rewards, episode and group ids.

An episode is one trajectory of several steps (turns); a group is the set of episodes started
from the same task. Per-step tensors are indexed by step, per-episode tensors by episode;
``step_episode`` [S] maps each step to its episode, ``episode_group`` [E] each episode to its group.
Formulas: ../shared/spec/algorithms.md §1 (gigpo row); GiGPO is arXiv 2505.10978.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relayrl.algos.advantages import dr_grpo, group_stats, grpo

EPS = 1e-6


def discounted_returns(step_rewards: Tensor, step_episode: Tensor, gamma: float) -> Tensor:
    """R_t = Σ_{k≥t} γ^{k−t} r_k over the later steps k of the same episode (GiGPO Eq. 5).

    Steps of one episode are in order; steps of different episodes may interleave.
    ``step_rewards``: float [S]; ``step_episode``: long [S]. Returns float [S].
    """
    rewards, episodes = step_rewards.double().tolist(), step_episode.tolist()
    returns = [0.0] * len(rewards)
    running: dict[int, float] = {}
    for t in reversed(range(len(rewards))):
        # backwards recursion R_t = r_t + γ R_{t+1}, one running return per episode
        running[episodes[t]] = rewards[t] + gamma * running.get(episodes[t], 0.0)
        returns[t] = running[episodes[t]]
    return torch.tensor(returns, dtype=torch.float64).to(step_rewards.dtype)


def gigpo(
    episode_rewards: Tensor,
    episode_group: Tensor,
    step_returns: Tensor,
    step_episode: Tensor,
    anchor_ids: Tensor,
    omega: float = 1.0,
    normalize: str = "mean",
) -> Tensor:
    """GiGPO per-step advantage A = A^E + ω·A^S (arXiv 2505.10978, Eq. 8).

    A^E (Eq. 3): the episode reward normalised over the episodes of its group, R − mean_g R
    ("mean", the default) or (R − mean_g R)/(std_g R + 1e-6) ("std", as GRPO), one value per
    episode whatever its length; a group of one episode has mean 0 (and std 1), so A^E = R.
    A^S (Eqs. 6–7): the step return (see ``discounted_returns``, γ = 0.95 by default in the spec)
    normalised the same way within its step set: all steps of the same group whose anchor state
    (``anchor_ids``, an integer id per step, equal ids = identical observations) is equal, across
    the group's episodes (repeat visits within one episode included). A set of one step has A^S = 0.
    Groups may hold unequal numbers of episodes. Nothing here depends on which policy version
    generated an episode, so groups whose episodes span several versions are handled as any other.

    ``episode_rewards``: float [E]; ``episode_group``: long [E]; ``step_returns``: float [S];
    ``step_episode``, ``anchor_ids``: long [S]. Returns float [S].
    """
    if normalize not in ("mean", "std"):
        raise ValueError(f"unknown GiGPO normalisation {normalize!r}; valid: mean, std")
    episode_adv = (dr_grpo if normalize == "mean" else grpo)(episode_rewards, episode_group)
    # step sets: one per distinct (group, anchor state) pair
    keys = torch.stack([episode_group[step_episode], anchor_ids], dim=1)
    step_set = torch.unique(keys, dim=0, return_inverse=True)[1] if keys.numel() else anchor_ids
    _, mean, std = group_stats(step_returns, step_set)
    step_adv = step_returns.double() - mean  # exactly 0 for a set of one step
    if normalize == "std":
        step_adv = step_adv / (std + EPS)
    return (episode_adv.double()[step_episode] + omega * step_adv).to(step_returns.dtype)


def steps_to_tokens(step_adv: Tensor, token_step: Tensor) -> Tensor:
    """Per-token advantage A_token = A_step[token_step]; 0 where token_step = −1.

    ``step_adv``: float [S]; ``token_step``: long of any shape, the step each token belongs to,
    −1 for tokens outside any trained step (prompt, tool output, template, padding).
    """
    padded = torch.cat([step_adv, step_adv.new_zeros(1)])  # index −1 picks the appended 0
    return padded[token_step]


def rae(rewards: Tensor, keys: list[str], baselines: dict[str, float], alpha: float = 0.95) -> Tensor:
    """SPIRAL's role-conditioned advantage estimation (Liu et al. 2025, "SPIRAL: Self-Play on Zero-Sum Games
    Incentivizes Reasoning", RAE): one baseline per game and role, the exponential moving average of that
    role's rewards over the run, ``b ← α·b + (1 − α)·R`` with each episode in batch order (a new key starts
    at 0), then ``A = R − b``. No group, no normalisation: in a zero-sum game both roles' group means sit
    near the same value and the baseline must remember which side is favoured. ``baselines`` (the run's,
    checkpointed) is updated in place.

    ``rewards``: float [N]; ``keys``: N baseline keys (``game/role``). Returns float64 [N]."""
    out = torch.empty(len(keys), dtype=torch.float64)
    for i, (r, k) in enumerate(zip(rewards.double().tolist(), keys)):
        baselines[k] = alpha * baselines.get(k, 0.0) + (1 - alpha) * r
        out[i] = r - baselines[k]
    return out


# Step-level estimators (token-level advantages from the turns of episodes), by name, beside the
# episode-level ones in ``advantages.ADVANTAGES``; both are computed when the batch is built.
STEP_ADVANTAGES = {"gigpo": gigpo, "rae": rae}
