"""Advantage estimators at training time, one signature for all, chosen by name (``ESTIMATORS``):

    estimator(rewards, mask, group, values, knobs) -> (advantages, returns or None, metrics)

``rewards``: token-level rewards [B, T] (``values.py`` says where they sit); ``mask``: trained
tokens; ``group``: long [B], each row's group (the responses to one prompt); ``values``: the
critic's V_t [B, T] for the estimators in ``NEEDS_CRITIC`` (None for the others); ``knobs``:
plain numbers (γ, λ, EVPO's level). ``returns`` are the critic's value targets (None without a
critic). Metrics are tensors. Formulas: algorithms.md §1.

The outcome estimators of ``advantages.py`` (grpo, dr_grpo, rloo) take each response's reward
R = Σ_t r_t (the outcome reward, plus the folded KL when ``algo.kl_mode=reward``, as verl sums
``token_level_rewards``) and broadcast their advantage to its trained tokens. R sums the row's
rewards, not only those on ``mask``: the batch puts rewards on trained tokens only, and a response
``algo.overlong=filter`` took out of the loss (no trained token) keeps its reward, so it counts in
its group's baseline (DAPO; TRL's ``mask_truncated_completions``) while its advantage, broadcast to
no token, trains nothing. GiGPO (agents'
step credit) is computed from the episodes' turns when the batch is built (``rollout.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from relayrl.algos.advantages import dr_grpo, grpo, rloo
from relayrl.algos.values import (explained_variance, gae, group_explained_variance, group_token_mean,
                                  masked_whiten, token_returns)


@dataclass(frozen=True)
class Knobs:
    """algo.gamma (resolved), algo.lam, algo.evpo_level, rollout.group_size: plain numbers and names,
    no config object. ``group_size`` tells a group of one by choice (1) from one whose others failed."""

    gamma: float = 1.0
    lam: float = 1.0
    evpo_level: str = "batch"
    group_size: int = 8


def lone(group: Tensor, k: Knobs) -> Tensor:
    """[B] bool: the rows alone in their group although ``rollout.group_size`` asked for several, the
    others left out as failed (``relayrl.failures``). One response has no baseline to compare with, and
    the estimators' single-sample rule (mean 0, std 1: A = R, verl's convention, algorithms.md §1) would
    train the survivor on its raw reward, unlike every other row of the batch: it gets A = 0 instead (a
    departure from the spec, decided for failures). With ``group_size=1`` chosen, none is: every row is
    alone by design and keeps the single-sample rule."""
    if k.group_size == 1 or not group.numel():
        return torch.zeros(group.shape, dtype=torch.bool)
    return torch.bincount(group)[group] == 1


def outcome(rewards: Tensor) -> Tensor:
    """Each response's reward R = Σ_t r_t [B], over all its tokens: a response left out of the loss
    (``algo.overlong=filter``, its mask all 0) keeps its reward for its group's baseline."""
    return rewards.sum(-1)


def per_response(fn):
    """An outcome estimator ``fn(R [B], group [B]) -> A [B]`` as a token-level one."""

    def estimator(rewards: Tensor, mask: Tensor, group: Tensor, values, k: Knobs):
        adv = fn(outcome(rewards), group)
        adv = torch.where(lone(group, k), torch.zeros_like(adv), adv)
        return adv.unsqueeze(-1) * mask, None, {}

    estimator.__doc__ = (f"{fn.__name__} over R = Σ_t r_t, broadcast to the response's trained tokens; 0 for a "
                         "row left alone in its group by failures (``lone``).")
    return estimator


def reinforce_pp(rewards: Tensor, mask: Tensor, group: Tensor, values, k: Knobs):
    """REINFORCE++: token returns G_t = Σ_{k≥t} γ^{k−t} r_k, whitened over the batch's trained tokens."""
    return masked_whiten(token_returns(rewards, mask, k.gamma), mask), None, {}


def reinforce_pp_baseline(rewards: Tensor, mask: Tensor, group: Tensor, values, k: Knobs):
    """REINFORCE++-baseline: R − mean_g R per response (a group of one by ``group_size=1``: R), broadcast,
    then whitened over the batch's trained tokens. A row left alone by failures (``lone``) gets 0 and
    takes no part in the whitening (counted as 0 there, it would shift every other row's advantage)."""
    adv = dr_grpo(outcome(rewards), group)
    mask = mask * (~lone(group, k)).to(mask.dtype).unsqueeze(-1)
    return masked_whiten(adv.unsqueeze(-1) * mask, mask), None, {}


def gae_estimator(rewards: Tensor, mask: Tensor, group: Tensor, values: Tensor, k: Knobs):
    """PPO's GAE(γ, λ) with the critic's values, whitened over the batch; returns = A + V (unwhitened A)."""
    adv, returns = gae(rewards, values, mask, k.gamma, k.lam)
    ev = explained_variance(token_returns(rewards, mask, k.gamma), values, mask)
    return masked_whiten(adv, mask), returns, {"critic/ev": ev}


def evpo(rewards: Tensor, mask: Tensor, group: Tensor, values: Tensor, k: Knobs):
    """EVPO: EV = 1 − Var(G − V)/Var(G) over the batch's trained tokens (G: the token returns); EV > 0
    takes the critic's GAE advantages, else the batch-mean baseline G − mean(G). ``evpo_level='group'``
    decides per group instead (EV over the group's tokens, baseline its mean). Either is whitened over
    the batch as gae is, so the step's scale does not jump when the choice flips: the mean branch is
    then REINFORCE++'s. The critic is trained on the GAE returns whichever branch is taken.
    Logs ``evpo/ev`` (the batch's EV) and ``evpo/use_critic`` (1/0; per group: the share of groups)."""
    g = token_returns(rewards, mask, k.gamma)
    critic_adv, returns = gae(rewards, values, mask, k.gamma, k.lam)
    ev = explained_variance(g, values, mask)
    if k.evpo_level == "group":
        use = group_explained_variance(g, values, mask, group) > 0
        baseline, pick = group_token_mean(g, mask, group), use[group].unsqueeze(-1)
    else:
        use = ev > 0
        baseline, pick = ((g * mask).sum() / mask.sum().clamp(min=1)), use
    adv = torch.where(pick, critic_adv, (g - baseline) * mask)
    return masked_whiten(adv, mask), returns, {"evpo/ev": ev, "evpo/use_critic": use.float().mean(), "critic/ev": ev}


def over_episodes(estimator, rewards: Tensor, mask: Tensor, group: Tensor, owner: Tensor, k: Knobs):
    """A group-baseline estimator over episodes only (rows that are their own ``owner``); a row that is
    an agent episode's extra branch takes its episode's advantage (the value on the episode's trained
    tokens) on its own trained tokens, so the baseline counts each episode once, whatever its branches."""
    ep = torch.nonzero(owner == torch.arange(len(owner))).flatten()
    adv, _, m = estimator(rewards[ep], mask[ep], group[ep], None, k)
    per_episode = (adv * mask[ep]).sum(-1) / mask[ep].sum(-1).clamp(min=1)
    row_of = torch.zeros(len(owner), dtype=torch.long)
    row_of[ep] = torch.arange(len(ep))
    return per_episode[row_of[owner]].unsqueeze(-1) * mask, None, m


ESTIMATORS = {
    "grpo": per_response(grpo),
    "dr_grpo": per_response(dr_grpo),
    "rloo": per_response(rloo),
    "reinforce_pp": reinforce_pp,
    "reinforce_pp_baseline": reinforce_pp_baseline,
    "gae": gae_estimator,
    "evpo": evpo,
}
# estimators that need values: these runs train a critic (critic.py) beside the policy
NEEDS_CRITIC = ("gae", "evpo")
# estimators whose baseline is over a group's responses: taken over episodes (``over_episodes``); the others
# treat an agent episode's extra branch as a trajectory of its own, with the episode's reward
GROUP_BASELINE = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")
