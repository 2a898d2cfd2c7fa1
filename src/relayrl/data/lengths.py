"""The check, before any work, that every prompt leaves room for the response: a prompt too long would only
fail when it is generated for, mid-run (its encoding and the model's context: ``models.prompts``)."""

from __future__ import annotations

from relayrl.data.datasets import DataError
from relayrl.models.prompts import encode_prompt


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
    if limit < 1:
        raise ValueError(f"no room for a prompt: the model's context minus rollout.max_new_tokens is {limit} tokens")
    overhead: dict[tuple[str, ...], int] = {}  # by the prompt's roles
    for p in prompts:
        if p.images:  # (its images' tokens are the processor's to count: encoded in full)
            n, exact = len(_with_images(tokenizer, p, prompt_format, source)), True
            if n > limit:
                raise DataError(f"{source}: prompt id {p.id!r:.80}: field '{field}' is {n} tokens with its "
                                f"{len(p.images)} image(s), more than the {limit} {room}")
            continue
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


def _with_images(tokenizer, p, prompt_format: str, source: str) -> list[int]:
    from relayrl.models.vision import VisionError

    try:
        return encode_prompt(tokenizer, p.messages, prompt_format, p.images)
    except VisionError as e:
        raise DataError(f"{source}: prompt id {p.id!r:.80}: {e}") from None
