"""A prompt as tokens: its encoding (the chat template with the generation prompt, or raw text for base
models) and the model's context length from its config. The check that every prompt leaves room for the
response is the data's: ``data.lengths``."""

from __future__ import annotations

from relayrl.models import NO_TEMPLATE, ModelError, load_checked

PROMPT_FORMATS = ("chat", "raw")
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def model_context(path: str, field: str = "model.path") -> int | None:
    """The model's context length in tokens, from its config (None if the config does not say)."""
    found = model_context_source(path, field)
    return found[0] if found else None


def model_context_source(path: str, field: str = "model.path") -> tuple[int, str] | None:
    """(the model's context length, where it was read: the key and the model), for messages about it."""
    from transformers import AutoConfig

    cfg = load_checked(AutoConfig.from_pretrained, path, field, "model config")
    for where, c in (("", cfg), ("text_config.", getattr(cfg, "text_config", None))):  # (a VLM's: its LM's)
        for key in _CONTEXT_KEYS:
            if isinstance(getattr(c, key, None), int):
                return getattr(c, key), f"{where}{key} in the config.json of {path}"
    return None


def encode_prompt(tokenizer, messages: list[dict[str, str]], prompt_format: str = "chat", images=()) -> list[int]:
    """Prompt token ids. 'chat': the chat template with the generation prompt. 'raw': the one
    user message's text as is (with the tokenizer's own special tokens, e.g. BOS), for base
    models; ``load_prompts(prompt_format='raw')`` guarantees that shape. ``images`` (a prompt's references):
    the processor's template, each image expanded to its tokens (``models.vision``)."""
    if images:
        from relayrl.models import vision

        return vision.encode(tokenizer, messages, images)
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
