"""Groups of trajectories before and after their episodes: empty groups for prompts, failed
responses dropped, and the training batch (token-level rewards, overlong handling, step credit).
Pure helpers; the rollout driver and the loop call them."""

from __future__ import annotations

import torch

from relayrl.algos import STEP_ADVANTAGES
from relayrl.algos.agents import discounted_returns, gigpo, steps_to_tokens
from relayrl.algos.shaping import overlong_penalty
from relayrl.train.batch import TrainBatch, build_batch
from relayrl.failures import failed
from relayrl.models import encode_prompt
from relayrl.records import FinishReason, Group, Prompt, Trajectory


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


def training_batch(groups: list[Group], algo, budget: int, pad_id: int) -> tuple[TrainBatch, dict]:
    """The batch of ``[t for g in groups for t in g.trajectories]`` and its shaping metrics. Token-level
    rewards (``token_rewards``) and group ids go with it, for the estimator the trainer runs at
    training time; GiGPO's step credit (``algo.advantage=gigpo``) is computed here from the episodes'
    turns. ``algo.overlong``: 'punish' adds DAPO's soft penalty (over the last ``algo.overlong_buffer``
    of ``budget`` tokens) to each reward, 'filter' takes truncated responses out of the loss."""
    trajs = [t for g in groups for t in g.trajectories]
    bonus = [0.0] * len(trajs)
    metrics = {}
    if algo.overlong == "punish":
        bonus = overlong_penalty(torch.tensor([len(t.response_ids) for t in trajs]), budget,
                                 algo.overlong_buffer).tolist()
        metrics["overlong/penalty_mean"] = sum(bonus) / len(bonus)
    keep = None
    if algo.overlong == "filter":
        keep = torch.tensor([t.finish_reason != FinishReason.LENGTH for t in trajs], dtype=torch.float)
        metrics["overlong/filtered_frac"] = 1 - keep.mean().item()
    if algo.advantage in STEP_ADVANTAGES:
        adv = step_advantages(groups, algo.discount(), algo.gigpo_omega, bonus)
        return build_batch(trajs, adv, pad_id, keep_rows=keep), metrics
    gid = torch.tensor([i for i, g in enumerate(groups) for _ in g.trajectories], dtype=torch.long)
    rewards = [token_rewards(t, b) for t, b in zip(trajs, bonus)]
    return build_batch(trajs, torch.zeros(len(trajs)), pad_id, rewards, gid, keep, owners(groups)), metrics


def owners(groups: list[Group]) -> torch.Tensor | None:
    """For ``TrainBatch.owner``: each row's episode row, an agent episode's extra branches
    (``info["branch_of"]``: the sample index of their episode) pointing at their episode; None when
    there are no branches."""
    flat = [(i, t) for i, g in enumerate(groups) for t in g.trajectories]
    if not any("branch_of" in t.info for _, t in flat):
        return None
    episode = {(i, t.sample_idx): k for k, (i, t) in enumerate(flat) if "branch_of" not in t.info}
    return torch.tensor([episode.get((i, t.info["branch_of"]), k) if "branch_of" in t.info else k
                         for k, (i, t) in enumerate(flat)], dtype=torch.long)


def token_rewards(t: Trajectory, bonus: float = 0.0) -> list[float]:
    """A reward per response token: each step's reward (``info["step_rewards"]``, one per turn, the
    last one with the verifier's) on the last trained token of its turn, or the trajectory's reward
    on its last trained token; ``bonus`` (shaping) goes with the last step's. 0 elsewhere."""
    n = len(t.response_ids)
    trained = [j for j in range(n) if not t.mask or t.mask[j]]
    out = [0.0] * n
    if not trained:
        return out
    steps = t.info.get("step_rewards") or [t.reward]
    turns = t.turns if len(t.turns) == n else [0] * n
    last_of = {turns[j]: j for j in trained}  # each turn's last trained token
    for k, r in enumerate(steps):
        out[last_of.get(k, trained[-1]) if k < len(steps) - 1 else trained[-1]] += r
    out[trained[-1]] += bonus
    return out


def step_advantages(groups: list[Group], gamma: float, omega: float,
                    bonus: list[float] | None = None) -> list[torch.Tensor]:
    """GiGPO over the turns of episodes: per-step rewards (``info["step_rewards"]``, the last
    one the episode's final reward) discounted by γ within the episode, anchor states
    (``info["anchors"]``, the observation each turn started from) shared across a group's episodes
    whatever policy version generated them; each token gets its turn's advantage. ``bonus`` (one per
    episode, reward shaping) is added to its last step's reward and to its episode reward."""
    trajs = [t for g in groups for t in g.trajectories]
    bonus = bonus or [0.0] * len(trajs)
    step_rewards, step_episode, anchors, episode_group = [], [], [], []
    for e, (gi, t) in enumerate((gi, t) for gi, g in enumerate(groups) for t in g.trajectories):
        rewards = list(t.info.get("step_rewards") or [t.reward])
        rewards[-1] += bonus[e]
        step_rewards += rewards
        step_episode += [e] * len(rewards)
        seen = t.info.get("anchors") or []
        anchors += [seen[k] if k < len(seen) else 0 for k in range(len(rewards))]
        episode_group.append(gi)
    ep = torch.tensor(step_episode, dtype=torch.long)
    returns = discounted_returns(torch.tensor(step_rewards, dtype=torch.float64), ep, gamma)
    adv = gigpo(torch.tensor([t.reward + b for t, b in zip(trajs, bonus)], dtype=torch.float64),
                torch.tensor(episode_group),
                returns, ep, torch.tensor(anchors, dtype=torch.long), omega)
    out, first = [], 0
    for e, t in enumerate(trajs):
        n = int((ep == e).sum())
        turns = torch.tensor(t.turns if t.turns else [0] * len(t.response_ids), dtype=torch.long).clamp(max=n - 1)
        out.append(steps_to_tokens(adv[first:first + n].float(), turns))
        first += n
    return out
