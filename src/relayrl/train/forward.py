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
from relayrl.models import moe, vision
from relayrl.train import checkpointing, distributed, lora
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
                distributed.shard(m, unused=bool(lora.adapter_names(m)))
    return dp


class PolicyForward:
    """The forward passes of the policy (``model``) and of other models of its shape (the KL reference)."""

    def __init__(self, model, tcfg: TrainerCfg, readout: Readout, device: torch.device, dp=None,
                 routing_replay: str = "off", router_aux: bool = False):
        self.model, self.tcfg, self.readout, self.device, self.dp = model, tcfg, readout, device, dp
        # a mixture of experts: each forward's routers compared with (algo.routing_replay=r3: replaced by) the
        # routes the engine recorded (``models.moe.Replayer``), one per model forwarded (the policy, the reference)
        self.moe = moe.replayable(model)
        if routing_replay != "off" and moe.is_moe(model):
            moe.routers(model)  # (raises, naming the router, where relayrl has no recipe for it)
        self.routing_replay, self.router_aux, self._replayers = routing_replay, router_aux, {}
        # (FSDP: every rank runs its share of the micro-batches in step with the others: the plain forward;
        # config refuses trainer.share_prefix set with trainer.fsdp; a mixture of experts' routes, under r3, are
        # replayed per row, not through a shared prefix's cache)
        replayed = self.moe and routing_replay == "r3"
        # model.lora.per_role: the roles' adapters, each micro-batch forwarded under its rows' (no prefix shared
        # across rows: two roles' rows see one prompt through different adapters)
        self.adapters = lora.adapter_names(model)
        self.sharing = PrefixSharing(tcfg.share_prefix and dp is None and not replayed and not self.adapters,
                                     tcfg.micro_batch_tokens,
                                     log=lambda m: warnings.warn(m, stacklevel=3))

    def route_stats(self, batch: TrainBatch, version: int | None = None, rows: int = 16) -> dict[str, float]:
        """The policy's routing against the engine's, by a forward of ``rows`` rows of ``batch`` routed live (the
        step's own forwards, under r3, follow the recorded routes: a live choice there is made on replayed hidden
        states): ``moe/routing_diff``, the share of tokens with a recorded route whose live expert set differs from
        it in some layer, and ``moe/load_max_over_mean``. Called before the update, on rows sampled wholly by
        ``version`` (the weights the trainer holds; None: every row): an older version's routes differ by the
        policy's own drift, which is no engine mismatch. Nothing (no metric) when no row is that fresh."""
        if not self.moe or batch.routes is None:
            return {}
        if version is not None:
            trained = batch.loss_mask.bool()
            fresh = ((batch.versions == version) | ~trained).all(1) & trained.any(1)
            batch = batch.select(torch.nonzero(fresh).flatten().tolist()) if fresh.any() else None
            if batch is None:
                return {}
        self._routes(self.model, None, None)  # (the policy's replayer, made where it was not yet)
        r = self._replayers[id(self.model)][1]
        replace, r.replace, r.measuring = r.replace, False, True
        try:
            with torch.no_grad():
                self.logits(self.model, batch.select(list(range(min(rows, batch.size)))).to(self.device))
        finally:
            r.replace, r.measuring = replace, False
        return r.stats.take()

    def aux_loss(self) -> torch.Tensor | None:
        """algo.router_aux_coef: the policy's last forward's load-balancing loss (``moe.aux_loss``)."""
        r = self._replayers.get(id(self.model))
        return moe.aux_loss(r[1].kept) if r is not None and r[1].kept else None

    def routes_done(self) -> None:
        """The micro-batch's forward and backward are over: forwards from here route live until routes are given
        again (a forward with other inputs, such as a check's, must not meet this one's routes)."""
        for _, r in self._replayers.values():
            r.use(None)

    def close(self) -> None:
        for _, r in self._replayers.values():
            r.close()
        self._replayers = {}

    def _routes(self, model, routes: torch.Tensor | None, params: dict | None) -> None:
        """The routes (``[T, layers, k]``, flattened as the forward's tokens) of ``model``'s next forward (counted
        in ``route_stats`` under its own weights only)."""
        if not self.moe:
            return
        if id(model) not in self._replayers:  # (the model kept with it: its id stays its own)
            moe.no_jitter(model)
            self._replayers[id(model)] = (model, moe.Replayer(model, self.routing_replay == "r3"))
            self._replayers[id(model)][1].keep_logits = self.router_aux and model is self.model
        r = self._replayers[id(model)][1]
        r.use(routes, count=r.measuring and params is None)

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
        if mb.adapter is not None and self.adapters and lora.is_adapter(model):
            lora.use_adapter(model, self.adapters[int(mb.adapter[0])])
        if not self.tcfg.pack:
            self._routes(model, None if mb.routes is None else mb.routes.flatten(0, 1), params)
            with self.readout.context(model, targets, trained, entropy):
                out = call(**vision.inputs(model, mb.input_ids, mb.images), attention_mask=mb.attention_mask,
                           use_cache=False).logits[:, :-1]
        else:
            p = Packed(mb.attention_mask)
            self._routes(model, None if mb.routes is None else p.flat(mb.routes)[0], params)
            with self.readout.context(model, p.flat(targets), p.flat(trained), entropy):
                ids = {k: p.flat(v) for k, v in vision.inputs(model, mb.input_ids, mb.images).items()}  # (row by row)
                out = p.unflat(call(**ids, position_ids=p.position_ids, use_cache=False).logits)
            out = out[:, :-1]
        if not torch.is_grad_enabled():  # (no backward to come: nothing to recompute)
            self.routes_done()
        return out

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
        pre = self.sharing.prefixes(model, batch, grad, call) if self.dp is None and not batch.images else None
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
