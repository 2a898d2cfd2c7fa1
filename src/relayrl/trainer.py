"""The trainer: recompute π_old, then PPO-style updates with micro-batching by a token budget.

It knows nothing of engines or the loop: it takes a ``TrainBatch`` and returns metrics.
Aggregation uses counts over the whole optimiser (mini-)batch, so gradients do not depend on
how the batch is split into micro-batches (tested).

Placement (``distributed.py``): the policy and the KL reference live on ``trainer.device``, each
micro-batch is moved there, and everything returned (log-probs, metrics, ``full_state_dict``) is
on the CPU. Weights and activations keep ``model.dtype`` (no autocast: the engine samples in that
dtype, so the trainer's log-probs match its own; they are taken in float32 from the logits). With
``trainer.fsdp`` the weights are sharded over the torchrun ranks and each rank runs its share of
the micro-batches; rank 0 leads, sending each call to the other ranks first.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass, fields

import torch

from relayrl import distributed
from relayrl.algos import AGGREGATIONS, POLICY_LOSSES, kl_penalty, lookup
from relayrl.algos.offpolicy import decoupled_ppo, ess_lr_scale, m2po, m2po_mask, tis_weights
from relayrl.config import AlgoCfg, TrainerCfg
from relayrl.faults import fault_point
from relayrl.models import entropy_from_logits
from relayrl.records import Trajectory
from relayrl.sampling import sampled_logprobs


@dataclass
class TrainBatch:
    """Right-padded sequences; per-token tensors are aligned with targets ``input_ids[:, 1:]``."""

    input_ids: torch.Tensor  # [N, L]
    attention_mask: torch.Tensor  # [N, L]
    loss_mask: torch.Tensor  # [N, L-1], 1 on trained response tokens
    behav_logp: torch.Tensor  # [N, L-1], engine log-probs (0 off the mask)
    versions: torch.Tensor  # [N, L-1], policy version per token (-1 off the mask)
    advantages: torch.Tensor  # [N, L-1], per token (a sequence's advantage broadcast, or step credit)

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx: list[int]) -> "TrainBatch":
        """Rows ``idx``, trimmed to their longest sequence."""
        t = torch.tensor(idx, dtype=torch.long)
        n = int(self.attention_mask[t].sum(1).max())
        return TrainBatch(
            self.input_ids[t, :n],
            self.attention_mask[t, :n],
            self.loss_mask[t, : n - 1],
            self.behav_logp[t, : n - 1],
            self.versions[t, : n - 1],
            self.advantages[t, : n - 1],
        )

    def to(self, device) -> "TrainBatch":
        return TrainBatch(*(getattr(self, f.name).to(device) for f in fields(self)))


def build_batch(trajs: list[Trajectory], advantages: torch.Tensor | list, pad_id: int) -> TrainBatch:
    """Right-padded batch of ``trajs``. ``advantages``: one per trajectory (a tensor [N], broadcast
    over its response tokens) or one sequence per trajectory with a value per response token
    (step-level credit for agents). ``Trajectory.mask`` (if set) takes response tokens out of the
    loss, e.g. tool output and template tokens between turns."""
    n = max(len(t.prompt_ids) + len(t.response_ids) for t in trajs)
    N = len(trajs)
    ids = torch.full((N, n), pad_id, dtype=torch.long)
    att = torch.zeros((N, n), dtype=torch.long)
    mask = torch.zeros((N, n - 1))
    behav = torch.zeros((N, n - 1))
    vers = torch.full((N, n - 1), -1, dtype=torch.long)
    adv = torch.zeros((N, n - 1))
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
    return TrainBatch(ids, att, mask, behav, vers, adv * mask)


def micro_batches(batch: TrainBatch, token_budget: int) -> list[list[int]]:
    """Groups of row indices, sorted by length, each with rows × longest ≤ budget (at least one row)."""
    lengths = batch.attention_mask.sum(1).tolist()
    order = sorted(range(batch.size), key=lambda i: lengths[i])
    groups, cur, longest = [], [], 0
    for i in order:
        longest_if = max(longest, lengths[i])
        if cur and longest_if * (len(cur) + 1) > token_budget:
            groups.append(cur)
            cur, longest_if = [], lengths[i]
        cur.append(i)
        longest = longest_if
    if cur:
        groups.append(cur)
    return groups


def _mismatch(logp: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor) -> tuple[float, float, float]:
    """(sum, max, count) of |log π_trainer − log π_engine| over the tokens in ``mask``."""
    diff = (logp - behav).abs() * mask
    return diff.sum().item(), diff.max().item() if diff.numel() else 0.0, mask.sum().item()


def lr_lambda(cfg: TrainerCfg, total_steps: int):
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        if cfg.schedule == "constant":
            return 1.0
        frac = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        return 1.0 - frac if cfg.schedule == "linear" else 0.5 * (1 + math.cos(math.pi * frac))

    return f


class Trainer:
    def __init__(self, model, tcfg: TrainerCfg, acfg: AlgoCfg, temperature: float, total_steps: int, norm_len: int,
                 ref_model=None, top_p: float = 1.0, top_k: int = 0, mismatch_rows: int = 16):
        self.model, self.tcfg, self.acfg = model, tcfg, acfg
        self.temperature, self.norm_len = temperature, norm_len
        self.top_p, self.top_k = top_p, top_k  # the engine's truncation, reproduced (sampling.py)
        # the weights of one version ago, to measure the engine-trainer mismatch on tokens they sampled
        self.mismatch_rows = mismatch_rows
        self._prev: tuple[int, dict] | None = None
        self.ref = None
        if acfg.kl_coef > 0:  # frozen reference: the given model, else a copy of the policy as it is now
            self.ref = (ref_model or copy.deepcopy(model)).eval().requires_grad_(False)
        self.device = distributed.resolve_device(tcfg.device)
        self.dp = distributed.setup(self.device) if tcfg.fsdp else None  # None: this process trains alone
        for m in (model, self.ref):
            if m is not None:
                m.to(self.device)
                if self.dp:
                    distributed.shard(m)
        self.opt = torch.optim.AdamW(  # after sharding: it holds this rank's shards
            model.parameters(), lr=tcfg.lr, betas=tcfg.betas, weight_decay=tcfg.weight_decay
        )
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(tcfg, total_steps * tcfg.updates_per_step))
        self.loss_fn = lookup(POLICY_LOSSES, acfg.loss, "policy loss")
        self.agg_fn = lookup(AGGREGATIONS, acfg.agg, "aggregation")

    @property
    def _leads(self) -> bool:
        """Rank 0 of an FSDP run: its calls are sent to the other ranks first."""
        return self.dp is not None and self.dp.leads

    def _micro_batches(self, batch: TrainBatch) -> list[list[int] | None]:
        """This rank's micro-batches of ``batch`` (None: a pass with no rows, to keep in step)."""
        groups = micro_batches(batch, self.tcfg.micro_batch_tokens)
        return self.dp.share(groups) if self.dp else groups

    # -- forward helpers -------------------------------------------------------------------
    def _logits(self, model, mb: TrainBatch, params: dict | None = None) -> torch.Tensor:
        kw = dict(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False)
        if params is not None:  # the same module with other weights
            return torch.func.functional_call(model, params, (), kw).logits[:, :-1]
        return model(**kw).logits[:, :-1]

    def _logp(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """log π of the targets under the distribution the engine samples from (T, top-k, top-p)."""
        return sampled_logprobs(logits, targets, self.temperature, self.top_k, self.top_p)

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, model=None, params: dict | None = None) -> torch.Tensor:
        """Per-token log-probs [N, L-1] of ``batch`` under ``model`` (default: the policy, with
        ``params`` instead of its own weights if given), no grad; on the CPU, on every rank."""
        model = model or self.model
        out = torch.zeros_like(batch.behav_logp)
        with self._swapped(params) if self.dp and params is not None else contextlib.nullcontext():
            for idx in self._micro_batches(batch):
                if idx is None:  # (FSDP) this rank has no rows left: a forward all the same
                    self._logits(model, batch.select([0]).to(self.device))
                    continue
                mb = batch.select(idx).to(self.device)
                lp = self._logp(self._logits(model, mb, None if self.dp else params), mb.input_ids[:, 1:])
                out[torch.tensor(idx), : lp.shape[1]] = lp.cpu()
        if self.dp:  # each rank filled its own rows
            out = self.dp.reduce(out)
        return out * batch.loss_mask

    @contextlib.contextmanager
    def _swapped(self, params: dict):
        """(FSDP) The policy with ``params`` (shards, by name) in place of its weights, copied in and
        back: FSDP2 gathers a layer's own parameters for its forward, so ``functional_call``'s
        substitutes would be ignored."""
        named = dict(self.model.named_parameters())
        with torch.no_grad():
            own = {k: named[k].detach().clone() for k in params}
            try:
                for k, v in params.items():
                    named[k].copy_(v)
                yield
            finally:
                for k, v in own.items():
                    named[k].copy_(v)

    # -- one optimiser step ----------------------------------------------------------------
    def accumulate(self, batch: TrainBatch, old_logp, ref_logp, num_tokens: float, num_seqs: float,
                   version: int | None = None, m2po_keep: torch.Tensor | None = None) -> dict:
        """Forward/backward over micro-batches of ``batch``; loss normalised by the global counts given.

        Tokens sampled by an older policy than ``version`` (continued partial rollouts) are
        trained with decoupled PPO: the trust region around π_old (the proximal policy) and an
        importance weight π_old/π_behav, bounded (algorithms.md §2). Every term depends only on
        its own token (and M2PO's mask, ``m2po_keep``, is computed over the whole batch), so the
        gradient does not depend on how rows are split into micro-batches."""
        sums = {"loss": 0.0, "clip_frac": 0.0, "kl": 0.0, "entropy": 0.0, "mismatch_sum": 0.0, "mismatch_max": 0.0,
                "mismatch_tokens": 0.0, "seq_log_w": torch.zeros(batch.size)}
        a = self.acfg
        dev = self.device
        for idx in self._micro_batches(batch):
            if idx is None:  # (FSDP) this rank has no rows left: a zero-loss pass, as FSDP needs every rank's
                (self._logits(self.model, batch.select([0]).to(dev)).sum() * 0).backward()
                continue
            mb = batch.select(idx).to(dev)
            t = torch.tensor(idx)
            L = mb.loss_mask.shape[1]
            fault_point("train")
            logits = self._logits(self.model, mb)
            logp = self._logp(logits, mb.input_ids[:, 1:])
            adv = mb.advantages
            # on-policy single update: π_old is the current policy, so this forward gives it for free
            old = logp.detach() if old_logp is None else old_logp[t, :L].to(dev)
            stale = (mb.versions < version) & mb.loss_mask.bool() if version is not None else None
            with torch.no_grad():
                fresh = mb.loss_mask if stale is None else mb.loss_mask * (~stale)
                diff = (logp.detach() - mb.behav_logp).abs() * fresh
                sums["mismatch_sum"] += diff.sum().item()
                sums["mismatch_tokens"] += fresh.sum().item()
                sums["mismatch_max"] = max(sums["mismatch_max"], diff.max().item())
                # log importance weight π_old/π_behav of each sequence, for the effective sample size
                sums["seq_log_w"][t] = ((old.detach() - mb.behav_logp) * mb.loss_mask).sum(1).cpu()
            keep = None if m2po_keep is None else m2po_keep[t, :L].to(dev)
            per_tok, m = self._policy_loss(logp, old, mb, adv, stale, keep)
            agg = lambda x: self.agg_fn(x, mb.loss_mask, num_tokens, num_seqs, self.norm_len)  # noqa: E731
            loss = agg(per_tok)
            if ref_logp is not None:
                kl = agg(kl_penalty(logp, ref_logp[t, :L].to(dev), a.kl_estimator))
                loss = loss + a.kl_coef * kl
                sums["kl"] += kl.item()
            if a.entropy_coef:
                ent = agg(entropy_from_logits(logits, self.temperature))
                loss = loss - a.entropy_coef * ent
            else:
                with torch.no_grad():
                    ent = agg(entropy_from_logits(logits.detach(), self.temperature))
            loss.backward()
            share = mb.loss_mask.sum().item() / max(num_tokens, 1.0)
            sums["loss"] += loss.item()
            sums["entropy"] += ent.item()
            sums["clip_frac"] += float(m.get("clip_frac", 0.0)) * share
        return self._gather_sums(sums) if self.dp else sums

    def _gather_sums(self, sums: dict) -> dict:
        """(FSDP) Every rank's share of the sums, added up (the largest mismatch: the largest)."""
        keys = ["loss", "clip_frac", "kl", "entropy", "mismatch_sum", "mismatch_tokens"]
        total = self.dp.reduce(torch.tensor([sums[k] for k in keys], dtype=torch.float64))
        out = {k: v.item() for k, v in zip(keys, total)}
        out["mismatch_max"] = self.dp.reduce(torch.tensor(sums["mismatch_max"]), "max").item()
        out["seq_log_w"] = self.dp.reduce(sums["seq_log_w"])  # each rank filled its own rows
        return out

    def _policy_loss(self, logp, old, mb: TrainBatch, adv, stale, m2po_keep):
        """Per-token policy loss under ``algo.offpolicy`` (algos/offpolicy.py holds the math)."""
        a = self.acfg
        clip = (a.clip_low, a.clip_high, a.dual_clip)
        if a.offpolicy == "tis":  # every token: truncated π_old/π_behav times the PPO term
            w, _ = tis_weights(old, mb.behav_logp, mb.loss_mask, a.tis_cap, a.tis_level)
            per_tok, m = self.loss_fn(logp, old, adv, mb.loss_mask, *clip)
            return per_tok * w, m
        if a.offpolicy == "m2po":
            return m2po(logp, mb.behav_logp, adv, mb.loss_mask, a.m2po_tau, keep=m2po_keep)
        if a.offpolicy == "none" or stale is None:
            return self.loss_fn(logp, old, adv, mb.loss_mask, *clip)
        return decoupled_ppo(logp, old, mb.behav_logp, adv, mb.loss_mask, *clip, offpolicy=stale)

    def step(self, batch: TrainBatch, version: int | None = None) -> dict:
        """π_old (and π_ref) log-probs, then ``updates_per_step`` optimiser steps over mini-batches.

        With one update per batch of on-policy data, π_old equals the current policy: it is taken
        from the training forward itself (detached) instead of a separate recompute pass (as verl
        does), which saves a third of the training compute. With several updates (or M2PO, whose
        mask needs the whole batch first) π_old is recomputed first."""
        if self._leads:
            self.dp.send("step", batch, version)
        self.model.train()
        single = self.tcfg.updates_per_step == 1
        old_logp = self.logprobs(batch) if not single or self.acfg.offpolicy == "m2po" else None
        ref_logp = self.logprobs(batch, self.ref) if self.ref is not None else None
        fresh = batch.loss_mask if version is None else batch.loss_mask * (batch.versions >= version)
        mismatch = [_mismatch(old_logp, batch.behav_logp, fresh)] if old_logp is not None else []
        mismatch.append(self._previous_version_mismatch(batch, version))
        perm = torch.randperm(batch.size)
        perm = (self.dp.broadcast(perm) if self.dp else perm).tolist()  # (FSDP: rank 0's order on every rank)
        # (a batch left with fewer rows than updates_per_step, after failed episodes were left out: fewer steps)
        chunks = [c for c in (perm[i :: self.tcfg.updates_per_step] for i in range(self.tcfg.updates_per_step)) if c]
        totals: dict[str, float] = {}
        for chunk in chunks:
            mini = batch.select(chunk)
            self.opt.zero_grad(set_to_none=True)
            t = torch.tensor(chunk)
            keep = None
            if self.acfg.offpolicy == "m2po":  # one mask over the optimiser batch (not per micro-batch)
                log_r = (old_logp[t][:, : mini.loss_mask.shape[1]] - mini.behav_logp) * mini.loss_mask
                keep = m2po_mask(log_r, mini.advantages, mini.loss_mask, self.acfg.m2po_tau)
            sums = self.accumulate(
                mini, None if single else old_logp[t], None if ref_logp is None else ref_logp[t],
                mini.loss_mask.sum().item(), float(mini.size), version, m2po_keep=keep,
            )
            if old_logp is None:  # measured in the training forward
                mismatch.append((sums["mismatch_sum"], sums["mismatch_max"], sums["mismatch_tokens"]))
            scale, ess = ess_lr_scale(sums.pop("seq_log_w"))
            sums["ess_frac"] = (ess / mini.size).item()
            del sums["mismatch_sum"], sums["mismatch_max"], sums["mismatch_tokens"]
            gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.tcfg.grad_clip)
            sums["grad_norm"] = (gn.full_tensor() if self.dp else gn).item()  # (FSDP: a DTensor, the global norm)
            lr_scale = scale.item() if self.acfg.ess_lr_scale else 1.0
            for g in self.opt.param_groups:  # the scheduler sets the next step's lr afresh
                g["lr"] *= lr_scale
            sums["lr"] = self.opt.param_groups[0]["lr"]
            self.opt.step()
            self.sched.step()
            for k, v in sums.items():
                totals[k] = totals.get(k, 0.0) + v / len(chunks)
        self.model.eval()
        n = sum(x[2] for x in mismatch)
        return {"logprob_mismatch_mean": sum(x[0] for x in mismatch) / n if n else None,  # None: nothing checkable
                "logprob_mismatch_max": max(x[1] for x in mismatch) if n else None,
                "logprob_mismatch_tokens": int(n), **totals}

    @torch.no_grad()
    def _previous_version_mismatch(self, batch: TrainBatch, version: int | None) -> tuple[float, float, float]:
        """Engine-trainer mismatch on tokens sampled one version ago (all of them in periodic mode,
        most in async), under the weights of that version, kept from the previous step: up to
        ``mismatch_rows`` rows, so it costs a small forward pass. Then remembers this version's
        weights for the next step."""
        out = (0.0, 0.0, 0.0)
        if version is None or not self.mismatch_rows:
            return out
        if self._prev is not None and self._prev[0] == version - 1:
            sel = batch.loss_mask * (batch.versions == version - 1)
            rows = torch.nonzero(sel.sum(1) > 0).flatten()[: self.mismatch_rows].tolist()
            if rows:
                sub = batch.select(rows)
                on_device = {k: v.to(self.device, non_blocking=True) for k, v in self._prev[1].items()}
                lp = self.logprobs(sub, params=on_device)
                del on_device
                out = _mismatch(lp, sub.behav_logp, sel[torch.tensor(rows), : lp.shape[1]])
        if bool(((batch.versions < version) & batch.loss_mask.bool()).any()):  # a mode with stale tokens
            # kept on the CPU (a GPU trainer would otherwise hold a second copy of the weights all run long);
            # FSDP's shards stay where they are (a rank holds 1/N of the weights)
            where = self.device if self.dp else torch.device("cpu")
            self._prev = (version, {k: p.detach().to(where, copy=True) for k, p in self.model.named_parameters()})
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's weights on the CPU, whole, for engines and checkpoints (``model.state_dict()``
        itself when training on the CPU). FSDP: gathered on rank 0 ({} on the others)."""
        if self.dp is None:
            sd = self.model.state_dict()
            return sd if self.device.type == "cpu" else {k: v.detach().cpu() for k, v in sd.items()}
        if self._leads:
            self.dp.send("weights")
        return distributed.full_state_dict(self.model)

    def state_dict(self) -> dict:
        """Optimiser and scheduler. FSDP: the optimiser state by parameter name, whole, on rank 0."""
        if self.dp is None:
            return {"optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict()}
        if self._leads:
            self.dp.send("state")
        return {"optimizer": distributed.full_optimizer_state(self.model, self.opt),
                "scheduler": self.sched.state_dict(), "fsdp": True}

    def load_state_dict(self, sd: dict) -> None:
        if bool(sd.get("fsdp")) != (self.dp is not None):
            was = "true" if sd.get("fsdp") else "false"
            raise ValueError(f"the checkpoint's optimiser state was saved with trainer.fsdp={was}: resume with "
                             f"trainer.fsdp={was}")
        if self.dp is None:
            self.opt.load_state_dict(sd["optimizer"])
        else:
            if self._leads:
                self.dp.send("load", {"optimizer": {}, "scheduler": sd["scheduler"], "fsdp": True})  # shards: below
            distributed.load_optimizer_state(self.model, self.opt, sd["optimizer"])
        self.sched.load_state_dict(sd["scheduler"])

    def close(self) -> None:
        """(FSDP, rank 0) The other ranks stop following."""
        if self._leads:
            self.dp.send("stop")
