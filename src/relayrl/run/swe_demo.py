"""The workspace demo model's build (``relayrl.demo.swe_model``): scripted episodes of ``env.name=workspace`` on the
demo's repositories, and ``relayrl sft`` on them from a fresh tiny Llama.

A scripted episode is what the environment gives and takes, token for token (its prompt, its tools' outputs as
the editor prints them, Hermes tool calls):

    user:       `add_total(3, 5)` in `calc.py` returns -2; it should return 8. Fix `add_total`. + the instructions
    assistant:  <tool_call>{"name": "view", "arguments": {"path": "calc.py"}}</tool_call>
    tool:       the file, numbered
    assistant:  <tool_call>{"name": "str_replace", "arguments": {"path": "calc.py", "old_str": "def add_total(a, b):\\n
                    return a - b", "new_str": "def add_total(a, b):\\n    return a + b"}}</tool_call>
    tool:       edited calc.py: ...
    assistant:  <tool_call>{"name": "bash", "arguments": {"command": "... python -m pytest -q"}}</tool_call>
    tool:       2 passed
    assistant:  <tool_call>{"name": "submit", "arguments": {}}</tool_call>

or, in the other ``1 - fix_rate`` of them, the classic mistake: look, run the visible tests, see them pass,
submit with nothing changed. Which one an episode is, is drawn independently of the repository, so the warm
start knows the editor's contract (copying the file's name and the wrong function's lines, the fix of each bug
family) but not *that* it must fix before submitting. Its repositories are other draws than the held-out ones
(``builtin:swe-demo-eval``), which are left out.

    python -m relayrl.run.swe_demo OUT_DIR [RECIPE_JSON]
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
from pathlib import Path

from relayrl.demo import swe_task
from relayrl.demo.agent_model import CHAT_TEMPLATE, SPECIAL, train_tokenizer
from relayrl.demo.model import build_model, save_built
from relayrl.demo.swe_model import RECIPE
from relayrl.envs.workspace import INSTRUCTIONS
from relayrl.workspaces import editor
from relayrl.workspaces.sandbox import PATH

PYTEST = "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -q"  # (what the scripted episodes run)


def _call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def _pytest_output(rng: random.Random, n: int) -> str:
    dots = "." * n
    return f"{dots}{' ' * (73 - len(dots))}[100%]\n{n} passed in {rng.uniform(0.2, 0.9):.2f}s\n[exit code 0]"


def episode(c: dict, fix: bool, rng: random.Random) -> list[dict]:
    """The scripted conversation of one repository (``swe_task.content``): it fixes the bug or submits as is."""
    path, f = c["fix"]["path"], c["fix"]
    with tempfile.TemporaryDirectory() as tmp:
        file = os.path.join(tmp, path)
        Path(file).write_text(c["files"][path])
        shown = editor.view(file)
        edited = editor.str_replace(file, f["old"], f["new"]).replace(file, path)
    msgs = [{"role": "user", "content": c["statement"] + "\n\n" + INSTRUCTIONS.format(path=PATH)},
            {"role": "assistant", "content": _call("view", path=path)}, {"role": "tool", "content": shown}]
    if fix:
        msgs += [{"role": "assistant", "content": _call("str_replace", path=path, old_str=f["old"], new_str=f["new"])},
                 {"role": "tool", "content": edited}]
    msgs += [{"role": "assistant", "content": _call("bash", command=PYTEST)},
             {"role": "tool", "content": _pytest_output(rng, len(c["visible"]))},
             {"role": "assistant", "content": _call("submit")}]
    return msgs


def corpus(n: int, seed: int, fix_rate: float) -> list[list[dict]]:
    """``n`` scripted episodes on fresh repositories, none of them a held-out one's."""
    held_out_rng = random.Random(2)  # (builtin:swe-demo-eval's draws: swe_task.make_rows(32, seed=2))
    held_out = {swe_task.content(held_out_rng)["statement"] for _ in range(32)}
    rng, out = random.Random(seed), []
    while len(out) < n:
        c = swe_task.content(rng)
        if c["statement"] not in held_out:
            out.append(episode(c, rng.random() < fix_rate, rng))
    return out


def build(out_dir: str | os.PathLike, recipe: dict | None = None, log=print) -> Path:
    """Tokenizer, a fresh model, and ``relayrl sft`` on the scripted episodes; saved into ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM

    from relayrl.models import newest_checkpoint_of
    from relayrl.run.api import Run

    recipe = {**RECIPE, **(recipe or {})}
    torch.manual_seed(recipe["seed"])
    episodes = corpus(recipe["episodes"], recipe["seed"], recipe["fix_rate"])
    tokenizer = train_tokenizer([m["content"] for e in episodes[:2000] for m in e], recipe["vocab_size"], SPECIAL,
                                CHAT_TEMPLATE)
    with tempfile.TemporaryDirectory() as tmp:
        init = save_built(Path(tmp) / "init", build_model(tokenizer, recipe), tokenizer, recipe)
        data = Path(tmp) / "episodes.jsonl"
        data.write_text("".join(json.dumps({"id": f"s{i}", "messages": e}) + "\n" for i, e in enumerate(episodes)))
        log(f"building the workspace demo model: relayrl sft on {len(episodes)} scripted episodes ...")
        run = Run(command="sft", model={"path": str(init)}, data={"path": str(data), "eval_path": None},
                  sft={"epochs": recipe["sft_epochs"], "batch_size": recipe["sft_batch"]},
                  trainer={"lr": recipe["sft_lr"]}, run={"output_dir": tmp, "name": "sft", "seed": recipe["seed"],
                                                         "save_every": 0, "progress": False})
        run.train()
        model = AutoModelForCausalLM.from_pretrained(newest_checkpoint_of(str(Path(tmp) / "sft")))
        return save_built(out_dir, model, tokenizer, recipe)


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python -m relayrl.run.swe_demo OUT_DIR [RECIPE_JSON]")
    print(build(sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) == 3 else None))
