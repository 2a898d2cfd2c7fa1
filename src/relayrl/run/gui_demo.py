"""The GUI agent demo model's build (``relayrl.demo.gui_model``, ``builtin:gui-demo``): the VLM demo's model
(``relayrl.demo.vlm_demo``) warm-started by supervised fine-tuning on scripted trajectories of the GUI environment's
built-in tasks (``relayrl.envs.gui.make_task``: two screens, a button and a text field on each; ``Click OK, then
Save.``).

A scripted trajectory is an episode as ``env.name=gui`` runs it, token for token: the instruction with the first
screenshot, the scripted action (``click(x, y)`` at the centre of the right button), the template's tokens for the
next screenshot, the next action. The loss is on the actions' tokens, the vision tower frozen. The warm start is
short: the policy learns the action's form, and finds the button only sometimes; RL (``examples/gui_agent.yaml``)
does the rest.

    python -m relayrl.run.gui_demo OUT_DIR    # rebuilds it (about a minute on two cores)
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import torch

from relayrl.demo import vlm_demo
from relayrl.demo.gui_model import RECIPE
from relayrl.demo.model import save_built
from relayrl.envs import gui
from relayrl.envs.chat import next_turn_suffix, render_ids
from relayrl.models import images, load_policy, load_tokenizer, vision


def action(task: dict, screen: int) -> str:
    """The scripted action on ``screen``: a click at the centre of its goal's button."""
    spec = task["screens"][screen]
    box = next(w["box"] for w in spec["widgets"] if w["label"] == spec["goals"][0]["click"])
    return f"click({(box[0] + box[2]) // 2}, {(box[1] + box[3]) // 2})"


def trajectory(tok, rng: random.Random, size: int) -> tuple[list[int], list[int], list[str]]:
    """(token ids, labels: the actions' ids and -100 elsewhere, image references) of one scripted episode."""
    instruction, task = gui.make_task(rng, size=size)
    screens = [gui.Screen(s, (size, size)) for s in task["screens"]]
    shots = [images.to_ref(s.render(), None, "gui demo") for s in screens]
    messages = [{"role": "user", "content": f"{images.IMAGE}{instruction}", "images": [shots[0]]}]
    ids = render_ids(tok, messages, True)
    labels = [-100] * len(ids)
    for k in range(len(screens)):
        if k:
            new = [{"role": "user", "content": images.IMAGE, "images": [shots[k]]}]
            suffix = next_turn_suffix(tok, messages, new)
            messages += new
            ids, labels = ids + suffix, labels + [-100] * len(suffix)
        act = tok(action(task, k), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        messages.append({"role": "assistant", "content": action(task, k)})
        ids, labels = ids + act, labels + act
    return ids, labels, shots


def warm_start(model, tok, recipe: dict, log=print) -> None:
    torch.manual_seed(recipe["seed"])
    rng, t0 = random.Random(recipe["seed"] + 1), time.time()
    vision.freeze_tower(model, False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=recipe["lr"])
    model.train()
    for step in range(recipe["steps"]):
        rows = [trajectory(tok, rng, recipe["size"]) for _ in range(recipe["batch"])]
        n = max(len(r[0]) for r in rows)
        ids = torch.tensor([r[0] + [tok.pad_token_id] * (n - len(r[0])) for r in rows])
        labels = torch.tensor([r[1] + [-100] * (n - len(r[1])) for r in rows])
        att = torch.tensor([[1] * len(r[0]) + [0] * (n - len(r[0])) for r in rows])
        loss = model(**vision.inputs(model, ids, [r[2] for r in rows]), attention_mask=att, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % 20 == 0:
            log(f"  acting: step {step + 1}/{recipe['steps']} loss {loss.item():.3f} ({time.time() - t0:.0f}s)")
    model.eval()


def build_gui_demo_model(out_dir: str | os.PathLike, recipe: dict | None = None, log=print) -> Path:
    """The warm-started model with its processor into ``out_dir`` (atomically: a temporary folder, renamed)."""
    recipe = {**RECIPE, **(recipe or {})}
    base = str(vlm_demo.vlm_demo_model_path(log))
    tok, model = load_tokenizer(base, "chat"), load_policy(base)
    log(f"building the GUI demo model: {recipe['steps']} steps of supervised warm start on scripted trajectories ...")
    warm_start(model, tok, recipe, log)
    return save_built(out_dir, model, tok, recipe, vision.processor_of(tok))


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python -m relayrl.run.gui_demo OUT_DIR [RECIPE_JSON]")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    print(build_gui_demo_model(sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) == 3 else None))
