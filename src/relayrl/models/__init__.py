"""Loading policies and tokenizers (``from_pretrained``) and token log-probs. (A prompt as tokens and its
length against the context: ``models.prompts``; the device: ``models.devices``; LoRA's arithmetic, shared by the
trainer and the engines: ``lora_weights``.)

A model or tokenizer that cannot be loaded raises ``ModelError`` naming the config field, the
path and the reason, in one line.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
NO_TEMPLATE = ("has no chat template; for a base model set data.prompt_format=raw (the prompt string is then "
               "tokenized as is)")


class ModelError(ValueError):
    pass


def _reason(e: BaseException) -> str:
    """The first line of a library's message (transformers' go on for a paragraph)."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    return lines[0] if lines else type(e).__name__


def _missing_local(path: str) -> bool:
    """A path that is plainly local and is not there: not a hub id's ``name`` or ``org/name`` shape (it starts with
    /, ./, ../ or ~, or has more parts), or its first part is a folder here (``runs/sft`` with a ``runs`` folder: a
    run not made yet, where the hub would be asked, with retries, for a model that cannot be there)."""
    parts = path.split("/")
    local = path.startswith(("/", "./", "../", "~")) or len(parts) > 2 or (len(parts) == 2 and Path(parts[0]).is_dir())
    return local and not Path(os.path.expanduser(path)).exists()


# what a local folder must hold for each kind of load (transformers' own message for a folder
# without them is misleading: "Should have a `model_type` key in its config.json")
_FILES = {
    "tokenizer": ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"),
    "model": ("config.json",),
    "model config": ("config.json",),
    "processor": ("processor_config.json", "preprocessor_config.json"),  # (a vision-language model's)
}


def load_checked(loader, path: str, field: str, what: str, **kw):
    """``loader(path)``; any failure becomes a ModelError naming ``field`` and ``path``. Everything
    from_pretrained raises (OSError, ValueError, safetensors and JSON errors) means the path does
    not hold a loadable ``what``."""
    if _missing_local(path):
        raise ModelError(f"{field}={path!r}: cannot load the {what}: no such file or directory")
    local = Path(os.path.expanduser(path))
    if local.is_file():
        raise ModelError(f"{field}={path!r}: cannot load the {what}: it is a file; give the folder "
                         "(save_pretrained) or a hub id")
    if local.is_dir() and not any((local / f).exists() for f in _FILES[what]):
        raise ModelError(f"{field}={path!r}: cannot load the {what}: the folder has no {' or '.join(_FILES[what])}")
    try:
        return loader(path, **kw)
    except Exception as e:
        here = "" if local.exists() else f" (nor is it a folder here, in {Path.cwd()})"
        raise ModelError(f"{field}={path!r}: cannot load the {what}: {_reason(e)}{here}") from None


def resolve_model_path(path: str, log=print, field: str = "model.path") -> str:
    if path == "builtin:demo":
        from relayrl.demo.model import demo_model_path

        return str(demo_model_path(log=log))
    if path == "builtin:agent-demo":
        from relayrl.demo.agent_model import agent_demo_model_path

        return str(agent_demo_model_path(log=log))
    if path == "builtin:swe-demo":
        from relayrl.demo.swe_model import swe_demo_model_path

        return str(swe_demo_model_path(log=log))
    if path == "builtin:vlm-demo":
        from relayrl.demo.vlm_demo import vlm_demo_model_path

        return str(vlm_demo_model_path(log=log))
    if path == "builtin:gui-demo":
        from relayrl.demo.gui_model import gui_demo_model_path

        return str(gui_demo_model_path(log=log))
    if path.startswith("builtin:"):
        raise ModelError(f"{field}={path!r}: unknown built-in model; valid: builtin:demo, builtin:agent-demo, "
                         "builtin:swe-demo, builtin:vlm-demo, builtin:gui-demo")
    return newest_checkpoint_of(path, field)


def newest_checkpoint_of(path: str, field: str = "model.path") -> str:
    """``path``, or where it is a relayrl run's folder (``runs/demo``: no model of its own, a ``checkpoints``
    folder) its newest complete checkpoint: a ``step_N`` folder, whose name it gets only once written whole."""
    p = Path(os.path.expanduser(path))
    if not p.exists() and looks_local(path):
        raise ModelError(f"{field}={path!r}: {missing_folder(p)}")
    ckpts = p / "checkpoints"
    if not ckpts.is_dir() or any((p / f).exists() for f in ("config.json", "adapter_config.json")):
        return path
    steps = sorted(c for c in ckpts.glob("step_*") if (c / "state.json").exists())
    if not steps:
        raise ModelError(f"{field}={path!r}: a run's folder with no complete checkpoint under {ckpts}")
    return str(steps[-1])


def looks_local(path: str) -> bool:
    """A path no hub id can be (``./m``, ``/m``, ``~/m``, ``../m``, ``runs/demo/checkpoints/step_000020``: a hub id
    is ``name`` or ``org/name``): a missing one fails at once, not after the hub client's retries (51 s offline)."""
    first = Path(path).parts[0] if Path(path).parts else ""
    return (path.startswith(("/", "./", "../", "~")) or path.count("/") > 1 or os.sep != "/" and os.sep in path
            or ("/" in path and Path(first).is_dir()))  # (runs/nim-sft where ./runs exists: a run's folder)


def missing_folder(p: Path) -> str:
    """'no such folder', with what its parent holds that is near: a checkpoint's siblings, a misspelled name's."""
    import difflib

    parent = p.parent
    if not parent.is_dir():
        return f"no such folder (nor {parent}); a local path, so the hub was not asked"
    names = sorted(c.name for c in parent.iterdir() if c.is_dir() and not c.name.startswith("."))
    if parent.name == "checkpoints":
        return f"no such checkpoint; {parent} holds {', '.join(names) or 'none'}"
    near = difflib.get_close_matches(p.name, names, n=3)
    runs = [n for n in names if (parent / n / "checkpoints").is_dir()]
    if not near and (runs or parent.name == "runs"):  # a folder of runs: the missing one is a run not made yet
        return (f"no run {p.name!r} in {parent} (its runs: {', '.join(runs) or 'none'}): the run that makes it is "
                f"named so (run.name={p.name}), e.g. a warm start the example's header or guide gives first")
    return "no such folder" + (f"; did you mean {', '.join(str(parent / n) for n in near)}?" if near else
                               f" in {parent}") + " (a local path, so the hub was not asked)"


def load_tokenizer(path: str, prompt_format: str | None = None, field: str = "model.path"):
    """The tokenizer at ``path``. With ``prompt_format='chat'`` one without a chat template is an
    error here, before any work; None skips that check (callers that encode no prompts)."""
    from transformers import AutoTokenizer

    vlm = vision_config(path) is not None  # (a vision-language model's prompts with images go through its processor)
    if vlm:
        _check_family(path, field)
    tok = load_checked(AutoTokenizer.from_pretrained, path, field, "tokenizer")
    if vlm:
        from relayrl.models import vision

        vision.attach(tok, load_processor(path, field))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if prompt_format == "chat" and tok.chat_template is None:
        raise ModelError(f"{field}={path!r}: the tokenizer {NO_TEMPLATE}")
    return tok


def load_policy(path: str, dtype: str = "float32", field: str = "model.path"):
    """The policy at ``path``; a vision-language model (``models.vision``) with its processor attached."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if vision_config(path) is None:
        return load_checked(AutoModelForCausalLM.from_pretrained, path, field, "model", dtype=DTYPES[dtype])
    from relayrl.models import vision

    _check_family(path, field)
    model = load_checked(AutoModelForImageTextToText.from_pretrained, path, field, "model", dtype=DTYPES[dtype])
    return vision.attach(model, load_processor(path, field))


def _check_family(path: str, field: str) -> None:
    import json

    from relayrl.models import vision

    try:
        vision.check_family(json.loads((Path(os.path.expanduser(path)) / "config.json").read_text()).get("model_type"),
                            field)
    except vision.VisionError as e:
        raise ModelError(str(e)) from None


def load_processor(path: str, field: str = "model.path"):
    """A vision-language model's processor, with its image processor (PIL's where torchvision is absent): one
    that comes back without (a bare tokenizer, as ``AutoProcessor`` may give) is refused."""
    from transformers import AutoProcessor

    proc = load_checked(AutoProcessor.from_pretrained, path, field, "processor")
    if getattr(proc, "image_processor", None) is None:
        raise ModelError(f"{field}={path!r}: a vision-language model whose processor could not be built with an "
                         f"image processor (got {type(proc).__name__}); its folder needs processor_config.json or "
                         "preprocessor_config.json")
    return proc


def vision_config(path: str) -> dict | None:
    """A local model folder's ``vision_config`` (a vision-language model's), else None (text, or not local)."""
    import json

    cfg = Path(os.path.expanduser(path)) / "config.json"
    try:
        return json.loads(cfg.read_text()).get("vision_config") if cfg.is_file() else None
    except (OSError, ValueError):
        return None


def cache_kwarg(model) -> str:
    """The name ``model.forward`` takes a KV cache under: ``cache`` from transformers 5.24 on (where
    ``past_key_values`` is deprecated, to be removed in 5.40), ``past_key_values`` before. Read from the
    transformers model itself: PEFT's wrapper (model.lora) takes ``**kwargs`` and passes them on, so its own
    signature names neither."""
    import inspect

    model = getattr(model, "module", model)  # (a wrapper's module, FSDP2 keeps the class)
    if callable(getattr(model, "get_base_model", None)):  # (PEFT: the model under the adapter)
        model = model.get_base_model()
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def select_rows(cache, idx: torch.Tensor, rows: int) -> None:
    """Keep rows ``idx`` of a transformers cache of ``rows`` rows. A layer's ``batch_select_indices`` selects keys
    and values; a hybrid model's states (Falcon-H1's linear-attention and Mamba states, kept in dicts beside them)
    are left whole by it in transformers 5.19, and its ``LinearAttentionLayer`` (Qwen3-Next's and Qwen3.5's Gated
    DeltaNet, Nemotron-H's Mamba-2: conv and recurrent states) has none: every tensor still ``rows`` long is
    selected here."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        cache.batch_select_indices(idx)
        return
    for layer in layers:
        if hasattr(layer, "batch_select_indices"):
            layer.batch_select_indices(idx)
    for layer in layers:
        for name, value in vars(layer).items():
            if torch.is_tensor(value) and value.dim() and value.shape[0] == rows:
                setattr(layer, name, value.index_select(0, idx))
            elif isinstance(value, dict):
                for k, v in value.items():
                    if torch.is_tensor(v) and v.dim() and v.shape[0] == rows:
                        value[k] = v.index_select(0, idx)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T)[target] per position, in float32."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.gather(F.log_softmax(logits, dim=-1), -1, targets.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    logp = F.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)
