"""Token-in, token-out multi-turn context: the engine's own tokens are kept, and only the tokens
the chat template adds for new messages (tool results, the next user turn, the next assistant
header, the separators between turns) are tokenized, as a suffix. The history is never
re-rendered into the trajectory: re-tokenising drifts (a missing "\\n" after ``<|im_end|>``,
verl #3720; BPE merges across a turn boundary), and costs most of the generation time at
many turns.

The suffix is where the template's rendering of the whole conversation goes past the tokens the
trajectory already holds. That only works if those tokens *are* a prefix of the rendering: a
template that renders earlier turns differently once later ones exist (some drop earlier
reasoning) breaks it, and then ``next_turn_suffix`` fails closed with ``TemplateMismatch``
instead of training on a context the model would never see.
"""

from __future__ import annotations


class TemplateMismatch(ValueError):
    pass


def render_ids(tokenizer, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None
               ) -> list[int]:
    """The chat template's token ids for ``messages``."""
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5: a BatchEncoding


def next_turn_suffix(tokenizer, context_ids: list[int], messages: list[dict], tools: list[dict] | None = None
                     ) -> list[int]:
    """Token ids to append to ``context_ids`` (the prompt and every turn so far, as the engine
    saw and produced them) so that the context becomes the template's rendering of ``messages``
    (the same conversation plus the new messages) with the next assistant turn's header.

    These tokens come from the template, not the policy: give them loss mask 0. Raises
    ``TemplateMismatch`` when ``context_ids`` is not a prefix of that rendering."""
    full = render_ids(tokenizer, messages, add_generation_prompt=True, tools=tools)
    n = len(context_ids)
    if full[:n] != list(context_ids):
        at = next((i for i, (a, b) in enumerate(zip(full, context_ids)) if a != b), min(n, len(full)))
        raise TemplateMismatch(
            f"the chat template renders this conversation differently from the tokens the trajectory holds "
            f"(first difference at token {at} of {n}: template {full[at:at + 5]} vs trajectory "
            f"{list(context_ids[at:at + 5])}); token-in-token-out needs a template that renders earlier turns "
            f"the same once later turns exist")
    return full[n:]
