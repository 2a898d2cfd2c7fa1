"""A LoRA adapter on the policy (``model.lora``), through PEFT.

The policy is wrapped by ``peft.get_peft_model`` where it is loaded for training: its own weights are
frozen and only the adapter's A [r, in] and B [out, r] of every target module train (B starts at 0, so
the wrapped model is the base model until the first step). What leaves the trainer is the adapter's
tensors alone, under PEFT's saved names (``adapter_state``: "base_model.model.<module>.lora_A.weight"):
the engines keep the base weights and add (alpha / r)·B·A to them (``engine.adapter``), checkpoints
hold them in PEFT's own files (``write_adapter``: ``adapter_config.json``, ``adapter_model.safetensors``,
what ``PeftModel.from_pretrained`` and vLLM read), and ``export_merged`` folds them into a plain model.

The KL reference is the same model with the adapter switched off (``base_model``: PEFT's
``disable_adapter``), never a second copy: it is the base, exactly, at no memory cost.

``model.lora.per_role``: one adapter per role of a multi-agent environment, PEFT's named adapters on the one
base. A forward runs under one of them (``use_adapter``: each micro-batch holds one role's rows); they leave the
trainer together, their names prefixed "<role>::" (``lora_weights.ROLE_SEP``), and checkpoints hold each in
PEFT's files under ``adapters/<role>/``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from pathlib import Path

import torch

from relayrl.lora_weights import ROLE_SEP, LoraSpec, by_adapter
from relayrl.models import ModelError, vision

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PER_ROLE = "adapters"  # a checkpoint's folder of per-role adapters (model.lora.per_role): adapters/<role>/


def is_adapter(model) -> bool:
    """Is ``model`` a PEFT-wrapped policy (``wrap``)?"""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def resolve_targets(model, targets) -> tuple[str, ...]:
    """The module names (PEFT's ``target_modules``: last components) ``model.lora.targets`` means on ``model``.
    'all-linear': every ``nn.Linear`` but the output head (PEFT's own meaning of it, made explicit here so the
    engines and ``adapter_config.json`` get the same list). A name that matches no module, or a module that is
    not linear (the engines merge B·A into a weight matrix), is a ``ModelError`` naming the field."""
    head = model.get_output_embeddings()
    named = [(name, m) for name, m in model.named_modules() if name]
    if targets == "all-linear":
        found = sorted({name.rpartition(".")[2] for name, m in named
                        if isinstance(m, torch.nn.Linear) and m is not head})
        if not found:
            raise ModelError("model.lora.targets='all-linear': the model has no linear layer besides its output head")
        return tuple(found)
    for t in targets:
        hits = [m for name, m in named if name.rpartition(".")[2] == t]
        if not hits:
            leaves = sorted({name.rpartition(".")[2] for name, m in named if isinstance(m, torch.nn.Linear)})
            raise ModelError(f"model.lora.targets: {t!r} names no module of the model; its linear layers: "
                             f"{', '.join(leaves)}")
        if not all(isinstance(m, torch.nn.Linear) for m in hits):
            raise ModelError(f"model.lora.targets: {t!r} names a module that is not linear "
                             f"({type(next(m for m in hits if not isinstance(m, torch.nn.Linear))).__name__}): "
                             "adapters go on linear layers")
        if any(m is head for m in hits):
            raise ModelError(f"model.lora.targets: {t!r} is the output head: adapters go on the decoder's layers")
    return tuple(dict.fromkeys(targets))


def expert_parameters(model) -> tuple[str, ...]:
    """``model.lora.experts``: PEFT's ``target_parameters`` for a mixture of experts' fused expert tensors (3-D,
    [experts, out, in], on a module named ``*experts``: "experts.gate_up_proj", "experts.down_proj")."""
    found = sorted({f"{name.rpartition('.')[2]}.{p}" for name, m in model.named_modules()
                    if name.rpartition(".")[2].endswith("experts")
                    for p, t in m.named_parameters(recurse=False) if t.dim() == 3})
    if not found:
        raise ModelError("model.lora.experts=true: the model has no fused experts (3-D tensors of a module named "
                         "'experts', as qwen3_moe, mixtral, gpt_oss keep them); remove it")
    return tuple(found)


def spec_for(lora, model) -> LoraSpec:
    """The adapter's shape (``lora_weights.LoraSpec``) from the ``model.lora`` section, its targets resolved on ``model``."""
    experts = expert_parameters(model) if getattr(lora, "experts", False) else ()
    if experts and lora.dropout:
        raise ModelError(f"model.lora.experts=true with model.lora.dropout={lora.dropout}: PEFT's adapters on fused "
                         "experts take no dropout; set model.lora.dropout=0")
    return LoraSpec(lora.r, float(lora.alpha), resolve_targets(model, lora.targets), experts,
                    exclude=vision.lora_exclude(model))


def wrap(model, lora, roles: tuple[str, ...] = ()):
    """(``model`` with a fresh adapter of ``model.lora``'s shape, its spec). Only the adapter requires grad.
    The adapter's initial values come from torch's RNG (A: Kaiming-uniform; B: zeros), so a seeded run
    starts from the same adapter on every torchrun rank. ``model.lora.per_role``: one adapter per name of
    ``roles`` (PEFT's named adapters), all trainable, the first active."""
    per_role = getattr(lora, "per_role", False)
    first = roles[0] if per_role and roles else "default"
    if per_role and len(roles) < 2:
        raise ModelError("model.lora.per_role=true: one adapter per role needs a multi-agent environment whose "
                         f"policy plays two roles or more (here: {', '.join(roles) or 'none'})")
    from peft import LoraConfig, get_peft_model

    spec = spec_for(lora, model)

    def config(targets):
        return LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=lora.dropout, target_modules=list(targets),
                          bias="none", task_type="CAUSAL_LM", target_parameters=list(spec.parameters) or None,
                          exclude_modules=spec.exclude)

    try:
        wrapped = get_peft_model(model, config(spec.targets), adapter_name=first)
    except ValueError as e:  # (PEFT refuses some linear layers: a Mamba mixer's out_proj, Falcon-H1's)
        found = re.search(r"[Ii]ncompatible modules: \{([^}]*)\}", str(e))
        if lora.targets != "all-linear" or found is None:
            raise ModelError(f"model.lora.targets: PEFT cannot put an adapter there: {str(e).splitlines()[0]}") from None
        drop = {x.strip(" '\"") for x in found.group(1).split(",")}
        spec = dataclasses.replace(spec, targets=tuple(t for t in spec.targets if t not in drop))
        wrapped = get_peft_model(model, config(spec.targets), adapter_name=first)  # ('all-linear': those PEFT adapts)
        # (PEFT's refused first try left the model half-wrapped, and the second left every base weight trainable:
        # the trainer then moved weights the engines never get, and the sampling alarm stopped Nemotron-H's runs)
        for n, p in wrapped.named_parameters():
            p.requires_grad_("lora_" in n)
    used = wrapped.peft_config[first]  # (PEFT rewrites some families' MLP targets onto their fused experts)
    if spec.parameters and (used.rank_pattern or used.alpha_pattern or set(used.target_modules or ()) != set(spec.targets)):
        raise ModelError("model.lora.experts=true: PEFT rewrites this model's MLP targets onto its fused experts (at "
                         f"another rank: {dict(used.rank_pattern)}), which relayrl's engines do not merge: give "
                         "model.lora.targets the attention's layers (e.g. [q_proj, k_proj, v_proj, o_proj])")
    odd = sorted({type(m.base_layer).__name__ for _, m in wrapped.named_modules()
                  if hasattr(m, "lora_A") and hasattr(m, "base_layer") and not isinstance(m.base_layer, torch.nn.Linear)
                  and not any(t.endswith(f".{getattr(m, 'parameter_name', None)}") for t in spec.parameters)})
    # (PEFT's ParamWrapper on a tensor model.lora.experts names: merged per expert by the engines)
    if odd:
        raise ModelError(f"model.lora.targets: PEFT puts adapters on {', '.join(odd)} modules of this model (a "
                         "mixture of experts' fused weights), which relayrl's engines cannot merge (they add B·A to "
                         "linear layers): give model.lora.targets the attention's layers, e.g. [q_proj, k_proj, v_proj, "
                         "o_proj]")
    if per_role:
        for name in roles[1:]:  # (PEFT's named adapters; each from torch's RNG as the first is)
            wrapped.add_adapter(name, config(spec.targets))
        for n, p in wrapped.named_parameters():
            p.requires_grad_("lora_" in n)
        use_adapter(wrapped, roles[0])
        spec = dataclasses.replace(spec, adapters=len(roles))  # (a vLLM engine's slots: each role's versions)
    return wrapped, spec


def adapter_names(model) -> tuple[str, ...]:
    """The per-role adapters of ``model`` (``model.lora.per_role``); () for one adapter or none."""
    names = tuple(getattr(model, "peft_config", {}) or ())
    return () if names in ((), ("default",)) else names


def use_adapter(model, name: str) -> None:
    """The forwards of ``model`` from here run under its adapter ``name`` (one of ``adapter_names``). Unlike PEFT's
    ``set_adapter`` it leaves ``requires_grad`` alone: every role's adapter stays in the optimiser, and a
    micro-batch's gradient reaches its own role's only."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    if name not in model.peft_config:
        raise ModelError(f"model.lora.per_role: no adapter for role {name!r} (adapters: "
                         f"{', '.join(model.peft_config)})")
    for m in model.modules():
        if isinstance(m, BaseTunerLayer):
            m._active_adapter = [name]


@contextlib.contextmanager
def base_model(model):
    """Context: inside, a wrapped ``model`` computes as its base model (the adapter switched off). What trained
    before trains after: PEFT's switch back on leaves only the active adapter requiring grad, which would freeze
    the other roles' adapters (``model.lora.per_role``)."""
    if not is_adapter(model):
        yield
        return
    trained = [p for p in model.parameters() if p.requires_grad]
    try:
        with model.disable_adapter():
            yield
    finally:
        for p in trained:
            p.requires_grad_(True)


def adapter_state(model, state_dict: dict | None = None) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's saved names, on the CPU (``state_dict``: the model's whole state,
    when it was gathered elsewhere: FSDP's ``full_state_dict``)."""
    from peft import get_peft_model_state_dict

    names = adapter_names(model)
    if names:  # (model.lora.per_role: every role's, "<role>::" before each name)
        return {f"{n}{ROLE_SEP}{k}": v.detach().cpu() for n in names
                for k, v in get_peft_model_state_dict(model, state_dict=state_dict, adapter_name=n).items()}
    sd = get_peft_model_state_dict(model, state_dict=state_dict)
    return {k: v.detach().cpu() for k, v in sd.items()}


def trainable(model) -> dict[str, torch.nn.Parameter]:
    """The parameters a step changes, by name (all of them without an adapter)."""
    return {k: p for k, p in model.named_parameters() if p.requires_grad}


def load_adapter(model, folder: str | Path) -> None:
    """A checkpoint's adapter (``write_adapter``) into a wrapped ``model``; every tensor must land."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    names = adapter_names(model)
    if bool(names) != (Path(folder) / PER_ROLE).is_dir():
        raise ModelError(f"{folder}: {'one adapter per role' if not names else 'a single adapter'} there, and "
                         f"model.lora.per_role={bool(names)}: resume with the model.lora it was saved with")
    for name in names or (None,):
        where = Path(folder) / PER_ROLE / name if name else Path(folder)
        if not (where / ADAPTER_WEIGHTS).is_file():
            raise ModelError(f"{where}: no {ADAPTER_WEIGHTS} (role {name!r}'s adapter)")
        weights = load_file(str(where / ADAPTER_WEIGHTS))
        result = set_peft_model_state_dict(model, weights, adapter_name=name or "default")
        unexpected = getattr(result, "unexpected_keys", [])
        missing = [k for k in getattr(result, "missing_keys", []) if "lora_" in k and (name is None or name in k)]
        if unexpected or missing:
            raise ModelError(f"{where}: the adapter does not fit model.lora's (unexpected {unexpected[:3]}, missing "
                             f"{missing[:3]}): resume with the model.lora it was saved with")


def write_adapter(folder: Path, weights: dict[str, torch.Tensor], config: dict) -> None:
    """PEFT's files for an adapter: ``adapter_model.safetensors`` (``weights``, PEFT's saved names) and
    ``adapter_config.json`` (``config``: ``LoraSpec.adapter_config``)."""
    from safetensors.torch import save_file

    for name, tensors in by_adapter(weights).items():  # (model.lora.per_role: each role's in adapters/<role>/)
        where = folder / PER_ROLE / name if name else folder
        where.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(where / ADAPTER_WEIGHTS),
                  metadata={"format": "pt"})
        (where / ADAPTER_CONFIG).write_text(json.dumps(config, indent=1))


def read_adapter(folder: str | Path, engine: bool = True) -> tuple[LoraSpec, str, dict[str, torch.Tensor]] | None:
    """(spec, base model, tensors) of the PEFT adapter in ``folder``; None when it holds none (a whole model).
    ``engine``: for an engine, which applies one scale alpha / r to every module (B·A added to the weight): an
    adapter whose math is another (per-module alpha_pattern / rank_pattern, a bias, fan_in_fan_out) is refused in
    one line, never sampled as another policy than PEFT's (a model merged by PEFT itself takes any)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / ADAPTER_CONFIG).is_file():
        roles = sorted(p.name for p in (folder / PER_ROLE).glob("*") if (p / ADAPTER_CONFIG).is_file())
        if roles:
            raise ModelError(f"{folder} holds one adapter per role ({', '.join(roles)}): give one of them, e.g. "
                             f"{folder / PER_ROLE / roles[0]}")
        return None
    try:
        c = json.loads((folder / ADAPTER_CONFIG).read_text())
        targets, params = c["target_modules"], c.get("target_parameters") or ()
        spec = LoraSpec(int(c["r"]), float(c["lora_alpha"]), tuple([targets] if isinstance(targets, str) else targets),
                        tuple(params), exclude=c.get("exclude_modules") if isinstance(c.get("exclude_modules"), str)
                        else None)
        weights = load_file(str(folder / ADAPTER_WEIGHTS))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelError(f"{folder}: cannot read its LoRA adapter ({ADAPTER_CONFIG}, {ADAPTER_WEIGHTS}): {e}") from None
    if c.get("peft_type", "LORA") != "LORA" or c.get("use_dora") or c.get("use_rslora"):
        raise ModelError(f"{folder}: the adapter is not a plain LoRA adapter (peft_type {c.get('peft_type')!r}, "
                         f"use_dora {c.get('use_dora')}, use_rslora {c.get('use_rslora')})")
    other = [f"{k}={c[k]!r:.60}" for k in ("alpha_pattern", "rank_pattern") if c.get(k)] + \
        [f"{k}={c[k]!r}" for k, plain in (("bias", "none"), ("fan_in_fan_out", False)) if c.get(k, plain) != plain]
    if engine and other:
        raise ModelError(f"{folder}: the adapter's {', '.join(other)} is not what relayrl's engines apply (one scale "
                         f"lora_alpha / r = {spec.scale:g} on every target, no bias): merge it with PEFT first "
                         "(PeftModel.from_pretrained(base, folder).merge_and_unload().save_pretrained(out)) and give "
                         "the merged model")
    base = c.get("base_model_name_or_path")
    run_ckpt = next((f for f in (folder, folder.parent.parent) if (f / "state.json").is_file()), None)
    if (not base or base.startswith("/") and not Path(base).exists()) and run_ckpt is not None:
        base = _recorded_base(run_ckpt) or base  # (moved: a relayrl checkpoint records its run's model.path)
    if not base:
        raise ModelError(f"{folder}/{ADAPTER_CONFIG} names no base model (base_model_name_or_path)")
    return spec, base, weights


def _recorded_base(folder: Path) -> str | None:
    """The base model of a relayrl checkpoint from its run's recorded model.path (state.json), resolved
    (``builtin:demo``: where this installation keeps it)."""
    from relayrl.models import resolve_model_path

    try:
        path = json.loads((folder / "state.json").read_text())["config"]["model"]["path"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return resolve_model_path(path, log=lambda *a, **k: None) if path else None


def load_merged(checkpoint: str | Path, dtype: str = "float32", field: str | None = None):
    """The policy of an adapter checkpoint in memory: its base (from_pretrained) with the adapter merged in
    (PEFT's ``merge_and_unload``)."""
    from peft import PeftModel

    from relayrl.models import load_policy

    _, base, _ = read_adapter(checkpoint, engine=False)
    model = load_policy(base, dtype, field=f"the base model of {field + '=' if field else ''}{checkpoint}")
    return PeftModel.from_pretrained(model, str(checkpoint)).merge_and_unload()


def load_model(path: str, dtype: str = "float32", field: str = "model.path"):
    """A model to run, not train (a teacher, a judge): a from_pretrained folder or hub id, 'builtin:...', or a
    relayrl checkpoint, an adapter checkpoint's base with its adapter merged in."""
    from relayrl.models import load_policy, resolve_model_path

    path = resolve_model_path(path, log=lambda *a, **k: None, field=field)
    if read_adapter(path, engine=False) is not None:
        return load_merged(path, dtype, field)
    return load_policy(path, dtype, field=field)


def export_merged(checkpoint: str | Path, out: str | Path, dtype: str = "float32") -> Path:
    """Write the policy of ``checkpoint`` (an adapter checkpoint) to ``out`` as a plain Hugging Face model:
    the base with the adapter merged into its weights (PEFT's ``merge_and_unload``) and the tokenizer,
    loadable by ``AutoModelForCausalLM.from_pretrained(out)`` with no PEFT."""
    from relayrl.models import load_tokenizer

    checkpoint, out = Path(checkpoint), Path(out)
    found = read_adapter(checkpoint, engine=False)
    if found is None:
        raise ModelError(f"{checkpoint}: no LoRA adapter there ({ADAPTER_CONFIG}): a checkpoint of full fine-tuning "
                         "is already a whole model (AutoModelForCausalLM.from_pretrained reads it)")
    _, base, _ = found
    merged = load_merged(checkpoint, dtype)
    out.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(out, safe_serialization=True)
    tokenizer = checkpoint if any((checkpoint / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")) \
        else base
    vision.save_tokenizer(load_tokenizer(str(tokenizer)), out)
    return out
