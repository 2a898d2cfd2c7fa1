"""Loading policies and tokenizers (``from_pretrained``), prompt encoding (chat template or raw),
the prompt-length check, token log-probs, the device. (LoRA's arithmetic, shared by the trainer and the
engines: ``lora_weights``.)

A model or tokenizer that cannot be loaded raises ``ModelError`` naming the config field, the
path and the reason, in one line.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PROMPT_FORMATS = ("chat", "raw")
NO_TEMPLATE = ("has no chat template; for a base model set data.prompt_format=raw (the prompt string is then "
               "tokenized as is)")
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


class ModelError(ValueError):
    pass


def _reason(e: BaseException) -> str:
    """The first line of a library's message (transformers' go on for a paragraph)."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    return lines[0] if lines else type(e).__name__


def _missing_local(path: str) -> bool:
    """A path that is plainly local (not a hub id) and is not there."""
    return path.startswith(("/", "./", "../", "~")) and not Path(os.path.expanduser(path)).exists()


# what a local folder must hold for each kind of load (transformers' own message for a folder
# without them is misleading: "Should have a `model_type` key in its config.json")
_FILES = {
    "tokenizer": ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"),
    "model": ("config.json",),
    "model config": ("config.json",),
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
        raise ModelError(f"{field}={path!r}: cannot load the {what}: {_reason(e)}") from None


def resolve_model_path(path: str, log=print, field: str = "model.path") -> str:
    if path == "builtin:demo":
        from relayrl.demo.model import demo_model_path

        return str(demo_model_path(log=log))
    if path == "builtin:agent-demo":
        from relayrl.demo.agent_model import agent_demo_model_path

        return str(agent_demo_model_path(log=log))
    if path.startswith("builtin:"):
        raise ModelError(f"{field}={path!r}: unknown built-in model; valid: builtin:demo, builtin:agent-demo")
    return newest_checkpoint_of(path, field)


def newest_checkpoint_of(path: str, field: str = "model.path") -> str:
    """``path``, or where it is a relayrl run's folder (``runs/demo``: no model of its own, a ``checkpoints``
    folder) its newest complete checkpoint: a ``step_N`` folder, whose name it gets only once written whole."""
    p = Path(os.path.expanduser(path))
    ckpts = p / "checkpoints"
    if not ckpts.is_dir() or any((p / f).exists() for f in ("config.json", "adapter_config.json")):
        return path
    steps = sorted(c for c in ckpts.glob("step_*") if (c / "state.json").exists())
    if not steps:
        raise ModelError(f"{field}={path!r}: a run's folder with no complete checkpoint under {ckpts}")
    return str(steps[-1])


def load_tokenizer(path: str, prompt_format: str | None = None, field: str = "model.path"):
    """The tokenizer at ``path``. With ``prompt_format='chat'`` one without a chat template is an
    error here, before any work; None skips that check (callers that encode no prompts)."""
    from transformers import AutoTokenizer

    tok = load_checked(AutoTokenizer.from_pretrained, path, field, "tokenizer")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if prompt_format == "chat" and tok.chat_template is None:
        raise ModelError(f"{field}={path!r}: the tokenizer {NO_TEMPLATE}")
    return tok


def load_policy(path: str, dtype: str = "float32", field: str = "model.path"):
    from transformers import AutoModelForCausalLM

    return load_checked(AutoModelForCausalLM.from_pretrained, path, field, "model", dtype=DTYPES[dtype])


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


def model_context(path: str, field: str = "model.path") -> int | None:
    """The model's context length in tokens, from its config (None if the config does not say)."""
    found = model_context_source(path, field)
    return found[0] if found else None


def model_context_source(path: str, field: str = "model.path") -> tuple[int, str] | None:
    """(the model's context length, where it was read: the key and the model), for messages about it."""
    from transformers import AutoConfig

    cfg = load_checked(AutoConfig.from_pretrained, path, field, "model config")
    for key in _CONTEXT_KEYS:
        if isinstance(getattr(cfg, key, None), int):
            return getattr(cfg, key), f"{key} in the config.json of {path}"
    return None


def encode_prompt(tokenizer, messages: list[dict[str, str]], prompt_format: str = "chat") -> list[int]:
    """Prompt token ids. 'chat': the chat template with the generation prompt. 'raw': the one
    user message's text as is (with the tokenizer's own special tokens, e.g. BOS), for base
    models; ``load_prompts(prompt_format='raw')`` guarantees that shape."""
    if prompt_format == "raw":
        if len(messages) != 1 or messages[0]["role"] != "user":
            raise ValueError("prompt_format='raw' encodes a single plain-string prompt, not chat messages")
        return list(tokenizer(messages[0]["content"])["input_ids"])
    if prompt_format != "chat":
        raise ValueError(f"prompt_format must be one of {', '.join(PROMPT_FORMATS)}, got {prompt_format!r}")
    if tokenizer.chat_template is None:
        raise ModelError(f"the tokenizer {NO_TEMPLATE}")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def _token_count(tokenizer, messages: list[dict[str, str]], prompt_format: str, limit: int) -> tuple[int, bool]:
    """(tokens of the encoded prompt, exact?). Tokenizing megabytes takes seconds, so the longest
    message is first cut at a whitespace ever further in (8, 32, ... × limit characters): once such
    a prefix is over ``limit`` the prompt is too. A prefix cut before whitespace never has more
    tokens than the whole, as tokenizers split words at whitespace before merging."""
    k = max(range(len(messages)), key=lambda i: len(messages[i]["content"]))
    text = messages[k]["content"]
    cut = 8 * (limit + 1)
    while cut < len(text):
        end = max(text.rfind(c, 0, cut) for c in " \n\t")
        if end > 0:
            prefix = messages[:k] + [{**messages[k], "content": text[:end]}] + messages[k + 1 :]
            n = len(encode_prompt(tokenizer, prefix, prompt_format))
            if n > limit:
                return n, False
        cut *= 4
    return len(encode_prompt(tokenizer, messages, prompt_format)), True


def check_prompt_lengths(prompts, tokenizer, limit: int, prompt_format: str = "chat", source: str = "data.path",
                         field: str = "prompt", room: str = "the model's context leaves after rollout.max_new_tokens"
                         ) -> None:
    """Raise ``DataError`` naming ``source``, the prompt and the field if a prompt encodes to more
    than ``limit`` tokens (the model's context minus rollout.max_new_tokens; ``room`` says so in the
    message): it would only fail when it is generated for, mid-run.

    Exact and cheap: a token covers at least one byte of the text (byte-level BPE; SentencePiece
    with byte fallback), so a prompt whose content bytes plus the template's own tokens (the same
    messages with empty contents, plus one per message for a leading-space marker) fit in
    ``limit`` cannot exceed it. Only the others are tokenized (``_token_count``)."""
    from relayrl.data.datasets import DataError

    if limit < 1:
        raise ValueError(f"no room for a prompt: the model's context minus rollout.max_new_tokens is {limit} tokens")
    overhead: dict[tuple[str, ...], int] = {}  # by the prompt's roles
    for p in prompts:
        roles = tuple(m["role"] for m in p.messages)
        if roles not in overhead:
            empty = [{"role": r, "content": ""} for r in roles]
            overhead[roles] = len(encode_prompt(tokenizer, empty, prompt_format)) + len(roles)
        if sum(len(m["content"].encode("utf-8")) for m in p.messages) + overhead[roles] <= limit:
            continue
        n, exact = _token_count(tokenizer, p.messages, prompt_format, limit)
        if n > limit:
            raise DataError(f"{source}: prompt id {p.id!r:.80}: field '{field}' is {'' if exact else 'at least '}{n} "
                            f"tokens, more than the {limit} {room}")


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T)[target] per position, in float32."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.gather(F.log_softmax(logits, dim=-1), -1, targets.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    logp = F.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def resolve_device(name: str, field: str = "trainer.device") -> torch.device:
    """``trainer.device`` (or ``rollout.device``): 'auto' is CUDA when available, else the CPU. Under
    torchrun each rank takes the GPU of its LOCAL_RANK."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"{field}={name!r}, but CUDA is not available here (torch {torch.__version__}, "
                         f"{'a CPU-only build' if torch.version.cuda is None else 'no GPU visible'}): use "
                         f"{field}=auto or cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
