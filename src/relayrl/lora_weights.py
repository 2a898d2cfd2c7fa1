"""A LoRA adapter as the trainer and the engines share it: its shape (``LoraSpec``), its tensors under PEFT's
saved names (``lora_pairs``) and the merged weight W_base + (alpha / r)·B·A (``merged_weight``); on a mixture of
experts' fused expert tensors (``model.lora.experts``, PEFT's ``target_parameters``), one B·A per expert
(``expert_params``, ``expert_delta``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA adapter's shape (``model.lora``), as the trainer and the engines need it: rank, alpha, and the
    target modules (PEFT's ``target_modules``: module-name suffixes such as "q_proj"). With it, an engine's
    ``load_weights(state_dict, version)`` receives the adapter's tensors only, under PEFT's saved names
    (``peft.get_peft_model_state_dict``: "base_model.model.<module>.lora_A.weight" [r, in] and
    ".lora_B.weight" [out, r]); the update of a target weight W is (alpha / r) · B @ A, on the base weights."""

    r: int
    alpha: float
    targets: tuple[str, ...]
    parameters: tuple[str, ...] = ()  # fused experts' 3-D tensors (PEFT's target_parameters: "experts.down_proj")
    adapters: int = 1  # adapters of this shape trained at once: one per role with model.lora.per_role
    exclude: str | None = None  # PEFT's exclude_modules: module names (a full-match regex) left out (a frozen vision tower)

    @property
    def scale(self) -> float:
        return self.alpha / self.r

    def adapter_config(self, base_model: str) -> dict:
        """PEFT's ``adapter_config.json`` for this adapter on ``base_model``."""
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": self.r,
                "lora_alpha": self.alpha, "target_modules": list(self.targets), "lora_dropout": 0.0, "bias": "none",
                "fan_in_fan_out": False, "inference_mode": True,
                **({"target_parameters": list(self.parameters)} if self.parameters else {}),
                **({"exclude_modules": self.exclude} if self.exclude else {})}


PEFT_PREFIX = "base_model.model."  # PEFT's saved names: the wrapper's path, then the base model's own


def lora_pairs(adapter: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module name in the base model (``named_modules``) -> (A [r, in], B [out, r]), from an adapter's tensors
    under PEFT's saved names. A name that is not a LoRA A or B, or a module with only one of the two, is a
    ``ValueError``: an adapter applied in part would sample from neither policy."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in adapter.items():
        for part in ("lora_A", "lora_B"):
            suffix = f".{part}.weight"
            if key.startswith(PEFT_PREFIX) and key.endswith(suffix):
                found.setdefault(key[len(PEFT_PREFIX) : -len(suffix)], {})[part] = t
                break
        else:
            raise ValueError(f"{key!r} is not a LoRA adapter's tensor (PEFT's saved names: "
                             f"{PEFT_PREFIX}<module>.lora_A.weight / .lora_B.weight)")
    lone = [m for m, d in found.items() if len(d) != 2]
    if lone:
        raise ValueError(f"the adapter has only one of lora_A / lora_B for {lone[:3]}")
    return {m: (d["lora_A"], d["lora_B"]) for m, d in found.items()}


def merged_weight(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W = W_base + scale·B·A in float32 (``base``: the base weight, float32), from the base every time:
    merging into weights that already hold an adapter would apply it twice (SkyRL #2250's bug)."""
    return torch.addmm(base, b.to(base.device, torch.float32), a.to(base.device, torch.float32), alpha=scale)


ROLE_SEP = "::"  # model.lora.per_role: one adapter per role, its tensors' names prefixed "<role>::" as they travel


def by_adapter(adapter: dict[str, torch.Tensor]) -> dict[str | None, dict[str, torch.Tensor]]:
    """An update's tensors per adapter: ``{None: adapter}`` for the one adapter of ``model.lora``, or per role
    (``model.lora.per_role``: names "<role>::base_model.model..."). A mix of both is a ``ValueError``."""
    out: dict[str | None, dict[str, torch.Tensor]] = {}
    for key, t in adapter.items():
        name, sep, rest = key.partition(ROLE_SEP)
        out.setdefault(name if sep else None, {})[rest if sep else key] = t
    if None in out and len(out) > 1:
        raise ValueError("the update mixes tensors of one adapter with tensors named per role ('<role>::...')")
    return out


def expert_params(model, parameters: tuple[str, ...]) -> dict[str, tuple[torch.nn.Module, str]]:
    """PEFT's saved module name -> (module, parameter name) for each of ``model``'s tensors that ``parameters``
    (PEFT's ``target_parameters``) names. PEFT wraps a module once per targeted tensor, the first registered
    innermost, so of k tensors on one module the i-th saves under "<module>" + ".base_layer" × (k − 1 − i)
    (tests/test_moe_lora.py checks this against PEFT's own names)."""
    out: dict[str, tuple[torch.nn.Module, str]] = {}
    for name, m in model.named_modules():
        own = [p for p, _ in m.named_parameters(recurse=False)
               if any(f"{name}.{p}" == t or f"{name}.{p}".endswith(f".{t}") for t in parameters)]
        for i, p in enumerate(own):
            out[name + ".base_layer" * (len(own) - 1 - i)] = (m, p)
    return out


def expert_delta(a: torch.Tensor, b: torch.Tensor, weight_shape: torch.Size, transposed: bool,
                 scale: float) -> torch.Tensor:
    """scale·B_e·A_e for every expert e of a fused [E, out, in] tensor (``transposed``: stored [E, in, out], as
    gpt-oss does), float32, from PEFT's layout: A [r·E, in] (expert e's rows e·r … e·r + r − 1), B [out, r·E]
    (expert e's columns e, e + E, …)."""
    e = weight_shape[0]
    a = a.to(torch.float32).reshape(e, -1, a.shape[-1])  # [E, r, in]
    b = b.to(torch.float32).reshape(b.shape[0], -1, e)  # [out, r, E]
    return torch.einsum("ore,eri->eio" if transposed else "ore,eri->eoi", b, a) * scale
