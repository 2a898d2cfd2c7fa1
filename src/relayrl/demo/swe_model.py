"""The workspace demo's policy: a byte-level BPE tokenizer and a tiny Llama, warm-started by ``relayrl sft`` on
scripted episodes of ``env.name=workspace`` on the demo's repositories (``relayrl.demo.swe_task``), that knows the
tools but fixes the bug only about a third of the time: RL has to teach it to fix before it submits. The
episodes and the build are ``relayrl.run.swe_demo``'s (they use the workspace tools and ``relayrl sft``, above
this package), run in a process of their own when the shipped weights do not match ``RECIPE``.

Saved with ``save_pretrained``: ``AutoModelForCausalLM.from_pretrained(path)`` loads it. Shipped in
``swe_weights/``; rebuilt (and cached) when ``RECIPE`` changes; by hand ``python -m relayrl.run.swe_demo OUT``
(about 4 minutes on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from relayrl.demo import swe_task
from relayrl.demo.model import _key, shipped_or_cached

RECIPE = {
    "version": 1,
    "task_version": swe_task.VERSION,
    "vocab_size": 768,
    "hidden_size": 192,
    "layers": 4,
    "heads": 4,
    "intermediate_size": 768,
    "max_positions": 1024,
    "episodes": 4000,
    "fix_rate": 0.3,  # share of scripted episodes that fix the bug (the others submit it unchanged)
    "sft_epochs": 2,
    "sft_batch": 32,
    "sft_lr": 1e-3,
    "seed": 4321,
}


def build_swe_demo_model(out_dir: str | os.PathLike, recipe: dict | None = None, log=print) -> Path:
    """``relayrl.run.swe_demo``'s build, in a process of its own (its torch threads and seeds its own)."""
    recipe = {**RECIPE, **(recipe or {})}
    log("building the workspace demo model (relayrl sft on scripted episodes, a few minutes) ...")
    r = subprocess.run([sys.executable, "-m", "relayrl.run.swe_demo", str(out_dir), json.dumps(recipe)], check=False)
    if r.returncode != 0:
        raise RuntimeError(f"building the workspace demo model failed (exit {r.returncode}): its output is above")
    return Path(out_dir)


def recipe_key(recipe: dict | None = None) -> str:
    return _key({**RECIPE, **(recipe or {})})


SHIPPED = Path(__file__).parent / "swe_weights"


def swe_demo_model_path(log=print) -> Path:
    """The workspace demo model: the shipped weights if they match ``RECIPE``, else built once and cached."""
    return shipped_or_cached(SHIPPED, RECIPE, "swe-demo-model", lambda path: build_swe_demo_model(path, log=log))
