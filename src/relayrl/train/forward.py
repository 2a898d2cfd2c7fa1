"""How the trainer runs its models and reads log-probs off them: the models made ready once (``prepare``: the
output projection patched for the chunked readout or trainer.bf16's float32 head, each checked against the model's
own numbers, activation checkpointing, the device, FSDP2), and the forward passes (``PolicyForward``): micro-batches
by the token budget, padded or packed (``packing``), through a group's shared prefix (``shared_prefix``), with
other weights in place of the policy's (``functional_call``, or FSDP's shards swapped in).

The optimiser step (``trainer``) and the alarm's reads under older weights (``mismatch``) both go through it.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from relayrl.config import TrainerCfg
from relayrl.train import checkpointing, distributed
from relayrl.train.batch import TrainBatch, micro_batches
from relayrl.train.logprobs import Readout, check_head, install_head
from relayrl.train.packing import Packed, check_packing
from relayrl.train.shared_prefix import PrefixSharing


def prepare(model, ref, tcfg: TrainerCfg, readout: Readout, device: torch.device):
    """``model`` (the policy) and ``ref`` (a frozen KL reference, or None) made ready to train on ``device``; the
    FSDP group where trainer.fsdp (None: this process trains alone)."""
    checkpointed = checkpointing.wanted(tcfg.gradient_checkpointing, model)
    for m in (model, ref):
        if m is not None and (tcfg.bf16 or tcfg.logprob_chunk_tokens):
            install_head(m, float32=tcfg.bf16)  # (the float32 head of trainer.bf16, and the chunked readout)
            if tcfg.logprob_chunk_tokens and m is model:  # (once: the chunked head against the model's own logits)
                check_head(m, readout)
            # (the CPU's bfloat16 SDPA backward: 2.4x its float32 time; but eager attention holds T x T
            # probabilities per head: where memory is asked for, checkpointing, SDPA keeps it linear)
            if tcfg.bf16 and device.type == "cpu" and not checkpointed:
                m.set_attn_implementation("eager")
    if tcfg.pack:  # (once: packed rows against padded ones, on the model itself)
        check_packing(model)
    # (the policy only: the reference runs under no_grad, where a checkpointed layer would run plainly anyway)
    if checkpointed:
        checkpointing.enable(model)
    dp = distributed.setup(device) if tcfg.fsdp else None
    for m in (model, ref):
        if m is not None:
            m.to(device)
            if dp:
                distributed.shard(m)
    return dp


class PolicyForward:
    """The forward passes of the policy (``model``) and of other models of its shape (the KL reference)."""

    def __init__(self, model, tcfg: TrainerCfg, readout: Readout, device: torch.device, dp=None):
        self.model, self.tcfg, self.readout, self.device, self.dp = model, tcfg, readout, device, dp
        # (FSDP: every rank runs its share of the micro-batches in step with the others: the plain forward;
        # config refuses trainer.share_prefix set with trainer.fsdp)
        self.sharing = PrefixSharing(tcfg.share_prefix and dp is None, tcfg.micro_batch_tokens,
                                     log=lambda m: warnings.warn(m, stacklevel=3))

    def micro_batches(self, batch: TrainBatch) -> list[list[int] | None]:
        """This rank's micro-batches of ``batch`` (None: a pass with no rows, to keep in step)."""
        groups = micro_batches(batch, self.tcfg.micro_batch_tokens, packed=self.tcfg.pack)
        return self.dp.share(groups) if self.dp else groups

    def logits(self, model, mb: TrainBatch, params: dict | None = None, entropy: bool = False) -> torch.Tensor:
        """[k, L-1, X]: logits, or (chunked) (log-prob, entropy) on the trained positions (0 elsewhere); the
        rows forwarded padded, or (``trainer.pack``) as one sequence of their real tokens (``packing``)."""
        pad = lambda x: torch.nn.functional.pad(x, (0, 1))  # noqa: E731 (the last position predicts nothing)
        targets, trained = pad(mb.input_ids[:, 1:]), pad(mb.loss_mask.bool())
        call = self.caller(model, params)
        if not self.tcfg.pack:
            with self.readout.context(model, targets, trained, entropy):
                return call(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits[:, :-1]
        p = Packed(mb.attention_mask)
        with self.readout.context(model, p.flat(targets), p.flat(trained), entropy):
            out = call(input_ids=p.flat(mb.input_ids), position_ids=p.position_ids, use_cache=False).logits
        return p.unflat(out)[:, :-1]

    @staticmethod
    def caller(model, params: dict | None):
        """How ``model`` is run: itself, or (``params``) the same module with other weights."""
        if params is None:
            return lambda **kw: model(**kw)
        return lambda **kw: torch.func.functional_call(model, params, (), kw)

    def prefix_call(self, model, params: dict | None = None, entropy: bool = False):
        """How ``Prefixes`` runs ``model``: its prefixes' pass (targets None) and suffixes' (targets, trained)."""
        caller = self.caller(model, params)

        def call(targets=None, **kw):
            with self.readout.context(model, *(targets or (None, None)), entropy):
                return caller(**kw)

        return call

    def passes(self, model, batch: TrainBatch, grad: bool, params: dict | None = None, entropy: bool = False):
        """(micro-batches, outputs of one: ``logits``'): through the group's shared prefixes where
        ``trainer.share_prefix`` finds some (``shared_prefix``: the prefixes forwarded once, here), else the
        plain forward of each."""
        call = self.prefix_call(model, params, entropy)
        pre = self.sharing.prefixes(model, batch, grad, call) if self.dp is None else None
        if pre is None:
            return self.micro_batches(batch), None, lambda idx, mb: self.logits(model, mb, params, entropy)
        return pre.micro_batches(self.tcfg.micro_batch_tokens), pre, lambda idx, mb: pre.outputs(idx)

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, model=None, params: dict | None = None) -> torch.Tensor:
        """Per-token log-probs [N, L-1] of ``batch`` under ``model`` (default: the policy, with
        ``params`` instead of its own weights if given), no grad, without dropout; on the CPU, on every rank."""
        model = model or self.model
        out = torch.zeros_like(batch.behav_logp)
        was = model.training
        model.eval()  # (the engine samples without dropout, model.lora.dropout's included: so are these read)
        with self.swapped(params) if self.dp and params is not None else contextlib.nullcontext():
            groups, _, outputs_of = self.passes(model, batch, False, None if self.dp else params)
            for idx in groups:
                if idx is None:  # (FSDP) this rank has no rows left: a forward all the same
                    self.logits(model, batch.select([0]).to(self.device))
                    continue
                mb = batch.select(idx).to(self.device)
                lp, _ = self.readout.split(outputs_of(idx, mb), mb.input_ids[:, 1:])
                out[torch.tensor(idx), : lp.shape[1]] = lp.cpu()
        model.train(was)
        if self.dp:  # each rank filled its own rows
            out = self.dp.reduce(out)
        return out * batch.loss_mask

    @contextlib.contextmanager
    def swapped(self, params: dict):
        """(FSDP) The policy with ``params`` (shards, by name) in place of its weights, copied in and
        back: FSDP2 gathers a layer's own parameters for its forward, so ``functional_call``'s
        substitutes would be ignored."""
        distributed.reshard(self.model)
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
