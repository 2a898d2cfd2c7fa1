"""Groups of trajectories before and after their episodes: empty groups for prompts, failed
responses dropped, the training batch (token-level rewards, overlong handling, step credit), and
what the rollout driver asks of a group (its oldest token's version, whether its rewards vary, an
agent's branches joined, the copy a checkpoint carries). Pure helpers; the driver and the loop call them."""

from __future__ import annotations

import dataclasses
import functools

import torch

from relayrl.algos import STEP_ADVANTAGES
from relayrl.algos.agents import discounted_returns, gigpo, rae, steps_to_tokens
from relayrl.algos.shaping import overlong_penalty
from relayrl.train.batch import TrainBatch, build_batch
from relayrl.envs.multi import family
from relayrl.failures import failed
from relayrl.models.prompts import encode_prompt
from relayrl.records import FinishReason, Group, Prompt, Trajectory, from_json_tokens, tokens_of


def make_groups(prompts: list[Prompt], tokenizer, group_size: int, tag: str, prompt_format: str = "chat"
                ) -> list[Group]:
    """G empty trajectories per prompt; ``tag`` makes request ids unique across calls, the index
    within a call (a prompt may come twice when a call spans an epoch boundary)."""
    groups = []
    for k, p in enumerate(prompts):
        ids = encode_prompt(tokenizer, p.messages, prompt_format, p.images)
        gid = f"{tag}.{k}/{p.id}"
        groups.append(Group(p, gid, [Trajectory(p, gid, i, ids) for i in range(group_size)]))
    return groups


def drop_failed(groups: list[Group]) -> tuple[list[Group], int]:
    """Episodes that failed (the engine, or user code: ``relayrl.failures``) are not trained: not the
    policy's answer, or not scored. A group keeps its other members, its advantages computed over
    them; a group left with none is dropped. A match's role that never moved is left out too (not a
    failure: nothing of its to train). Returns (groups, episodes dropped)."""
    out, dropped = [], 0
    for g in groups:
        # (a match's role that never moved, the other having won or forfeited first: nothing of its to train)
        played = [t for t in g.trajectories if not ("role" in t.info and not t.response_ids)]
        ok = [t for t in played if not failed(t)]
        dropped += len(played) - len(ok)
        if ok:
            out.append(g if len(ok) == len(g.trajectories) else Group(g.prompt, g.group_id, ok))
    return out, dropped


def training_batch(groups: list[Group], algo, budget: int, pad_id: int, baselines: dict | None = None,
                   adapters: tuple[str, ...] = ()) -> tuple[TrainBatch, dict]:
    """The batch of ``[t for g in groups for t in g.trajectories]`` and its shaping metrics. Token-level
    rewards (``token_rewards``) and group ids go with it, for the estimator the trainer runs at
    training time; GiGPO's step credit (``algo.advantage=gigpo``) is computed here from the episodes'
    turns, SPIRAL's (``algo.advantage=rae``) from ``baselines``, the run's running baselines per game and role.
    ``algo.overlong``: 'punish' adds DAPO's soft penalty (over the last ``algo.overlong_buffer``
    of ``budget`` tokens) to each reward, 'filter' takes truncated responses out of the loss. ``adapters``
    (``model.lora.per_role``): the roles' adapters, each row trained through its role's (``TrainBatch.adapter``)."""
    trajs = [t for g in groups for t in g.trajectories]
    build = functools.partial(build_batch, adapters=adapters)
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
    if algo.advantage == "rae":  # (``baselines``: the run's running baselines, updated here)
        keys = [f"{t.prompt.metadata.get('game', '')}/{family(t.info.get('role')) or ''}" for t in trajs]
        a = rae(torch.tensor([t.reward + b for t, b in zip(trajs, bonus)]), keys,
                baselines if baselines is not None else {}, algo.rae_alpha)
        metrics.update({f"rae/baseline{k}": baselines[k] for k in sorted(set(keys))} if baselines is not None else {})
        return build(trajs, a.float(), pad_id, keep_rows=keep), metrics
    if algo.advantage in STEP_ADVANTAGES:
        adv = step_advantages(groups, algo.discount(), algo.gigpo_omega, bonus)
        return build(trajs, adv, pad_id, keep_rows=keep), metrics
    gid = torch.tensor(baseline_groups(groups), dtype=torch.long)
    rewards = [token_rewards(t, b) for t, b in zip(trajs, bonus)]
    return build(trajs, torch.zeros(len(trajs)), pad_id, rewards, gid, keep, owners(groups)), metrics


def baseline_groups(groups: list[Group]) -> list[int]:
    """Each trajectory's baseline group: its group's, and within it its role's (a multi-agent match's
    ``info["role"]``, its ``family``: a role is compared with the same prompt's episodes of that role)."""
    keys = [(i, family(t.info.get("role"))) for i, g in enumerate(groups) for t in g.trajectories]
    index = {k: n for n, k in enumerate(dict.fromkeys(keys))}
    return [index[k] for k in keys]


def owners(groups: list[Group]) -> torch.Tensor | None:
    """For ``TrainBatch.owner``: each row's episode row, an agent episode's extra branches
    (``info["branch_of"]``: the sample index of their episode) pointing at their episode; None when
    there are no branches."""
    flat = [(i, t) for i, g in enumerate(groups) for t in g.trajectories]
    if not any("branch_of" in t.info for _, t in flat):
        return None
    role = lambda t: family(t.info.get("role"))  # noqa: E731 (an agent program's roles: each its own owner)
    episode = {(i, t.sample_idx, role(t)): k for k, (i, t) in enumerate(flat) if "branch_of" not in t.info}
    return torch.tensor([episode.get((i, t.info["branch_of"], role(t)), k) if "branch_of" in t.info else k
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
    episode, reward shaping) is added to its last step's reward and to its episode reward. A match's roles
    are groups of their own (``baseline_groups``): a move is compared with the same role's moves."""
    trajs = [t for g in groups for t in g.trajectories]
    bonus = bonus or [0.0] * len(trajs)
    step_rewards, step_episode, anchors = [], [], []
    for e, t in enumerate(trajs):
        rewards = list(t.info.get("step_rewards") or [t.reward])
        rewards[-1] += bonus[e]
        step_rewards += rewards
        step_episode += [e] * len(rewards)
        seen = t.info.get("anchors") or []
        anchors += [seen[k] if k < len(seen) else 0 for k in range(len(rewards))]
    episode_group = baseline_groups(groups)  # (each group's; a match's roles, each a group of its own)
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


def oldest_version(g: Group) -> int | None:
    """The policy version of the group's oldest token (None before its first token)."""
    return min((v for t in g.trajectories for v in t.versions), default=None)


def versions_behind(g: Group, version: int) -> int:
    o = oldest_version(g)
    return 0 if o is None else version - o


def flatten(groups: list[Group]) -> list[Trajectory]:
    return [t for g in groups for t in g.trajectories]


def expand_branches(g: Group) -> None:
    """An agent episode's other branches (``info["branch_tokens"]``: requests that rewrote its history,
    ``relayrl.serve.sessions``) join its group as trajectories trained with the episode's reward;
    ``info["branch_of"]`` names the episode, whose advantage they share (``rollout.group_advantages``)."""
    extra = []
    for t in g.trajectories:
        for d in t.info.pop("branch_tokens", []):
            # (env.roles: a branch of a role, its reward that role's; "own": that role's latest reply, an episode
            # of its own in its role's baseline, the owner of the role's other branches)
            info = ({"role": d["role"]} if d.get("role") else {}) | ({} if d.get("own") else {"branch_of": t.sample_idx})
            extra.append(Trajectory(t.prompt, t.group_id, t.sample_idx, **from_json_tokens(d),
                                    finish_reason=FinishReason(d["finish_reason"]), info=info, text=t.text,
                                    reward=d.get("reward", t.reward), complete=True))
    g.trajectories += extra


def no_variance(g: Group) -> bool:
    """Every scored episode of ``g`` has the same reward as the others in its role (failed ones aside; a group
    with none scored is left to the failure policy). Per role, as advantages are (each role's baseline its own):
    a zero-sum match's two sides always differ from each other, which says nothing of what either learns."""
    by_role: dict = {}
    for t in g.trajectories:
        if not failed(t):
            by_role.setdefault(family(t.info.get("role")), []).append(t.reward)
    return bool(by_role) and all(max(r) - min(r) < 1e-9 for r in by_role.values())


def length_class(t: Trajectory) -> str:
    return "long" if t.info.get("turns", 1) > 1 else "short"


def carried_copy(g: Group) -> Group:
    """A copy of running group ``g`` to checkpoint: complete episodes as they are, episodes in
    their first turn with their tokens so far, the others from their prompt."""
    def one(t: Trajectory) -> Trajectory:
        if t.complete:
            return dataclasses.replace(t, info=dict(t.info))
        if 0 in t.mask:  # past a tool call: the environment's state is not saved
            return Trajectory(t.prompt, t.group_id, t.sample_idx, list(t.prompt_ids))
        return dataclasses.replace(t, **tokens_of(t), info={})
    return Group(g.prompt, g.group_id, [one(t) for t in g.trajectories], g.window, g.sized)
