"""The built-in vision-language demo (``builtin:vlm-demo``): read a digit off an image, the one the prompt points at.

Each image shows two digits side by side, drawn with PIL at a jittered place; the prompt asks "Which digit is on the
left?" (or right), and the answer is that digit. The policy is a small Idefics3 (``vision_model``: a SigLIP-style
tower, a pixel-shuffle connector, a Llama; 0.54M parameters) warm-started in two parts, both supervised:

1. the tower and connector learn to see both digits (a probe head on the image features, thrown away after);
2. the whole model then learns to answer, briefly: it starts RL reading the features poorly (about a third right,
   greedy), the tower already good. RL (``examples/vlm_demo.yaml``, the tower frozen, the default) trains the
   language model to read what the tower sees.

Nothing is downloaded; rows are made in memory, their images kept as PNG data URLs. Built weights ship in
``vlm_weights/``; ``python -m relayrl.demo.vlm_demo OUT`` rebuilds them (deterministic for a seed, about a minute
on two cores).
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

import torch

from relayrl.demo import vision_model

RECIPE = {
    "version": 1,
    "image_size": 64,
    "vision": {"hidden_size": 64, "intermediate_size": 128},
    "text": {"hidden_size": 128, "intermediate_size": 256},
    "probe_steps": 500,
    "answer_steps": 200,
    "batch": 32,
    "lr": 1e-3,
    "seed": 1234,
}
SIDES = ("left", "right")
QUESTION = "Which digit is on the {side}?"
SHIPPED = Path(__file__).parent / "vlm_weights"


def render(left: int, right: int, rng: random.Random, size: int = 64):
    """A white square with ``left`` and ``right`` drawn in black, each at a jittered place in its half."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default(size=28 * size // 64)
    im = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(im)
    for k, digit in enumerate((left, right)):
        x = k * size // 2 + 2 + rng.randrange(size // 8)
        draw.text((x, size // 6 + rng.randrange(size // 4)), str(digit), font=font, fill="black")
    return im


def example(rng: random.Random):
    """(image, side, digits, answer) of one example."""
    left, right, side = rng.randrange(10), rng.randrange(10), rng.choice(SIDES)
    return render(left, right, rng), side, (left, right), left if side == "left" else right


def make_rows(n: int, seed: int, id_prefix: str) -> list[dict]:
    """Prompt rows (the image a PIL image, which the data reader keeps as a data URL)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        image, side, _, answer = example(rng)
        rows.append({"id": f"{id_prefix}-{i}", "prompt": QUESTION.format(side=side), "images": [image],
                     "answer": str(answer)})
    return rows


def _batch(processor, rng: random.Random, n: int):
    texts, images, digits, answers = [], [], [], []
    for _ in range(n):
        image, side, pair, answer = example(rng)
        texts.append(processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION.format(side=side)}]}],
            add_generation_prompt=True, tokenize=False))
        images.append([image])
        digits.append(pair)
        answers.append(answer)
    x = processor(text=texts, images=images, return_tensors="pt", padding=True)
    return x, torch.tensor(digits), answers


def warm_start(model, processor, recipe: dict, log=print) -> None:
    """The two supervised parts (the module's docstring)."""
    torch.manual_seed(recipe["seed"])
    rng, bs, t0 = random.Random(recipe["seed"] + 1), recipe["batch"], time.time()
    inner = model.model
    tower = list(inner.vision_model.parameters()) + list(inner.connector.parameters())
    probe = torch.nn.Linear(vision_model.image_seq_len(recipe["image_size"]) * model.config.text_config.hidden_size,
                            20)
    opt = torch.optim.AdamW(tower + list(probe.parameters()), lr=recipe["lr"])
    model.train()
    for step in range(recipe["probe_steps"]):
        x, digits, _ = _batch(processor, rng, bs)
        f = inner.get_image_features(pixel_values=x["pixel_values"], pixel_attention_mask=x["pixel_attention_mask"])
        logits = probe(getattr(f, "pooler_output", f).reshape(bs, -1)).reshape(bs * 2, 10)
        loss = torch.nn.functional.cross_entropy(logits, digits.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % 100 == 0:
            log(f"  seeing: step {step + 1}/{recipe['probe_steps']} loss {loss.item():.3f} ({time.time() - t0:.0f}s)")
    tok = processor.tokenizer
    opt = torch.optim.AdamW(model.parameters(), lr=recipe["lr"])
    for step in range(recipe["answer_steps"]):
        x, _, answers = _batch(processor, rng, bs)
        answer = torch.tensor([tok(str(a), add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for a in answers])
        ids = torch.cat([x["input_ids"], answer], 1)
        att = torch.cat([x["attention_mask"], torch.ones_like(answer)], 1)
        labels = torch.full_like(ids, -100)
        labels[:, -answer.shape[1]:] = answer
        loss = model(input_ids=ids, attention_mask=att, pixel_values=x["pixel_values"],
                     pixel_attention_mask=x["pixel_attention_mask"], labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % 50 == 0:
            log(f"  answering: step {step + 1}/{recipe['answer_steps']} loss {loss.item():.3f} "
                f"({time.time() - t0:.0f}s)")
    model.eval()


def build_vlm_demo_model(out_dir: str | os.PathLike, recipe: dict | None = None, log=print) -> Path:
    """Tokenizer, processor and warm-started model into ``out_dir`` (atomically: a temporary folder, renamed)."""
    recipe = {**RECIPE, **(recipe or {})}
    tokenizer = vision_model.build_tokenizer(list(SIDES) + ["Which", "digit", "on"])
    processor = vision_model.build_processor(tokenizer, recipe["image_size"])
    torch.manual_seed(recipe["seed"])
    model = vision_model.build_model(processor.tokenizer, recipe["image_size"], recipe["vision"], recipe["text"])
    log(f"building the VLM demo model ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params), "
        "supervised warm start ...")
    warm_start(model, processor, recipe, log)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.generation_config, key, getattr(tokenizer, key))
    from relayrl.demo.model import save_built

    return save_built(out_dir, model, tokenizer, recipe, processor)


def vlm_demo_model_path(log=print) -> Path:
    """The shipped weights if they match ``RECIPE``, else built once and cached."""
    from relayrl.demo.model import shipped_or_cached

    return shipped_or_cached(SHIPPED, RECIPE, "vlm-demo-model", lambda path: build_vlm_demo_model(path, log=log))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m relayrl.demo.vlm_demo OUT_DIR")
    print(build_vlm_demo_model(sys.argv[1]))
