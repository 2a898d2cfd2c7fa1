"""The trainer: recompute π_old, then PPO-style updates with micro-batching by a token budget.

It knows nothing of engines or the loop: it takes a ``TrainBatch`` and returns metrics.
Aggregation uses counts over the whole optimiser (mini-)batch, so gradients do not depend on
how the batch is split into micro-batches (tested).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from relayrl.algos import ADVANTAGES, AGGREGATIONS, POLICY_LOSSES, kl_penalty, lookup
from relayrl.algos.offpolicy import decoupled_ppo, ess_lr_scale, m2po, tis_weights
from relayrl.config import AlgoCfg, TrainerCfg
from relayrl.faults import fault_point
from relayrl.models import entropy_from_logits, token_logprobs
from relayrl.records import Trajectory


@dataclass
class TrainBatch:
    """Right-padded sequences; per-token tensors are aligned with targets ``input_ids[:, 1:]``."""

    input_ids: torch.Tensor  # [N, L]
    attention_mask: torch.Tensor  # [N, L]
    loss_mask: torch.Tensor  # [N, L-1], 1 on response tokens
    behav_logp: torch.Tensor  # [N, L-1], engine log-probs (0 off the mask)
    versions: torch.Tensor  # [N, L-1], policy version per token (-1 off the mask)
    advantages: torch.Tensor  # [N]

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
            self.advantages[t],
        )


def build_batch(trajs: list[Trajectory], advantages: torch.Tensor, pad_id: int) -> TrainBatch:
    n = max(len(t.prompt_ids) + len(t.response_ids) for t in trajs)
    N = len(trajs)
    ids = torch.full((N, n), pad_id, dtype=torch.long)
    att = torch.zeros((N, n), dtype=torch.long)
    mask = torch.zeros((N, n - 1))
    behav = torch.zeros((N, n - 1))
    vers = torch.full((N, n - 1), -1, dtype=torch.long)
    for i, t in enumerate(trajs):
        p, r = len(t.prompt_ids), len(t.response_ids)
        ids[i, : p + r] = torch.tensor(t.prompt_ids + t.response_ids)
        att[i, : p + r] = 1
        # response token j sits at position p + j and is predicted at position p + j - 1
        mask[i, p - 1 : p - 1 + r] = 1
        behav[i, p - 1 : p - 1 + r] = torch.tensor(t.behav_logprobs)
        vers[i, p - 1 : p - 1 + r] = torch.tensor(t.versions)
    return TrainBatch(ids, att, mask, behav, vers, advantages.float())


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
                 ref_model=None):
        self.model, self.tcfg, self.acfg = model, tcfg, acfg
        self.temperature, self.norm_len = temperature, norm_len
        self.opt = torch.optim.AdamW(
            model.parameters(), lr=tcfg.lr, betas=tcfg.betas, weight_decay=tcfg.weight_decay
        )
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(tcfg, total_steps * tcfg.updates_per_step))
        self.ref = None
        if acfg.kl_coef > 0:  # frozen reference: the given model, else a copy of the policy as it is now
            self.ref = (ref_model or copy.deepcopy(model)).eval().requires_grad_(False)
        self.loss_fn = lookup(POLICY_LOSSES, acfg.loss, "policy loss")
        self.agg_fn = lookup(AGGREGATIONS, acfg.agg, "aggregation")
        self.adv_fn = lookup(ADVANTAGES, acfg.advantage, "advantage estimator")

    # -- forward helpers -------------------------------------------------------------------
    def _logits(self, model, mb: TrainBatch) -> torch.Tensor:
        return model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits[:, :-1]

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, model=None) -> torch.Tensor:
        """Per-token log-probs [N, L-1] of ``batch`` under ``model`` (default: the policy), no grad."""
        model = model or self.model
        out = torch.zeros_like(batch.behav_logp)
        for idx in micro_batches(batch, self.tcfg.micro_batch_tokens):
            mb = batch.select(idx)
            lp = token_logprobs(self._logits(model, mb), mb.input_ids[:, 1:], self.temperature)
            out[torch.tensor(idx), : lp.shape[1]] = lp
        return out * batch.loss_mask

    # -- one optimiser step ----------------------------------------------------------------
    def accumulate(self, batch: TrainBatch, old_logp, ref_logp, num_tokens: float, num_seqs: float,
                   version: int | None = None) -> dict:
        """Forward/backward over micro-batches of ``batch``; loss normalised by the global counts given.

        Tokens sampled by an older policy than ``version`` (continued partial rollouts) are
        trained with decoupled PPO: the trust region around π_old (the proximal policy) and an
        importance weight π_old/π_behav, bounded (algorithms.md §2)."""
        sums = {"loss": 0.0, "clip_frac": 0.0, "kl": 0.0, "entropy": 0.0, "mismatch_sum": 0.0, "mismatch_max": 0.0,
                "mismatch_tokens": 0.0, "seq_log_w": torch.zeros(batch.size)}
        a = self.acfg
        for idx in micro_batches(batch, self.tcfg.micro_batch_tokens):
            mb = batch.select(idx)
            t = torch.tensor(idx)
            L = mb.loss_mask.shape[1]
            fault_point("train")
            logits = self._logits(self.model, mb)
            logp = token_logprobs(logits, mb.input_ids[:, 1:], self.temperature)
            adv = mb.advantages[:, None].expand_as(logp)
            # on-policy single update: π_old is the current policy, so this forward gives it for free
            old = logp.detach() if old_logp is None else old_logp[t, :L]
            stale = (mb.versions < version) & mb.loss_mask.bool() if version is not None else None
            with torch.no_grad():
                fresh = mb.loss_mask if stale is None else mb.loss_mask * (~stale)
                diff = (logp.detach() - mb.behav_logp).abs() * fresh
                sums["mismatch_sum"] += diff.sum().item()
                sums["mismatch_tokens"] += fresh.sum().item()
                sums["mismatch_max"] = max(sums["mismatch_max"], diff.max().item())
                # log importance weight π_old/π_behav of each sequence, for the effective sample size
                sums["seq_log_w"][t] = ((old.detach() - mb.behav_logp) * mb.loss_mask).sum(1)
            per_tok, m = self._policy_loss(logp, old, mb, adv, stale is not None and bool(stale.any()))
            agg = lambda x: self.agg_fn(x, mb.loss_mask, num_tokens, num_seqs, self.norm_len)  # noqa: E731
            loss = agg(per_tok)
            if ref_logp is not None:
                kl = agg(kl_penalty(logp, ref_logp[t, :L], a.kl_estimator))
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
        return sums

    def _policy_loss(self, logp, old, mb: TrainBatch, adv, has_stale: bool):
        """Per-token policy loss under ``algo.offpolicy`` (algos/offpolicy.py holds the math). M2PO's
        second-moment budget applies per micro-batch here, so unlike the others its gradient depends
        on how the batch is split."""
        a = self.acfg
        clip = (a.clip_low, a.clip_high, a.dual_clip)
        if a.offpolicy == "tis":  # every token: truncated π_old/π_behav times the PPO term
            w, _ = tis_weights(old, mb.behav_logp, mb.loss_mask, a.tis_cap, a.tis_level)
            per_tok, m = self.loss_fn(logp, old, adv, mb.loss_mask, *clip)
            return per_tok * w, m
        if not has_stale or a.offpolicy == "none":
            return self.loss_fn(logp, old, adv, mb.loss_mask, *clip)
        if a.offpolicy == "m2po":
            return m2po(logp, mb.behav_logp, adv, mb.loss_mask, a.m2po_tau)
        return decoupled_ppo(logp, old, mb.behav_logp, adv, mb.loss_mask, *clip)

    def step(self, batch: TrainBatch, version: int | None = None) -> dict:
        """π_old (and π_ref) log-probs, then ``updates_per_step`` optimiser steps over mini-batches.

        With one update per batch of on-policy data, π_old equals the current policy: it is taken
        from the training forward itself (detached) instead of a separate recompute pass (as verl
        does), which saves a third of the training compute. With several updates π_old is
        recomputed first, so later mini-batches see a real ratio."""
        self.model.train()
        single = self.tcfg.updates_per_step == 1
        old_logp = None if single else self.logprobs(batch)
        ref_logp = self.logprobs(batch, self.ref) if self.ref is not None else None
        metrics = {}
        if not single:
            diff = (old_logp - batch.behav_logp)[batch.loss_mask.bool()].abs()
            metrics = {"logprob_mismatch_mean": diff.mean().item() if diff.numel() else 0.0,
                       "logprob_mismatch_max": diff.max().item() if diff.numel() else 0.0}
        perm = torch.randperm(batch.size).tolist()
        chunks = [perm[i :: self.tcfg.updates_per_step] for i in range(self.tcfg.updates_per_step)]
        totals: dict[str, float] = {}
        for chunk in chunks:
            mini = batch.select(chunk)
            self.opt.zero_grad(set_to_none=True)
            t = torch.tensor(chunk)
            n_tok = mini.loss_mask.sum().item()
            sums = self.accumulate(
                mini, None if single else old_logp[t], None if ref_logp is None else ref_logp[t], n_tok,
                float(mini.size), version,
            )
            if single:
                metrics = {"logprob_mismatch_mean": sums["mismatch_sum"] / max(sums["mismatch_tokens"], 1.0),
                           "logprob_mismatch_max": sums["mismatch_max"]}
            scale, ess = ess_lr_scale(sums.pop("seq_log_w"))
            sums["ess_frac"] = (ess / mini.size).item()
            del sums["mismatch_sum"], sums["mismatch_max"], sums["mismatch_tokens"]
            gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.tcfg.grad_clip)
            sums["grad_norm"] = gn.item()
            lr_scale = scale.item() if self.acfg.ess_lr_scale else 1.0
            for g in self.opt.param_groups:  # the scheduler sets the next step's lr afresh
                g["lr"] *= lr_scale
            sums["lr"] = self.opt.param_groups[0]["lr"]
            self.opt.step()
            self.sched.step()
            for k, v in sums.items():
                totals[k] = totals.get(k, 0.0) + v / len(chunks)
        self.model.eval()
        return {**metrics, **totals}

    def state_dict(self) -> dict:
        return {"optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        self.opt.load_state_dict(sd["optimizer"])
        self.sched.load_state_dict(sd["scheduler"])
