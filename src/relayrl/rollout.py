"""Groups of trajectories before and after their episodes: empty groups for prompts, failed
responses dropped, and the advantages. Pure helpers; the rollout driver and the loop call them."""

from __future__ import annotations

import torch

from relayrl.algos import ADVANTAGES, STEP_ADVANTAGES, lookup
from relayrl.algos.agents import discounted_returns, gigpo, steps_to_tokens
from relayrl.failures import failed
from relayrl.models import encode_prompt
from relayrl.records import Group, Prompt, Trajectory


def make_groups(prompts: list[Prompt], tokenizer, group_size: int, tag: str, prompt_format: str = "chat"
                ) -> list[Group]:
    """G empty trajectories per prompt; ``tag`` makes request ids unique across calls, the index
    within a call (a prompt may come twice when a call spans an epoch boundary)."""
    groups = []
    for k, p in enumerate(prompts):
        ids = encode_prompt(tokenizer, p.messages, prompt_format)
        gid = f"{tag}.{k}/{p.id}"
        groups.append(Group(p, gid, [Trajectory(p, gid, i, ids) for i in range(group_size)]))
    return groups


def drop_failed(groups: list[Group]) -> tuple[list[Group], int]:
    """Episodes that failed (the engine, or user code: ``relayrl.failures``) are not trained: not the
    policy's answer, or not scored. A group keeps its other members, its advantages computed over
    them; a group left with none is dropped. Returns (groups, episodes dropped)."""
    out, dropped = [], 0
    for g in groups:
        ok = [t for t in g.trajectories if not failed(t)]
        dropped += len(g.trajectories) - len(ok)
        if ok:
            out.append(g if len(ok) == len(g.trajectories) else Group(g.prompt, g.group_id, ok))
    return out, dropped


def advantages_for(groups: list[Group], algo) -> torch.Tensor | list[torch.Tensor]:
    """Advantages for ``[t for g in groups for t in g.trajectories]``: one per trajectory, or with
    a step-level estimator (``algo.advantage=gigpo``) one per response token."""
    if algo.advantage in STEP_ADVANTAGES:
        return step_advantages(groups, algo.gamma, algo.gigpo_omega)
    return group_advantages(groups, algo.advantage)


def step_advantages(groups: list[Group], gamma: float, omega: float) -> list[torch.Tensor]:
    """GiGPO over the turns of episodes: per-step rewards (``info["step_rewards"]``, the last
    one the episode's final reward) discounted by γ within the episode, anchor states
    (``info["anchors"]``, the observation each turn started from) shared across a group's episodes
    whatever policy version generated them; each token gets its turn's advantage."""
    trajs = [t for g in groups for t in g.trajectories]
    step_rewards, step_episode, anchors, episode_group = [], [], [], []
    for e, (gi, t) in enumerate((gi, t) for gi, g in enumerate(groups) for t in g.trajectories):
        rewards = t.info.get("step_rewards") or [t.reward]
        step_rewards += rewards
        step_episode += [e] * len(rewards)
        seen = t.info.get("anchors") or []
        anchors += [seen[k] if k < len(seen) else 0 for k in range(len(rewards))]
        episode_group.append(gi)
    ep = torch.tensor(step_episode, dtype=torch.long)
    returns = discounted_returns(torch.tensor(step_rewards, dtype=torch.float64), ep, gamma)
    adv = gigpo(torch.tensor([t.reward for t in trajs], dtype=torch.float64), torch.tensor(episode_group),
                returns, ep, torch.tensor(anchors, dtype=torch.long), omega)
    out, first = [], 0
    for e, t in enumerate(trajs):
        n = int((ep == e).sum())
        turns = torch.tensor(t.turns if t.turns else [0] * len(t.response_ids), dtype=torch.long).clamp(max=n - 1)
        out.append(steps_to_tokens(adv[first:first + n].float(), turns))
        first += n
    return out


def group_advantages(groups: list[Group], estimator: str) -> torch.Tensor:
    """Advantages for ``[t for g in groups for t in g.trajectories]``, in that order. The baseline is
    over episodes: an agent episode's extra branches (``info["branch_of"]``) take its advantage."""
    fn = lookup(ADVANTAGES, estimator, "advantage estimator")
    flat = [(i, t) for i, g in enumerate(groups) for t in g.trajectories]
    episodes = {(i, t.sample_idx): k for k, (i, t) in enumerate(flat) if "branch_of" not in t.info}
    owner = [episodes.get((i, t.info["branch_of"]), k) if "branch_of" in t.info else k for k, (i, t) in enumerate(flat)]
    own = sorted(set(owner))
    rewards = torch.tensor([flat[k][1].reward for k in own], dtype=torch.float32)
    gid = torch.tensor([flat[k][0] for k in own], dtype=torch.long)
    adv = fn(rewards, gid)
    at = {k: j for j, k in enumerate(own)}
    return adv[torch.tensor([at[k] for k in owner], dtype=torch.long)]
