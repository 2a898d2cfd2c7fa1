"""Build the demo policy offline: a byte-level BPE tokenizer and a tiny Llama, warm-started by SFT.

Nothing is downloaded. ``build_demo_model(path)`` trains the tokenizer on generated text,
builds a 1.8M-parameter Llama from a config, fine-tunes it briefly on reference solutions of
the demo task (so that it starts RL with partial skill, ~30% accuracy) and saves both with
``save_pretrained``, so the rest of relayrl loads it like any other model:
``AutoModelForCausalLM.from_pretrained(path)``.

Regenerate by hand with ``relayrl build-demo-model OUT`` (or ``python -m relayrl.demo.model OUT``). It is
deterministic for a given seed. Its time is the warm start's 350 steps and depends on what else the CPU
runs: on a 2-core AMD EPYC shared with other jobs (load average 8 to 10) the first 61 steps took 834 s
(`time`, 2026-11-27: about 80 minutes projected; issue 39 saw 9 minutes on a loaded machine); it was not
measured on an idle one.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from relayrl.demo import task

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}<|system|>{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<|user|>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}<|end|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]

# Everything that changes the built model; its hash names the cache folder.
RECIPE = {
    "version": 3,
    "vocab_size": 384,
    "hidden_size": 192,
    "layers": 4,
    "heads": 4,
    "intermediate_size": 512,
    "sft_steps": 350,
    "sft_batch": 32,
    "sft_lr": 1e-3,
    "sft_slip": 0.25,
    "seed": 1234,
}


def build_tokenizer(seed: int, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Digits stay single tokens: merged digit strings make arithmetic needlessly hard to learn.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    text = [p + " " + s for p, s in task.corpus(2000, seed)]
    tok.train_from_iterator(text, trainer)
    # padding_side survives save_pretrained only when given to the constructor.
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        eos_token="<|end|>",
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"],
    )


def build_model(tokenizer, recipe: dict):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=recipe["hidden_size"],
        intermediate_size=recipe["intermediate_size"],
        num_hidden_layers=recipe["layers"],
        num_attention_heads=recipe["heads"],
        num_key_value_heads=recipe["heads"],
        max_position_embeddings=recipe.get("max_positions", 512),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    return AutoModelForCausalLM.from_config(cfg)


def sft_batch(tokenizer, pairs):
    """Right-padded SFT batch with loss on response tokens only."""
    seqs, labels = [], []
    for prompt, solution in pairs:
        p = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        p = p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p
        r = tokenizer(solution, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seqs.append(list(p) + r)
        labels.append([-100] * len(p) + r)
    n = max(len(s) for s in seqs)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([s + [pad] * (n - len(s)) for s in seqs])
    lab = torch.tensor([lb + [-100] * (n - len(lb)) for lb in labels])
    att = torch.tensor([[1] * len(s) + [0] * (n - len(s)) for s in seqs])
    return ids, att, lab


def warm_start(model, tokenizer, recipe: dict, log=print) -> None:
    torch.manual_seed(recipe["seed"])
    opt = torch.optim.AdamW(model.parameters(), lr=recipe["sft_lr"], weight_decay=0.0)
    steps, bs = recipe["sft_steps"], recipe["sft_batch"]
    pairs = task.corpus(steps * bs, recipe["seed"] + 1, recipe["sft_slip"])
    model.train()
    t0 = time.time()
    for step in range(steps):
        ids, att, lab = sft_batch(tokenizer, pairs[step * bs : (step + 1) * bs])
        lr = recipe["sft_lr"] * min(1.0, (step + 1) / 10)
        for g in opt.param_groups:
            g["lr"] = lr
        loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 20 == 0 or step == steps - 1:
            log(f"  sft step {step + 1}/{steps} loss {loss.item():.3f} ({time.time() - t0:.0f}s)")
    model.eval()


def build_demo_model(out_dir: str | os.PathLike, recipe: dict | None = None, log=print) -> Path:
    """Build tokenizer + warm-started model into ``out_dir`` (atomically: tmp dir then rename)."""
    recipe = {**RECIPE, **(recipe or {})}
    torch.manual_seed(recipe["seed"])
    tokenizer = build_tokenizer(recipe["seed"], recipe["vocab_size"])
    model = build_model(tokenizer, recipe)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"building demo model ({n_params / 1e6:.2f}M params), supervised warm start ...")
    warm_start(model, tokenizer, recipe, log)
    return save_built(out_dir, model, tokenizer, recipe)


def save_built(out_dir: str | os.PathLike, model, tokenizer, recipe: dict, processor=None) -> Path:
    """``save_pretrained`` both (a vision-language model's ``processor`` in the tokenizer's place), with the recipe
    beside them, into ``out_dir`` atomically."""
    from relayrl.files import share

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not (out / "relayrl_recipe.json").exists():
        # (it is replaced whole: a folder of other things, a home or a project, must never be)
        raise ValueError(f"{out} exists and is not a demo model built before (no relayrl_recipe.json in it): "
                         "give a new folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".building-"))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(tmp)
    (processor or tokenizer).save_pretrained(tmp)
    (tmp / "relayrl_recipe.json").write_text(json.dumps(recipe, indent=1))
    share([tmp, *tmp.rglob("*")])  # (mkdtemp's 0700 and safetensors' 0600 would keep the model from other users)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def recipe_key(recipe: dict | None = None) -> str:
    return _key({**RECIPE, **(recipe or {})})


def _key(recipe: dict) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def shipped_or_cached(shipped: Path, recipe: dict, name: str, build) -> Path:
    """``shipped`` if its recipe equals ``recipe``, else ``build(path)`` once into a cache folder
    named by the recipe's hash (under $RELAYRL_CACHE or ~/.cache/relayrl)."""
    recipe_file = shipped / "relayrl_recipe.json"
    if recipe_file.exists() and json.loads(recipe_file.read_text()) == recipe:
        return shipped
    root = Path(os.environ.get("RELAYRL_CACHE", Path.home() / ".cache" / "relayrl"))
    path = root / f"{name}-{_key(recipe)}"
    if not (path / "config.json").exists():
        build(path)
    return path


SHIPPED = Path(__file__).parent / "weights"


def demo_model_path(log=print) -> Path:
    """The demo model: the shipped weights if they match ``RECIPE``, else built once and cached."""
    return shipped_or_cached(SHIPPED, RECIPE, "demo-model", lambda path: build_demo_model(path, log=log))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m relayrl.demo.model OUT_DIR")
    print(build_demo_model(sys.argv[1]))
