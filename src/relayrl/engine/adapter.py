"""Adapter-only weight updates for the hf engines (``model.lora``): the engine keeps its base weights,
and each ``load_weights`` brings the adapter's tensors only (PEFT's saved names, ``lora_weights.lora_pairs``).

Merged decoding: every target module's weight becomes W_base + (alpha / r)·B·A, computed in float32 from
a copy of its base weight kept here (taken when the engine starts, from the base model as loaded, in
model.dtype, and kept in the host's memory: the engine's device holds its own weights only, where a float32
copy beside a bf16 GPU engine's weights tripled them) and cast to the engine's dtype (``rollout.dtype``) as
it is written, one module at a time. Decoding then runs on plain weights at the
speed of the base model, with relayrl's fused forward too (``fast_decode``: the weight is written in place,
into the fused tensor it is a view of); the update costs one [out, r]·[r, in] product per module. Each
update starts from the base copy, never from the weights as they are, so loading the same version twice
(a restarted engine, a resumed run) cannot apply the adapter twice, and an adapter that names other
modules than the engine's targets, or misses one, is refused rather than applied in part.

A mixture of experts' fused expert tensors (``model.lora.experts``: PEFT's ``target_parameters``) merge the same
way, one B·A per expert (``lora_weights.expert_delta``).

One adapter per role (``model.lora.per_role``: an update's tensors named "<role>::..."): the engine keeps every
role's tensors and has one merged at a time; a batch decodes requests of one role (``GenRequest.adapter``) and
``use`` merges that role's adapter when it is not the one merged already, at the cost of one update.
"""

from __future__ import annotations

import re

import torch

from relayrl.engine.base import EngineError
from relayrl.lora_weights import LoraSpec, by_adapter, expert_delta, expert_params, lora_pairs, merged_weight


class AdapterMerge:
    """The target modules of an engine's ``model`` (``spec.targets``), their base weights (as loaded, on the CPU), and
    ``apply``, which writes base + scale·B·A into them. Made before the model is cast to the engine's
    dtype and moved to its device (``spec.build_local_engine``): it holds the modules, whose parameters
    stay the same objects through ``model.to``."""

    def __init__(self, model, spec: LoraSpec):
        self.spec = spec
        self.modules = {name: m for name, m in model.named_modules()
                        if name.rpartition(".")[2] in spec.targets and isinstance(m, torch.nn.Linear)
                        and not (spec.exclude and re.fullmatch(spec.exclude, name))}
        self.experts = expert_params(model, spec.parameters)  # (model.lora.experts) saved name -> (module, tensor)
        if not self.modules or spec.parameters and not self.experts:
            raise EngineError(f"model.lora: the adapter's targets ({', '.join(spec.targets + spec.parameters)}) are "
                              "not all in the engine's model")
        with torch.no_grad():
            self.base = {name: self._weight(name).detach().to("cpu", copy=True) for name in [*self.modules, *self.experts]}
        self.roles: dict[str, dict] = {}  # model.lora.per_role: each role's pairs, one of them merged (``merged``)
        self.merged: str | None = None
        self.switches = 0  # merges of another role's adapter between batches (per role)

    def apply(self, adapter: dict[str, torch.Tensor]) -> None:
        """An update: the one adapter merged now, or (per role) every role's kept, the one merged re-merged."""
        try:
            per = by_adapter(adapter)
            roles = {name: self._checked(lora_pairs(t)) for name, t in per.items()}
        except ValueError as e:
            raise EngineError(f"adapter update: {e}") from None
        if None in roles:
            if self.roles:
                raise EngineError("adapter update: one adapter, where the engine holds one per role")
            return self._merge(roles[None])
        self.roles = roles
        self.use(self.merged if self.merged in roles else next(iter(roles)), force=True)

    def use(self, role: str | None, force: bool = False) -> None:
        """Decode under ``role``'s adapter from here (per role; None, or one adapter: nothing to do)."""
        if not self.roles:
            return
        if role is None:
            raise EngineError("a request names no role (GenRequest.adapter), and the engine holds one adapter per "
                              f"role ({', '.join(self.roles)})")
        if role == self.merged and not force:
            return
        if role not in self.roles:
            raise EngineError(f"a request's role {role!r} has no adapter on the engine (roles: {', '.join(self.roles)})")
        self._merge(self.roles[role])
        self.merged = role
        self.switches += not force

    def _weight(self, name: str) -> torch.Tensor:
        if name in self.modules:
            return self.modules[name].weight
        module, tensor = self.experts[name]
        return getattr(module, tensor)

    def _shapes(self, name: str) -> tuple[tuple, tuple]:
        """The A and B a target's weight takes: [r, in] and [out, r]; a fused expert tensor's [r·E, in], [out, r·E]."""
        w, r = self._weight(name), self.spec.r
        if name in self.modules:
            return (r, w.shape[1]), (w.shape[0], r)
        e, d1, d2 = w.shape
        fan_in, fan_out = (d1, d2) if getattr(self.experts[name][0], "is_transposed", False) else (d2, d1)
        return (r * e, fan_in), (fan_out, r * e)

    def _checked(self, pairs: dict) -> dict:
        targets = {*self.modules, *self.experts}
        unknown, missing = sorted(set(pairs) - targets), sorted(targets - set(pairs))
        if unknown or missing:
            raise EngineError(f"adapter update: its modules are not the engine's targets (not targets: {unknown[:3]}, "
                              f"targets without an update: {missing[:3]}); the engine keeps its weights")
        for name, (a, b) in pairs.items():
            w, (sa, sb) = self._weight(name), self._shapes(name)
            if a.shape != sa or b.shape != sb:
                raise EngineError(f"adapter update: {name}: A {tuple(a.shape)}, B {tuple(b.shape)} do not fit its "
                                  f"weight {tuple(w.shape)} at rank {self.spec.r}")
        return pairs

    def _merge(self, pairs: dict) -> None:
        with torch.no_grad():
            for name, (a, b) in pairs.items():
                w = self._weight(name)
                base = self.base[name].to(w.device, torch.float32)  # (its float32 base on the device while it merges)
                if name in self.modules:
                    w.copy_(merged_weight(base, a, b, self.spec.scale))
                else:
                    transposed = getattr(self.experts[name][0], "is_transposed", False)
                    w.copy_(base + expert_delta(a.to(w.device), b.to(w.device), w.shape, transposed, self.spec.scale))
