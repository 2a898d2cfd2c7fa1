"""The training batch: right-padded sequences and per-token tensors, built from trajectories, and
its split into micro-batches by a token budget. Shared by the policy's trainer and the critic."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from relayrl.models import moe
from relayrl.records import Trajectory, context_images

_SEQ = ("input_ids", "attention_mask", "routes")  # [N, L, ...]
_ROW = ("group", "adapter")  # [N]
_LIST = ("images",)  # a list of N, not a tensor


@dataclass
class TrainBatch:
    """Right-padded sequences; per-token tensors are aligned with targets ``input_ids[:, 1:]``.

    ``rewards`` (token-level rewards) and ``group`` are set when the advantages are computed at
    training time (``Trainer.step``, with the critic's values when the estimator needs them); when
    ``rewards`` is None, ``advantages`` are given (GiGPO's step credit, tests). ``values`` and
    ``returns`` are filled at training time for the critic."""

    input_ids: torch.Tensor  # [N, L]
    attention_mask: torch.Tensor  # [N, L]
    loss_mask: torch.Tensor  # [N, L-1], 1 on trained response tokens
    behav_logp: torch.Tensor  # [N, L-1], engine log-probs (0 off the mask)
    versions: torch.Tensor  # [N, L-1], policy version per token (-1 off the mask)
    advantages: torch.Tensor  # [N, L-1], per token (a sequence's advantage broadcast, or step credit)
    # [N, L-1], token-level rewards (outcome on the last trained token, ...), 0 off the response's trained tokens;
    # a row that ``algo.overlong=filter`` took out of the loss (loss_mask all 0) keeps its rewards
    rewards: torch.Tensor | None = None
    group: torch.Tensor | None = None  # [N], each row's group (the responses to one prompt)
    values: torch.Tensor | None = None  # [N, L-1], the critic's values at training time
    returns: torch.Tensor | None = None  # [N, L-1], the critic's targets
    # [N]: the row of the episode each row belongs to (itself, or for an agent episode's extra branch its
    # episode's row: ``relayrl.serve``); None: every row is an episode. Whole batches only (``select`` drops it)
    owner: torch.Tensor | None = None
    # [N, L-1]: a teacher's log-probs of the trained tokens (on-policy distillation; 0 elsewhere), None without one
    teacher_logp: torch.Tensor | None = None
    # [N, L, moe layers, top_k] uint8: a mixture of experts' recorded routes per token (``models.moe``), None without
    routes: torch.Tensor | None = None
    # [N]: each row's adapter (model.lora.per_role: its role's, an index into ``Trainer.adapters``), None with one
    adapter: torch.Tensor | None = None
    # N tuples: the references of each row's images, in the order of its image tokens (``models.vision``); None: text
    images: list | None = None

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx: list[int]) -> "TrainBatch":
        """Rows ``idx``, trimmed to their longest sequence."""
        t = torch.tensor(idx, dtype=torch.long)
        n = int(self.attention_mask[t].sum(1).max())

        def cut(name: str, x):
            if x is None or name == "owner":  # (row indices of the whole batch)
                return None
            if name in _LIST:
                return [x[i] for i in idx]
            return x[t] if name in _ROW else x[t, :n] if name in _SEQ else x[t, : n - 1]

        return TrainBatch(**{f.name: cut(f.name, getattr(self, f.name)) for f in fields(self)})

    def to(self, device) -> "TrainBatch":
        return TrainBatch(**{f.name: getattr(self, f.name) if getattr(self, f.name) is None or f.name in _LIST
                             else getattr(self, f.name).to(device) for f in fields(self)})


def build_batch(trajs: list[Trajectory], advantages: torch.Tensor | list, pad_id: int,
                rewards: list[list[float]] | None = None, group: torch.Tensor | None = None,
                keep_rows: torch.Tensor | None = None, owner: torch.Tensor | None = None,
                adapters: tuple[str, ...] = ()) -> TrainBatch:
    """Right-padded batch of ``trajs``. ``advantages``: one per trajectory (a tensor [N], broadcast
    over its response tokens) or one sequence per trajectory with a value per response token
    (step-level credit for agents). ``Trajectory.mask`` (if set) takes response tokens out of the
    loss, e.g. tool output and template tokens between turns. ``rewards``: per trajectory, a reward
    per response token (for the estimators run at training time), with ``group`` [N] and ``owner`` [N]
    (``TrainBatch.owner``); ``keep_rows`` [N] (0/1) takes whole responses out of the loss
    (``algo.overlong=filter``): their loss mask is 0, their rewards stay, for their groups' baselines.
    ``adapters`` (``model.lora.per_role``): each row's adapter is its role's (``Trajectory.info['role']``, its family)."""
    n = max(len(t.prompt_ids) + len(t.response_ids) for t in trajs)
    N = len(trajs)
    ids = torch.full((N, n), pad_id, dtype=torch.long)
    att = torch.zeros((N, n), dtype=torch.long)
    mask = torch.zeros((N, n - 1))
    behav = torch.zeros((N, n - 1))
    vers = torch.full((N, n - 1), -1, dtype=torch.long)
    adv = torch.zeros((N, n - 1))
    tok_rewards = torch.zeros((N, n - 1)) if rewards is not None else None
    taught = any(t.teacher_logprobs for t in trajs)
    if taught and not all(len(t.teacher_logprobs) == len(t.response_ids) for t in trajs):
        raise ValueError("on-policy distillation: every trajectory of a batch needs its teacher's log-probs "
                         "(one per response token)")
    teacher = torch.zeros((N, n - 1)) if taught else None
    for i, t in enumerate(trajs):
        p, r = len(t.prompt_ids), len(t.response_ids)
        ids[i, : p + r] = torch.tensor(t.prompt_ids + t.response_ids)
        att[i, : p + r] = 1
        # response token j sits at position p + j and is predicted at position p + j - 1
        span = slice(p - 1, p - 1 + r)
        mask[i, span] = torch.tensor(t.mask, dtype=torch.float) if t.mask else 1.0
        behav[i, span] = torch.tensor(t.behav_logprobs)
        vers[i, span] = torch.tensor(t.versions)
        adv[i, span] = torch.as_tensor(advantages[i], dtype=torch.float)
        if tok_rewards is not None:
            tok_rewards[i, span] = torch.as_tensor(rewards[i], dtype=torch.float)
        if teacher is not None:
            teacher[i, span] = torch.tensor(t.teacher_logprobs)
    # rewards on the response's trained tokens, taken before ``keep_rows``: a row left out of the loss keeps
    # its reward, which its group's baseline counts (DAPO's overlong filtering; TRL's mask_truncated_completions)
    tok_rewards = None if tok_rewards is None else tok_rewards * mask
    if keep_rows is not None:
        mask = mask * keep_rows.to(mask.dtype).unsqueeze(-1)
    routed = next((t.routes for t in trajs if t.routes is not None and len(t.routes)), None)
    routes = None if routed is None else moe.routes_tensor(trajs, n, *routed.shape[1:])
    return TrainBatch(ids, att, mask, behav, vers, adv * mask, tok_rewards, group, owner=owner,
                      teacher_logp=None if teacher is None else teacher * mask, routes=routes,
                      adapter=_adapter_rows(trajs, adapters) if adapters else None,
                      images=_images(trajs))


def _images(trajs: list[Trajectory]) -> list | None:
    """Each row's image references (``TrainBatch.images``), or None for text (SFT's examples have no prompt)."""
    out = [context_images(t) if t.prompt is not None else () for t in trajs]
    return out if any(out) else None


def _adapter_rows(trajs: list[Trajectory], adapters: tuple[str, ...]) -> torch.Tensor:
    from relayrl.envs.multi import family

    rows = []
    for t in trajs:
        role = family(t.info.get("role"))
        if role not in adapters:
            raise ValueError(f"model.lora.per_role: a trajectory of role {role!r} has no adapter (adapters: "
                             f"{', '.join(adapters)})")
        rows.append(adapters.index(role))
    return torch.tensor(rows, dtype=torch.long)


def micro_batches(batch: TrainBatch, token_budget: int, packed: bool = False) -> list[list[int]]:
    """Groups of row indices, sorted by length, each within the token budget (at least one row): rows ×
    longest ≤ budget (padded rows), or the rows' lengths summed ≤ budget (``packed``: ``packing.Packed``).
    Rows of different adapters (``TrainBatch.adapter``) are never in one group: a forward runs under one."""
    lengths = batch.attention_mask.sum(1).tolist()
    key = batch.adapter.tolist() if batch.adapter is not None else [0] * batch.size
    order = sorted(range(batch.size), key=lambda i: (key[i], lengths[i]))
    groups, cur, longest, total = [], [], 0, 0
    for i in order:
        longest_if = max(longest, lengths[i])
        cost = total + lengths[i] if packed else longest_if * (len(cur) + 1)
        if cur and (cost > token_budget or key[i] != key[cur[0]]):
            groups.append(cur)
            cur, longest_if, total = [], lengths[i], 0
        cur.append(i)
        longest, total = longest_if, total + lengths[i]
    if cur:
        groups.append(cur)
    return groups
