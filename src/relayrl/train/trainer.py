"""The trainer: recompute π_old, then PPO-style updates with micro-batching by a token budget.

It knows nothing of engines or the loop: it takes a ``TrainBatch`` and returns metrics.
Aggregation uses counts over the whole optimiser (mini-)batch, so gradients do not depend on
how the batch is split into micro-batches (tested).

Placement (``distributed.py``): the policy and the KL reference live on ``trainer.device``, each
micro-batch is moved there, and everything returned (log-probs, metrics, ``full_state_dict``) is
on the CPU. Weights and activations keep ``model.dtype`` (the engine samples in that dtype, so the
trainer's log-probs match its own; they are taken in float32 from the logits), unless
``trainer.bf16``: the forward and backward under bfloat16 autocast, the output
projection in float32 (``logprobs.install_head``: logits rounded to bfloat16's 8 bits would move every
log-prob by up to a few hundredths; MiniMax-M1 traced a training-inference mismatch to it), and on
a CPU the attention as matrix products (transformers' eager attention: the flash kernel's bfloat16
backward took 2.4x its float32 time there), unless checkpointing is on: eager attention holds every
head's T × T probabilities (two rows of 4,096 tokens of the 0.5B shape: 19.5 GiB and 14 tokens/s, SDPA
9.8 GiB and 37). With
``trainer.fsdp`` the weights are sharded over the torchrun ranks and each rank runs its share of
the micro-batches; rank 0 leads, sending each call to the other ranks first.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time

import torch

from relayrl.train import distributed, host_memory, lora
from relayrl.algos import AGGREGATIONS, CORRECTIONS, ESTIMATORS, NEEDS_CRITIC, POLICY_LOSSES, kl_penalty, lookup
from relayrl.algos.estimators import GROUP_BASELINE, over_episodes
from relayrl.algos.estimators import Knobs as EstimatorKnobs
from relayrl.algos.losses import count_seqs
from relayrl.algos.offpolicy import Knobs as CorrectionKnobs
from relayrl.algos.offpolicy import ess_lr_scale
from relayrl.algos.shaping import fold_kl
from relayrl.train.batch import TrainBatch, build_batch, micro_batches
from relayrl.config import AlgoCfg, TrainerCfg
from relayrl.fault_injection import fault_point
from relayrl.train.forward import PolicyForward, prepare
from relayrl.train.logprobs import Readout
from relayrl.train.mismatch import VersionCheck, mismatch_sums, sampled_by
from relayrl.train.shared_prefix import PrefixSharing

__all__ = ["Trainer", "TrainBatch", "build_batch", "micro_batches", "lr_lambda"]

# the metrics summed over micro-batches (each a token-share of the optimiser batch, or a loss part)
LOSS_METRICS = ("clip_frac", "clip_frac_dual", "offpolicy/weight_mean", "offpolicy/masked_frac")


def lr_lambda(warmup_steps: int, schedule: str, total_steps: int):
    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        if schedule == "constant":
            return 1.0
        frac = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 1.0 - frac if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * frac))

    return f


class Trainer:
    """The policy's optimiser steps, and around them what the step composes by name (``relayrl.algos``):
    the advantage estimator (at training time, with the critic's values when it needs them), the
    policy loss, the off-policy correction, the aggregation, and the KL as a loss term or in the
    reward. ``critic`` (``critic.Critic``) is trained on the same batch after the policy."""

    def __init__(self, model, tcfg: TrainerCfg, acfg: AlgoCfg, temperature: float, total_steps: int, norm_len: int,
                 ref_model=None, top_p: float = 1.0, top_k: int = 0, mismatch_rows: int = 16, critic=None,
                 group_size: int = 8, check_rows: int = 0, teacher_coef: float = 0.0):
        self.model, self.tcfg, self.acfg = model, tcfg, acfg
        self.temperature, self.norm_len = temperature, norm_len
        self.top_p, self.top_k = top_p, top_k  # the engine's truncation, reproduced (sampling.py)
        # the weights of one version ago, to measure the engine-trainer mismatch on tokens they sampled
        # the engine-trainer mismatch under the weights of one version ago (``mismatch_rows`` rows of tokens that
        # old), and ``check_rows`` fresh rows against this version's and the previous one's (run.mismatch_alarm)
        self.versions = VersionCheck(mismatch_rows, check_rows)
        self.ref = None
        # model.lora: a PEFT-wrapped ``model`` (train.lora), its adapter trained; the KL reference is it with the adapter off
        self.adapter = lora.is_adapter(model)
        self.ref_is_base = self.adapter and acfg.kl_coef > 0
        if acfg.kl_coef > 0 and not self.adapter:  # frozen reference: the given model, else a copy of the policy now
            self.ref = (ref_model or copy.deepcopy(model)).eval().requires_grad_(False)
        self.device = distributed.resolve_device(tcfg.device)
        if self.device.type == "cpu":  # (freed hidden-state-sized blocks back to the system: host_memory)
            host_memory.release_large_blocks()
        # the log-probs: whole logits, or (trainer.logprob_chunk_tokens) the head chunk by chunk (logprobs.py)
        self.readout = Readout(tcfg.logprob_chunk_tokens, temperature, top_k, top_p)
        self.dp = prepare(model, self.ref, tcfg, self.readout, self.device)  # None: this process trains alone
        # (FSDP: every rank runs its share of the micro-batches in step with the others: the plain forward;
        # config refuses trainer.share_prefix set with trainer.fsdp)
        self.fwd = PolicyForward(model, tcfg, self.readout, self.device, self.dp, acfg.routing_replay,
                                 router_aux=acfg.router_aux_coef > 0)
        self.params = [p for p in model.parameters() if p.requires_grad]  # (with an adapter: its tensors only)
        self.opt = torch.optim.AdamW(  # after sharding: it holds this rank's shards
            self.params, lr=tcfg.lr, betas=tcfg.betas, weight_decay=tcfg.weight_decay
        )
        total = total_steps * tcfg.updates_per_step
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(tcfg.warmup_steps, tcfg.schedule, total))
        self.loss_fn = lookup(POLICY_LOSSES, acfg.loss, "policy loss")
        self.agg_fn = lookup(AGGREGATIONS, acfg.agg, "aggregation")
        self.correction = lookup(CORRECTIONS, acfg.offpolicy, "off-policy correction")
        self.knobs = CorrectionKnobs(acfg.tis_cap, acfg.tis_level, acfg.m2po_tau)
        self.clip = acfg.clip()
        self.estimator = ESTIMATORS.get(acfg.advantage)  # None: advantages come with the batch (GiGPO)
        # rollout.group_size: a group of one is alone by choice (1) or because the others failed (estimators.lone)
        self.est_knobs = EstimatorKnobs(acfg.discount(), acfg.lam, acfg.evpo_level, group_size)
        self.kl_in_reward = (self.ref is not None or self.ref_is_base) and acfg.kl_mode == "reward"
        self.critic = critic
        self.teacher_coef = teacher_coef  # on-policy distillation: λ of the teacher's per-token term (batch.teacher_logp)
        if (acfg.advantage in NEEDS_CRITIC) != (critic is not None):
            raise ValueError(f"algo.advantage={acfg.advantage!r} {'needs a' if critic is None else 'takes no'} critic")

    @property
    def _leads(self) -> bool:
        """Rank 0 of an FSDP run: its calls are sent to the other ranks first."""
        return self.dp is not None and self.dp.leads

    @property
    def adapters(self) -> tuple[str, ...]:
        """model.lora.per_role: the roles whose adapters train (a batch's rows name theirs); () with one or none."""
        return self.fwd.adapters

    @property
    def sharing(self) -> PrefixSharing:
        return self.fwd.sharing

    def logprobs(self, batch: TrainBatch, model=None, params: dict | None = None) -> torch.Tensor:
        """Per-token log-probs [N, L-1] of ``batch`` under ``model`` (default: the policy, with ``params`` instead
        of its own weights if given): ``PolicyForward.logprobs``."""
        return self.fwd.logprobs(batch, model, params)

    # -- one optimiser step ----------------------------------------------------------------
    def accumulate(self, batch: TrainBatch, old_logp, ref_logp, num_tokens: float, num_seqs: float,
                   version: int | None = None, keep: torch.Tensor | None = None) -> dict:
        """Forward/backward over micro-batches of ``batch``; loss normalised by the global counts given.

        Tokens sampled by an older policy than ``version`` (continued partial rollouts, periodic and
        async batches) are corrected by ``algo.offpolicy`` (algorithms.md §2). Every term depends only
        on its own row (and a correction's batch mask, ``keep``, is computed over the whole optimiser
        batch), so the gradient does not depend on how rows are split into micro-batches.
        ``ref_logp``: the reference's log-probs for the KL loss term (None: no KL term)."""
        sums = {"loss": 0.0, **{k: 0.0 for k in LOSS_METRICS}, "kl": 0.0, "entropy_sum": 0.0, "entropy_tokens": 0.0,
                "teacher_rkl_sum": 0.0, "mismatch_sum": 0.0,
                "mismatch_max": 0.0, "mismatch_tokens": 0.0, "seq_log_w": torch.zeros(batch.size),
                **({"moe/aux_loss": 0.0} if self.acfg.router_aux_coef and self.fwd.moe else {})}
        a = self.acfg
        dev = self.device
        groups, prefixes, outputs_of = self.fwd.passes(self.model, batch, True, entropy=True)
        for idx in groups:
            if idx is None:  # (FSDP) this rank has no rows left: a zero-loss pass, as FSDP needs every rank's
                (self.fwd.logits(self.model, batch.select([0]).to(dev)).sum() * 0).backward()
                continue
            mb = batch.select(idx).to(dev)
            t = torch.tensor(idx)
            L = mb.loss_mask.shape[1]
            fault_point("train")
            logp, entropy = self.readout.split(outputs_of(idx, mb), mb.input_ids[:, 1:], bool(a.entropy_coef))
            # on-policy single update: π_old is the current policy, so this forward gives it for free
            old = logp.detach() if old_logp is None else old_logp[t, :L].to(dev)
            if mb.teacher_logp is not None and self.teacher_coef:
                mb, rkl = self._distilled(mb, old)
                sums["teacher_rkl_sum"] += rkl
            stale = (mb.versions < version) & mb.loss_mask.bool() if version is not None else None
            with torch.no_grad():
                fresh = mb.loss_mask if version is None else sampled_by(mb.versions, mb.loss_mask, version)
                diff = (logp.detach() - mb.behav_logp).abs() * fresh
                sums["mismatch_sum"] += diff.sum().item()
                sums["mismatch_tokens"] += fresh.sum().item()
                sums["mismatch_max"] = max(sums["mismatch_max"], diff.max().item())
                # log importance weight π_old/π_behav of each sequence, for the effective sample size
                sums["seq_log_w"][t] = ((old.detach() - mb.behav_logp) * mb.loss_mask).sum(1).cpu()
            per_tok, m = self._policy_loss(logp, old, mb, stale, None if keep is None else keep[t, :L].to(dev))
            agg = lambda x: self.agg_fn(x, mb.loss_mask, num_tokens, num_seqs, self.norm_len)  # noqa: E731
            loss = agg(per_tok)
            if ref_logp is not None:
                kl = agg(kl_penalty(logp, ref_logp[t, :L].to(dev), a.kl_estimator))
                loss = loss + a.kl_coef * kl
                sums["kl"] += kl.item()
            if a.entropy_coef:
                loss = loss - a.entropy_coef * agg(entropy)
            aux = self.fwd.aux_loss() if a.router_aux_coef else None
            if aux is not None:  # (a mixture of experts' load balance, weighted by the micro-batch's share of tokens)
                part = mb.loss_mask.sum().item() / max(num_tokens, 1.0)
                loss = loss + a.router_aux_coef * aux * part
                sums["moe/aux_loss"] += aux.item() * part
            loss.backward()
            self.fwd.routes_done()  # (after the backward: a checkpointed layer's recompute replays them too)
            share = mb.loss_mask.sum().item() / max(num_tokens, 1.0)
            sums["loss"] += loss.item()
            sums["entropy_sum"] += (entropy.detach() * mb.loss_mask).sum().item()  # (reported: the token mean)
            sums["entropy_tokens"] += mb.loss_mask.sum().item()
            for k in LOSS_METRICS:
                sums[k] += float(m[k]) * share
        if prefixes is not None:  # the micro-batches' gradient for the shared prefixes, through their pass once
            prefixes.backward()
        sums = self._gather_sums(sums) if self.dp else sums
        rkl = sums.pop("teacher_rkl_sum")
        if batch.teacher_logp is not None and self.teacher_coef:
            sums["teacher/reverse_kl"] = rkl / max(sums["entropy_tokens"], 1.0)
        sums["entropy"] = sums.pop("entropy_sum") / max(sums.pop("entropy_tokens"), 1.0)  # over the rows forwarded
        return sums

    def _gather_sums(self, sums: dict) -> dict:
        """(FSDP) Every rank's share of the sums, added up (the largest mismatch: the largest)."""
        keys = ["loss", *LOSS_METRICS, "kl", "entropy_sum", "entropy_tokens", "teacher_rkl_sum", "mismatch_sum",
                "mismatch_tokens", *(["moe/aux_loss"] if "moe/aux_loss" in sums else [])]
        total = self.dp.reduce(torch.tensor([sums[k] for k in keys], dtype=torch.float64))
        out = {k: v.item() for k, v in zip(keys, total)}
        out["mismatch_max"] = self.dp.reduce(torch.tensor(sums["mismatch_max"]), "max").item()
        out["seq_log_w"] = self.dp.reduce(sums["seq_log_w"])  # each rank filled its own rows
        return out

    def _distilled(self, mb: TrainBatch, old: torch.Tensor) -> tuple[TrainBatch, float]:
        """On-policy distillation: each trained token's advantage plus teacher.coef × (log π_teacher − log π_old),
        the per-token reverse KL's policy gradient, undiscounted (Thinking Machines' OPD; tinker's
        kl_discount_factor 0), not normalised by the group (SkyRL #2256: that would z-score it away); π_old, not
        the behaviour policy, so a stale token's term has no staleness bias (the correction's ratio handles it).
        Also Σ (log π_old − log π_teacher) over the trained tokens: the reverse KL's estimate."""
        gap = (mb.teacher_logp - old) * mb.loss_mask
        return dataclasses.replace(mb, advantages=mb.advantages + self.teacher_coef * gap), -gap.sum().item()

    def _policy_loss(self, logp, old, mb: TrainBatch, stale, keep):
        """Per-token loss: ``algo.loss`` against the anchor ``algo.offpolicy`` names, times its weight."""
        mask = mb.loss_mask
        anchor, weight, trust_region = self.correction.apply(old, mb.behav_logp, mb.advantages, mask, stale, keep,
                                                             self.knobs)
        per_tok, m = self.loss_fn(logp, anchor, mb.advantages, mask, *(self.clip if trust_region else (None,) * 3))
        w = torch.ones_like(mask) if weight is None else weight
        n = mask.sum().clamp(min=1)
        m = {**m, "offpolicy/weight_mean": (w * mask).sum() / n, "offpolicy/masked_frac": ((w == 0) * mask).sum() / n}
        return per_tok * w, m

    def _advantages(self, batch: TrainBatch, old_logp, ref_logp) -> tuple[TrainBatch, dict]:
        """The batch with its advantages (and the critic's values and targets) computed now, from its
        token-level rewards (with the KL folded in under ``algo.kl_mode=reward``). A batch that comes
        with its advantages (``rewards`` None: GiGPO's step credit) is returned as it is."""
        w = self.acfg.reward_coef  # (0: pure distillation, the teacher's term alone)
        if batch.rewards is None:
            return (batch if w == 1 else dataclasses.replace(batch, advantages=batch.advantages * w)), {}
        rewards, m = batch.rewards, {}
        if self.kl_in_reward:
            a = self.acfg
            rewards, m = fold_kl(rewards, old_logp, ref_logp, batch.loss_mask, a.kl_coef, a.kl_estimator)
        start = time.perf_counter()
        with torch.autocast(self.device.type, enabled=False):
            values = self.critic.values(batch) if self.critic is not None else None
        if values is not None:
            m["time/critic_values"] = time.perf_counter() - start
        if batch.owner is not None and self.acfg.advantage in GROUP_BASELINE:  # (an agent episode's branches)
            adv, returns, est = over_episodes(self.estimator, rewards, batch.loss_mask, batch.group, batch.owner,
                                              self.est_knobs)
        else:
            adv, returns, est = self.estimator(rewards, batch.loss_mask, batch.group, values, self.est_knobs)
        batch = dataclasses.replace(batch, advantages=adv * batch.loss_mask * w, values=values, returns=returns)
        return batch, {k: float(v) for k, v in {**m, **est}.items()}

    def step(self, batch: TrainBatch, version: int | None = None) -> dict:
        """π_old (and π_ref) log-probs, the advantages, then ``updates_per_step`` optimiser steps over
        mini-batches, then the critic's update.

        With one update per batch of on-policy data, π_old equals the current policy: it is taken
        from the training forward itself (detached) instead of a separate recompute pass (as verl
        does), which saves a third of the training compute. With several updates (or a correction
        whose batch mask needs π_old first, or the KL folded into the reward) π_old is recomputed first."""
        if self._leads:
            self.dp.send("step", batch, version)
        if self.dp is None:
            # (once; in eval mode, where dropout cannot tell them apart; chunked: log-probs, not logits)
            self.sharing.verify(self.model, batch, lambda mb: self.fwd.logits(self.model, mb),
                                call=self.fwd.prefix_call(self.model))
        routing = self.fwd.route_stats(batch, version)  # (a mixture of experts: engine and trainer routing apart, before the update)
        self.model.train()
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.tcfg.bf16):
            totals, mismatch, est_metrics, batch = self._update(batch, version)
        self.model.eval()
        if self.critic is not None:  # (the critic predicts and trains in float32, outside the autocast)
            start = time.perf_counter()
            totals.update(self.critic.step(batch))
            # the critic's share of the step: its values' forward and its update
            totals["time/critic"] = time.perf_counter() - start + est_metrics.pop("time/critic_values")
        n = sum(x[2] for x in mismatch)
        return {"logprob_mismatch_mean": sum(x[0] for x in mismatch) / n if n else None,  # None: nothing checkable
                "logprob_mismatch_max": max(x[1] for x in mismatch) if n else None,
                "logprob_mismatch_tokens": int(n), **est_metrics, **totals, **routing}

    def _update(self, batch: TrainBatch, version: int | None):
        """``step``'s policy part: (metrics, mismatch sums, the estimator's metrics, the batch with advantages)."""
        single = self.tcfg.updates_per_step == 1
        need_old = not single or self.correction.batch_mask is not None or self.kl_in_reward
        old_logp = self.logprobs(batch) if need_old else None
        ref_logp = self._ref_logprobs(batch)
        batch, est_metrics = self._advantages(batch, old_logp, ref_logp)
        loss_ref = None if self.kl_in_reward else ref_logp
        fresh = batch.loss_mask if version is None else sampled_by(batch.versions, batch.loss_mask, version)
        mismatch = [mismatch_sums(old_logp, batch.behav_logp, fresh)] if old_logp is not None else []
        prev_check = self.versions.fresh_against_previous(self.fwd, batch, version)  # (before the previous weights go)
        mismatch.append(self.versions.previous_version(self.fwd, batch, version))
        perm = torch.randperm(batch.size)
        perm = (self.dp.broadcast(perm) if self.dp else perm).tolist()  # (FSDP: rank 0's order on every rank)
        # (a batch left with fewer rows than updates_per_step, after failed episodes were left out: fewer steps)
        chunks = [c for c in (perm[i :: self.tcfg.updates_per_step] for i in range(self.tcfg.updates_per_step)) if c]
        totals: dict[str, float] = {}
        skipped = 0  # rows whose gradient is zero, not forwarded (``_contributing``)
        for chunk in chunks:
            mini = batch.select(chunk)
            self.opt.zero_grad(set_to_none=True)
            t = torch.tensor(chunk)
            keep = None
            if self.correction.batch_mask is not None:  # one mask over the optimiser batch (not per micro-batch)
                log_r = (old_logp[t][:, : mini.loss_mask.shape[1]] - mini.behav_logp) * mini.loss_mask
                keep = self.correction.batch_mask(log_r, mini.advantages, mini.loss_mask, self.knobs)
            # the normalisers are the whole mini-batch's, whichever of its rows go forward
            num_tokens, num_seqs = mini.loss_mask.sum().item(), count_seqs(mini.loss_mask).item()
            rows = self._contributing(mini, loss_ref)
            old, ref = None if single else old_logp[t], None if loss_ref is None else loss_ref[t]
            if rows is not None:
                r = torch.tensor(rows)
                mini, old, ref, keep = (mini.select(rows), None if old is None else old[r], None if ref is None else ref[r],
                                        None if keep is None else keep[r])
            sums = self.accumulate(mini, old, ref, num_tokens, num_seqs, version, keep=keep)
            self._no_gradient_for_idle_adapters(mini)
            skipped += len(chunk) - mini.size
            if old_logp is None:  # measured in the training forward
                mismatch.append((sums["mismatch_sum"], sums["mismatch_max"], sums["mismatch_tokens"]))
            scale, ess = ess_lr_scale(sums.pop("seq_log_w"))
            sums["ess_frac"] = (ess / mini.size).item()
            del sums["mismatch_sum"], sums["mismatch_max"], sums["mismatch_tokens"]
            sums.update(self.apply_gradients(scale.item() if self.acfg.ess_lr_scale else 1.0))
            for k, v in sums.items():
                totals[k] = totals.get(k, 0.0) + v / len(chunks)
        totals["rows_skipped"] = skipped
        return totals, mismatch, {**est_metrics, **prev_check}, batch

    def _no_gradient_for_idle_adapters(self, mini: TrainBatch) -> None:
        """FSDP with an adapter per role: every backward reduced every adapter's gradient, zeros for one a rank did
        not use (``distributed.shard``'s ``unused``); an adapter no row of the mini-batch used has none, as in one
        process, so the optimiser leaves it and its moments alone."""
        if self.dp is None or not self.adapters or mini.adapter is None:
            return
        idle = set(self.adapters) - {self.adapters[i] for i in mini.adapter.unique().tolist()}
        for name, p in self.model.named_parameters():
            if any(f".lora_A.{a}." in name or f".lora_B.{a}." in name for a in idle):
                p.grad = None

    def apply_gradients(self, lr_scale: float = 1.0) -> dict:
        """The optimiser step on the gradients accumulated: clipped to trainer.grad_clip, the learning rate
        times ``lr_scale`` for this step (the scheduler sets the next step's afresh). Its grad_norm and lr."""
        gn = torch.nn.utils.clip_grad_norm_(self.params, self.tcfg.grad_clip)
        out = {"grad_norm": (gn.full_tensor() if self.dp else gn).item()}  # (FSDP: a DTensor, the global norm)
        for g in self.opt.param_groups:
            g["lr"] *= lr_scale
        out["lr"] = self.opt.param_groups[0]["lr"]
        self.opt.step()
        self.sched.step()
        return out

    def sft_step(self, batch: TrainBatch) -> dict:
        """One optimiser step of supervised fine-tuning (``relayrl sft``): the negative log-likelihood of the
        supervised tokens (``batch.loss_mask``), summed over micro-batches and divided by their count over the
        whole batch, so the gradient does not depend on the split (TRL's ``num_items_in_batch``). Built for a
        trainer whose log-probs are the plain softmax (temperature 1, no truncation)."""
        if self._leads:
            self.dp.send("sft_step", batch)
        fault_point("train")  # crash tests: a kill at the n-th step
        n = batch.loss_mask.sum().item()
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        nll = 0.0
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.tcfg.bf16):
            groups, _, outputs_of = self.fwd.passes(self.model, batch, True)
            for idx in groups:
                if idx is None:  # (FSDP) a zero-loss pass, as FSDP needs every rank's
                    (self.fwd.logits(self.model, batch.select([0]).to(self.device)).sum() * 0).backward()
                    continue
                mb = batch.select(idx).to(self.device)
                logp, _ = self.readout.split(outputs_of(idx, mb), mb.input_ids[:, 1:])
                loss = -(logp * mb.loss_mask).sum() / max(n, 1.0)
                loss.backward()
                nll += loss.item()
            if self.dp:
                nll = self.dp.reduce(torch.tensor(nll, dtype=torch.float64)).item()
            out = {"loss": nll, **self.apply_gradients(), "supervised_tokens": int(n)}
        self.model.eval()
        return out

    def _ref_logprobs(self, batch: TrainBatch) -> torch.Tensor | None:
        """The KL reference's log-probs (None: no KL): the frozen model, or the policy with its adapter off."""
        if self.ref_is_base:
            with lora.base_model(self.model):
                return self.logprobs(batch)
        return self.logprobs(batch, self.ref) if self.ref is not None else None

    def _contributing(self, mini: TrainBatch, ref_logp) -> list[int] | None:
        """The rows of ``mini`` whose gradient is not zero: a row whose every trained token has advantage 0
        adds nothing to any policy loss (ℓ ∝ A, whatever the correction's weight), so with no KL loss term,
        no entropy bonus and no ESS-scaled step (terms that would see it) its forward and backward are
        skipped — the normalisers stay the whole mini-batch's, so the gradient is the same. With fixed
        budgets and no dynamic sampling, every group whose responses were all right or all wrong is such.
        None: forward every row (nothing to skip, or nothing left: Adam still steps on a zero gradient)."""
        if ref_logp is not None or self.acfg.entropy_coef or self.acfg.ess_lr_scale or mini.teacher_logp is not None:
            return None
        moves = ((mini.advantages != 0) & mini.loss_mask.bool()).any(1)
        if bool(moves.all()) or not bool(moves.any()):
            return None
        return torch.nonzero(moves).flatten().tolist()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's weights on the CPU, whole, for engines and checkpoints (``model.state_dict()``
        itself when training on the CPU). FSDP: gathered on rank 0 ({} on the others). With an adapter
        (model.lora): the adapter's tensors only, under PEFT's saved names (what engines and checkpoints take)."""
        if self.dp is None:
            if self.adapter:
                return lora.adapter_state(self.model)
            sd = self.model.state_dict()
            return sd if self.device.type == "cpu" else {k: v.detach().cpu() for k, v in sd.items()}
        if self._leads:
            self.dp.send("weights")
        if self.adapter:  # (the adapter's tensors gathered, not the whole model to keep them)
            sd = distributed.full_parameters(self.model, set(lora.trainable(self.model)))
            return lora.adapter_state(self.model, sd) if sd else sd
        return distributed.full_state_dict(self.model)

    def state_dict(self) -> dict:
        """Optimiser and scheduler, and the critic's weights and state. FSDP: the optimiser state by
        parameter name, whole, on rank 0."""
        if self.dp is None:
            sd = {"optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict()}
        else:
            if self._leads:
                self.dp.send("state")
            sd = {"optimizer": distributed.full_optimizer_state(self.model, self.opt),
                  "scheduler": self.sched.state_dict(), "fsdp": True}
        if self.critic is not None:
            sd["critic"] = self.critic.state_dict()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        if bool(sd.get("fsdp")) != (self.dp is not None):
            was = "true" if sd.get("fsdp") else "false"
            raise ValueError(f"the checkpoint's optimiser state was saved with trainer.fsdp={was}: resume with "
                             f"trainer.fsdp={was}")
        if (self.critic is not None) != ("critic" in sd):
            raise ValueError("the checkpoint " + ("has no critic: it was saved by a run without one" if self.critic
                             else "holds a critic: resume with the algo.advantage it was saved with (gae or evpo)"))
        if self.dp is None:
            self.opt.load_state_dict(sd["optimizer"])
        else:
            if self._leads:  # the others get the schedulers; the whole states arrive sharded, below
                crit = {"critic": {"scheduler": sd["critic"]["scheduler"]}} if self.critic is not None else {}
                self.dp.send("load", {"optimizer": {}, "scheduler": sd["scheduler"], "fsdp": True, **crit})
            distributed.load_optimizer_state(self.model, self.opt, sd["optimizer"])
        self.sched.load_state_dict(sd["scheduler"])
        if self.critic is not None:
            self.critic.load_state_dict(sd["critic"])

    def close(self) -> None:
        """(FSDP, rank 0) The other ranks stop following. A mixture of experts' routers lose the replay's hooks."""
        self.fwd.close()
        if self._leads:
            self.dp.send("stop")
