"""The critic: a value model trained beside the policy (``algo.advantage=gae`` or ``evpo``).

A second trainable model, not a branch of the policy's trainer: its own module (a transformer body
with a scalar head), its own optimiser, schedule and gradient clipping (``critic.*``), and its own
state in the checkpoint. The trainer asks it for values V_t of a ``TrainBatch`` at training time
(so a stale sample in async mode gets the current critic's values), computes the advantages and
value targets from them, and hands the batch back for the critic's update: the clipped value loss
over the trained tokens (tool results and template tokens, mask 0, carry none). Placement follows
the policy's: ``trainer.device``, and with ``trainer.fsdp`` sharded the same way (FSDP2 per decoder
layer) with the same micro-batch split, gradients summed across ranks.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn

from relayrl.train import checkpointing, distributed
from relayrl.algos.values import value_loss
from relayrl.train.batch import TrainBatch, micro_batches
from relayrl.models import DTYPES, load_checked
from relayrl.train.packing import Packed
from relayrl.train.shared_prefix import PrefixSharing


class ValueModel(nn.Module):
    """A transformer body (``AutoModel``: the causal LM without its LM head) and a scalar head: a
    value at every position, V_j = head(h_j), the value of the state after token j."""

    def __init__(self, body: nn.Module, seed: int = 0):
        super().__init__()
        self.body = body
        hidden = body.config.hidden_size
        self.head = nn.Linear(hidden, 1, dtype=next(body.parameters()).dtype)
        with torch.no_grad():  # small, seeded on its own generator (the run's random stream is left as it was)
            g = torch.Generator().manual_seed(seed)
            self.head.weight.copy_(torch.randn(self.head.weight.shape, generator=g) / (hidden + 1))
            self.head.bias.zero_()
        self._no_split_modules = getattr(body, "_no_split_modules", None)  # FSDP2's unit: a decoder layer

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = self.body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      use_cache=False).last_hidden_state
        return self.head(h).squeeze(-1).float()


def load_value_model(path: str, dtype: str = "float32", seed: int = 0, field: str = "critic.path") -> ValueModel:
    """The body of the model at ``path`` (a causal LM's weights load without their LM head) with a fresh head."""
    from transformers import AutoModel

    return ValueModel(load_checked(AutoModel.from_pretrained, path, field, "model", dtype=DTYPES[dtype]), seed)


def make_critic(ccfg, tcfg, model_path: str, dtype: str, seed: int, total_steps: int) -> "Critic":
    """The run's critic (``ccfg``: the critic section, ``tcfg``: the trainer's): ``critic.path`` or the
    policy's initial weights (``model_path``) with a fresh head seeded by ``seed``, placed as the policy
    is (``trainer.device``, ``trainer.fsdp``)."""
    from relayrl.models import resolve_model_path

    field = "critic.path" if ccfg.path else "model.path"
    path = resolve_model_path(ccfg.path or model_path, log=lambda *a, **k: None, field=field)
    device = distributed.resolve_device(tcfg.device)
    dp = distributed.setup(device) if tcfg.fsdp else None
    with torch.random.fork_rng(devices=[]):  # building it draws no number from the run's random stream
        model = load_value_model(path, dtype, seed, field)
    return Critic(model, ccfg, tcfg, total_steps, device, dp)


class Critic:
    def __init__(self, model: ValueModel, ccfg, tcfg, total_steps: int, device: torch.device, dp=None):
        """``ccfg``: the critic section; ``tcfg``: the trainer's (betas, weight decay, schedule, micro-batch
        budget); ``dp``: the policy's data-parallel group (None: this process trains alone)."""
        from relayrl.train.trainer import lr_lambda

        self.model, self.ccfg, self.budget, self.device, self.dp = model, ccfg, tcfg.micro_batch_tokens, device, dp
        self.pack = tcfg.pack  # (trainer.pack, as the policy: rows packed end to end, train/packing.py)
        if checkpointing.wanted(tcfg.gradient_checkpointing, model):  # (trainer.gradient_checkpointing, as the policy)
            checkpointing.enable(model)
        model.to(device)
        if dp:
            distributed.shard(model)
        self.opt = torch.optim.AdamW(model.parameters(), lr=ccfg.lr, betas=tcfg.betas, weight_decay=tcfg.weight_decay)
        total = total_steps * ccfg.updates_per_step
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(ccfg.warmup_steps, tcfg.schedule, total))
        # trainer.share_prefix, as the policy's trainer does it: the body reads the prompt through its cache
        self.sharing = PrefixSharing(tcfg.share_prefix and dp is None, self.budget,
                                     log=lambda m: warnings.warn(f"(critic) {m}", stacklevel=3))

    def _micro_batches(self, batch: TrainBatch) -> list[list[int] | None]:
        groups = micro_batches(batch, self.budget, packed=self.pack)
        return self.dp.share(groups) if self.dp else groups

    def _forward(self, mb: TrainBatch) -> torch.Tensor:
        if not self.pack:
            return self.model(mb.input_ids, mb.attention_mask)[:, :-1]
        p = Packed(mb.attention_mask)
        return p.unflat(self.model(p.flat(mb.input_ids), None, p.position_ids))[:, :-1]

    def _head(self, out) -> torch.Tensor:
        return self.model.head(out.last_hidden_state).float()  # [k, S, 1]

    def _passes(self, batch: TrainBatch, grad: bool):
        """(micro-batches, shared prefixes or None, values of one): as ``Trainer._passes``."""
        pre = self.sharing.prefixes(self.model.body, batch, grad, readout=self._head) if self.dp is None else None
        if pre is None:
            return self._micro_batches(batch), None, lambda idx, mb: self._forward(mb)
        return pre.micro_batches(self.budget), pre, lambda idx, mb: pre.outputs(idx).squeeze(-1)

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> torch.Tensor:
        """V [N, L-1] aligned with the per-token tensors, 0 off the loss mask; on the CPU, on every rank."""
        self.model.eval()
        if self.dp is None:  # (once; the body's values through a shared prefix against its plain forward's)
            self.sharing.verify(self.model.body, batch, lambda mb: self._forward(mb).unsqueeze(-1), self._head)
        out = torch.zeros_like(batch.loss_mask)
        groups, _, values_of = self._passes(batch, False)
        for idx in groups:
            if idx is None:  # (FSDP) a forward all the same
                self._forward(batch.select([0]).to(self.device))
                continue
            mb = batch.select(idx).to(self.device)
            v = values_of(idx, mb)
            out[torch.tensor(idx), : v.shape[1]] = v.cpu()
        if self.dp:
            out = self.dp.reduce(out)
        return out * batch.loss_mask

    def step(self, batch: TrainBatch) -> dict:
        """``critic.updates_per_step`` optimiser steps of the clipped value loss toward ``batch.returns``
        (V_old = ``batch.values``), token mean over each mini-batch's trained tokens."""
        self.model.train()
        n = self.ccfg.updates_per_step
        order = torch.randperm(batch.size) if n > 1 else torch.arange(batch.size)
        order = (self.dp.broadcast(order) if self.dp and n > 1 else order).tolist()
        totals: dict[str, float] = {}
        chunks = [c for c in (order[i::n] for i in range(n)) if c]
        for chunk in chunks:
            mini = batch.select(chunk)
            self.opt.zero_grad(set_to_none=True)
            sums = self._accumulate(mini, mini.loss_mask.sum().item())
            gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.ccfg.grad_clip)
            sums["critic/grad_norm"] = (gn.full_tensor() if self.dp else gn).item()
            sums["critic/lr"] = self.opt.param_groups[0]["lr"]
            self.opt.step()
            self.sched.step()
            for k, v in sums.items():
                totals[k] = totals.get(k, 0.0) + v / len(chunks)
        self.model.eval()
        return totals

    def _accumulate(self, batch: TrainBatch, num_tokens: float) -> dict:
        sums = torch.zeros(3, dtype=torch.float64)  # loss, clip_frac, values_mean (each a token mean)
        groups, prefixes, values_of = self._passes(batch, True)
        for idx in groups:
            if idx is None:  # (FSDP) a zero-loss pass: every rank runs as many backwards
                (self._forward(batch.select([0]).to(self.device)).sum() * 0).backward()
                continue
            mb = batch.select(idx).to(self.device)
            v = values_of(idx, mb)
            per_tok, m = value_loss(v, mb.values, mb.returns, mb.loss_mask, self.ccfg.value_clip)
            loss = (per_tok * mb.loss_mask).sum() / max(num_tokens, 1.0)
            loss.backward()
            share = mb.loss_mask.sum().item() / max(num_tokens, 1.0)
            sums += torch.tensor([loss.item(), m["clip_frac"].item() * share,
                                  (v.detach() * mb.loss_mask).sum().item() / max(num_tokens, 1.0)], dtype=torch.float64)
        if prefixes is not None:  # the prompts' share of the gradient, through their one pass
            prefixes.backward()
        if self.dp:
            sums = self.dp.reduce(sums)
        return {"critic/loss": sums[0].item(), "critic/clip_frac": sums[1].item(), "critic/values_mean": sums[2].item()}

    # -- state -----------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Whole weights on the CPU (FSDP: gathered on rank 0, {} elsewhere; a collective)."""
        if self.dp:
            return distributed.full_state_dict(self.model)
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def state_dict(self) -> dict:
        """Weights, optimiser and scheduler (FSDP: whole, on rank 0; a collective)."""
        optim = distributed.full_optimizer_state(self.model, self.opt) if self.dp else self.opt.state_dict()
        return {"weights": self.full_state_dict(), "optimizer": optim, "scheduler": self.sched.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        if self.dp:  # rank 0's whole state onto every rank's shards (the others pass what they have: nothing)
            distributed.load_model_state(self.model, sd.get("weights", {}))
            distributed.load_optimizer_state(self.model, self.opt, sd.get("optimizer", {}))
        else:
            self.model.load_state_dict(sd["weights"])
            self.opt.load_state_dict(sd["optimizer"])
        self.sched.load_state_dict(sd["scheduler"])

    def num_parameters(self) -> int:
        return sum(math.prod(p.shape) for p in self.model.parameters())
