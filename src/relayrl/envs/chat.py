"""Token-in, token-out multi-turn context: the engine's own tokens are kept, and only the tokens
the chat template adds for new messages (tool results, the next user turn, the next assistant
header, the separators between turns) are tokenized, as a suffix. The history is never
re-rendered into the trajectory: re-tokenising drifts (a missing "\\n" after ``<|im_end|>``,
verl #3720; BPE merges across a turn boundary; a model that spells a word in other tokens than
the tokenizer would), and costs most of the generation time at many turns.

The suffix is what the template's rendering of the conversation gains from the new messages,
plus what it renders after the end-of-turn token the engine stopped at (ChatML's "\\n"). It is
computed from two renderings of the same message texts, never by comparing them with the
engine's tokens, so a policy's non-canonical spelling of its own turn does not matter. It only
works if the template renders earlier turns the same once later ones exist (some drop earlier
reasoning): ``next_turn_suffix`` checks that and fails closed with ``TemplateMismatch`` instead
of training on a context the model would never see.
"""

from __future__ import annotations


class TemplateMismatch(ValueError):
    pass


def render_ids(tokenizer, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None,
               seeing: bool | None = None) -> list[int]:
    """The chat template's token ids for ``messages``; where they carry images (``models.images.with_images``), the
    processor's, each image expanded to its tokens (``models.vision.render``; ``seeing``: the processor's template
    whether or not these messages have images)."""
    if seeing or (seeing is None and any(m.get("images") for m in messages)):
        from relayrl.models import vision

        return vision.render(tokenizer, messages, add_generation_prompt, tools)
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5: a BatchEncoding


def next_turn_suffix(tokenizer, messages: list[dict], new: list[dict], tools: list[dict] | None = None
                     ) -> list[int]:
    """Token ids to append to a context whose last tokens are the engine's assistant turn (ending
    with the end-of-turn token, ``tokenizer.eos_token_id``) so that it continues as the template
    renders ``messages + new`` with the next assistant turn's header. ``messages`` is the
    conversation so far, its last message that assistant turn (as text).

    These tokens come from the template, not the policy: give them loss mask 0. Raises
    ``TemplateMismatch`` when the template renders ``messages`` differently once ``new`` follows,
    or does not end the assistant turn with the end-of-turn token."""
    seeing = any(m.get("images") for m in messages + new)  # (both through the processor's template, or neither)
    base = render_ids(tokenizer, messages, add_generation_prompt=False, tools=tools, seeing=seeing)
    full = render_ids(tokenizer, messages + new, add_generation_prompt=True, tools=tools, seeing=seeing)
    if full[: len(base)] != base:
        at = next((i for i, (a, b) in enumerate(zip(full, base)) if a != b), min(len(base), len(full)))
        raise TemplateMismatch(
            f"the chat template renders the conversation so far differently once new messages follow (first "
            f"difference at token {at} of {len(base)}: {base[at:at + 5]} becomes {full[at:at + 5]}); token-in-token-out "
            f"needs a template that renders earlier turns the same once later turns exist")
    eos = tokenizer.eos_token_id
    if eos not in base:
        raise TemplateMismatch(f"the chat template does not end an assistant turn with the end-of-turn token "
                               f"{tokenizer.eos_token!r} (id {eos}), where generation stops")
    after_eos = len(base) - base[::-1].index(eos)  # the separator the template puts after the turn's end
    return base[after_eos:] + full[len(base):]


ELIDED = "[{n} characters of output elided]"


def elide(messages: list[dict]) -> list[dict] | None:
    """``messages`` (copied) with every tool output replaced by a marker saying how much was cut (``env.context=
    elide``: the policy keeps its own turns, and the observations after them come whole); None when none is left
    to elide."""
    out, cut = [dict(m) for m in messages], 0
    for m in out:
        text = m.get("content")
        if m.get("role") == "tool" and isinstance(text, str) and not (text.startswith("[") and text.endswith(
                " characters of output elided]")):
            m["content"], cut = ELIDED.format(n=len(text)), cut + 1
            m.pop("images", None)  # (its images go with its text)
    return out if cut else None
