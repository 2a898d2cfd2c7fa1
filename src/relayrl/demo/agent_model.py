"""Build the agent demo policy offline: a byte-level BPE tokenizer and a tiny Llama that knows the
calculator tool-call format but does not use it reliably.

Nothing is downloaded. ``build_agent_demo_model(path)`` trains the tokenizer on generated
conversations of the agent demo task (``relayrl.demo.agent_task``), builds a small Llama from a
config and fine-tunes it on multi-turn reference episodes, with loss on the assistant turns only.
Episodes either call the calculator (call, tool result, ``\\boxed{result}``) or answer directly
with the true product boxed, drawn at random per episode, independently of the prompt. The first
assistant token (the decision) is supervised as 35% tool, 65% direct; more episodes than that use
the tool (``tool_episodes``), the extra ones without loss on their first token, so that the call
format and the copying (of the factors into the call, of the result into the answer) are learnt
reliably in few steps. The model calls the tool about a third of the time when sampled, and then
gets the product right ~95% of the time, but answers directly, and nearly always wrong, when
decoded greedily: RL has to teach it *when* to call.

Both are saved with ``save_pretrained``, so the rest of relayrl loads it like any other model:
``AutoModelForCausalLM.from_pretrained(path)``. Regenerate by hand with
``python -m relayrl.demo.agent_model OUT_DIR``. It is deterministic for a given seed and takes
about 75 seconds on a 2-core CPU.
"""

from __future__ import annotations

import math
import os
import random
import sys
import time
from pathlib import Path

import torch

from relayrl.demo import agent_task
from relayrl.demo.model import _key, build_model, save_built, shipped_or_cached

# Every turn renders the same whatever follows it (token-in, token-out multi-turn needs that).
# The ``tools=`` argument is ignored on purpose: a model this small cannot read a schema; it knows
# the one calculator call from its warm start.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}<|system|>{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<|user|>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}<|end|>"
    "{% elif m['role'] == 'tool' %}<|tool|>{{ m['content'] }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]

# Everything that changes the built model; its hash names the cache folder.
RECIPE = {
    "version": 1,
    "vocab_size": 512,
    "tokenizer_texts": 2000,
    "hidden_size": 192,
    "layers": 4,
    "heads": 4,
    "intermediate_size": 768,
    "sft_steps": 400,
    "sft_batch": 32,
    "sft_lr": 1e-3,
    "tool_rate": 0.35,  # share of the decision supervised as "call the tool"
    "tool_episodes": 0.8,  # share of warm-start episodes that use the tool
    "seed": 1234,
}


def build_tokenizer(seed: int, vocab_size: int, n_texts: int = 2000):
    text = [m["content"] for conv in agent_task.corpus(n_texts, seed, tool_rate=0.5) for m in conv]
    return train_tokenizer(text, vocab_size)


def train_tokenizer(text: list[str], vocab_size: int, special: list[str] = SPECIAL, template: str = CHAT_TEMPLATE):
    """A byte-level BPE tokenizer trained on ``text``, with ``special`` tokens (pad, end of turn, the roles)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Digits stay single tokens: merged digit strings make copying and arithmetic needlessly hard.
    # Everything else may merge across spaces and punctuation (no GPT-2 regex split), so the fixed
    # tool-call JSON around the expression becomes two tokens and "\boxed{" one.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(text, trainer)
    # padding_side survives save_pretrained only when given to the constructor.
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=special[0],
        eos_token=special[1],
        padding_side="left",
        chat_template=template,
        additional_special_tokens=special[2:],
    )


def assistant_mask(tokenizer, ids: list[int]) -> list[bool]:
    """True on the tokens of every assistant turn's content and its ``<|end|>`` (not the
    ``<|assistant|>`` header, nor user, tool or system tokens)."""
    start, end = tokenizer.convert_tokens_to_ids(["<|assistant|>", "<|end|>"])
    mask, inside = [], False
    for t in ids:
        if t == start:
            mask.append(False)
            inside = True
            continue
        mask.append(inside)
        if t == end:
            inside = False
    return mask


def encode_conversation(tokenizer, messages: list[dict], decide: bool = True) -> tuple[list[int], list[int]]:
    """Token ids of the whole conversation as the template renders it, and labels (-100 off the
    assistant turns). ``decide=False`` also takes the loss off the first assistant token (where
    the policy decides between calling the tool and answering)."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    labels = [t if m else -100 for t, m in zip(ids, assistant_mask(tokenizer, ids))]
    if not decide:
        first = next(i for i, t in enumerate(labels) if t != -100)
        labels[first] = -100
    return ids, labels


def sft_examples(tokenizer, recipe: dict, n: int) -> list[tuple[list[int], list[int]]]:
    """``n`` encoded warm-start episodes. A share ``tool_episodes`` of them call the tool; if that
    is above ``tool_rate``, some of the tool episodes carry no loss on their first token, so that
    the decision is still supervised as tool : direct = tool_rate : 1 - tool_rate (and the extra
    episodes only train the call's format, the copying of the factors and of the result)."""
    t, r = recipe["tool_episodes"], recipe["tool_rate"]
    if not 0 < r <= t < 1:
        raise ValueError(f"need 0 < tool_rate <= tool_episodes < 1, got {r} and {t}")
    keep = r * (1 - t) / (t * (1 - r))  # P(decision supervised | tool episode)
    rng = random.Random(recipe["seed"] + 2)
    return [
        encode_conversation(tokenizer, c, decide=len(c) == 2 or rng.random() < keep)
        for c in agent_task.corpus(n, recipe["seed"] + 1, tool_rate=t)
    ]


def sft_batch(encoded: list[tuple[list[int], list[int]]], pad: int):
    """Right-padded batch of (ids, labels) pairs."""
    n = max(len(ids) for ids, _ in encoded)
    ids = torch.tensor([s + [pad] * (n - len(s)) for s, _ in encoded])
    lab = torch.tensor([lb + [-100] * (n - len(lb)) for _, lb in encoded])
    att = torch.tensor([[1] * len(s) + [0] * (n - len(s)) for s, _ in encoded])
    return ids, att, lab


def sft_loss(model, encoded: list[tuple[list[int], list[int]]], pad: int) -> torch.Tensor:
    """Mean loss per supervised token over ``encoded``. Short (direct-answer) and long (tool)
    episodes go through the model as separate batches, so short ones are not padded to the long
    ones' length; the loss is the same as one padded batch's."""
    by_len = sorted(encoded, key=lambda e: len(e[0]))
    cut = max(range(1, len(by_len)), key=lambda i: len(by_len[i][0]) - len(by_len[i - 1][0]), default=len(by_len))
    total = torch.zeros(())
    n_tokens = sum(sum(t != -100 for t in lab[1:]) for _, lab in encoded)
    for part in (by_len[:cut], by_len[cut:]):
        if not part:
            continue
        ids, att, lab = sft_batch(part, pad)
        logits = model(input_ids=ids, attention_mask=att).logits[:, :-1]
        total = total + torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), lab[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
        )
    return total / n_tokens


def warm_start(model, tokenizer, recipe: dict, log=print) -> None:
    torch.manual_seed(recipe["seed"])
    opt = torch.optim.AdamW(model.parameters(), lr=recipe["sft_lr"], weight_decay=0.0)
    steps, bs = recipe["sft_steps"], recipe["sft_batch"]
    encoded = sft_examples(tokenizer, recipe, steps * bs)
    model.train()
    t0 = time.time()
    for step in range(steps):
        # linear warm-up, then cosine decay to a tenth
        warm = min(1.0, (step + 1) / 20)
        decay = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps))
        for g in opt.param_groups:
            g["lr"] = recipe["sft_lr"] * warm * decay
        loss = sft_loss(model, encoded[step * bs : (step + 1) * bs], tokenizer.pad_token_id)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            log(f"  sft step {step + 1}/{steps} loss {loss.item():.3f} ({time.time() - t0:.0f}s)")
    model.eval()


def build_agent_demo_model(out_dir: str | os.PathLike, recipe: dict | None = None, log=print) -> Path:
    """Build tokenizer + warm-started model into ``out_dir`` (atomically: tmp dir then rename)."""
    recipe = {**RECIPE, **(recipe or {})}
    torch.manual_seed(recipe["seed"])
    tokenizer = build_tokenizer(recipe["seed"], recipe["vocab_size"], recipe["tokenizer_texts"])
    model = build_model(tokenizer, recipe)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"building agent demo model ({n_params / 1e6:.2f}M params), supervised warm start ...")
    warm_start(model, tokenizer, recipe, log)
    return save_built(out_dir, model, tokenizer, recipe)


def recipe_key(recipe: dict | None = None) -> str:
    return _key({**RECIPE, **(recipe or {})})


SHIPPED = Path(__file__).parent / "agent_weights"


def agent_demo_model_path(log=print) -> Path:
    """The agent demo model: the shipped weights if they match ``RECIPE``, else built once and
    cached (under $RELAYRL_CACHE or ~/.cache/relayrl)."""
    return shipped_or_cached(SHIPPED, RECIPE, "agent-demo-model", lambda path: build_agent_demo_model(path, log=log))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m relayrl.demo.agent_model OUT_DIR")
    print(build_agent_demo_model(sys.argv[1]))
