"""The GUI agent demo's model (``builtin:gui-demo``, ``examples/gui_agent.yaml``): the VLM demo's model warm-started on
scripted trajectories of ``env.name=gui`` (``relayrl.run.gui_demo`` builds it; shipped in ``gui_weights/``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from relayrl.demo.model import shipped_or_cached

RECIPE = {
    "base": "vlm-demo",  # relayrl.demo.vlm_demo's shipped weights
    "steps": 150,
    "batch": 16,
    "lr": 1e-3,
    "seed": 4321,
    "size": 64,
}
SHIPPED = Path(__file__).parent / "gui_weights"


def build_gui_demo_model(out_dir: str | os.PathLike, recipe: dict | None = None, log=print) -> Path:
    """``relayrl.run.gui_demo``'s build, in a process of its own (its torch threads and seeds its own)."""
    log("building the GUI demo model (a supervised warm start on scripted trajectories, about a minute) ...")
    r = subprocess.run([sys.executable, "-m", "relayrl.run.gui_demo", str(out_dir), json.dumps({**RECIPE, **(recipe or {})})],
                       check=False)
    if r.returncode != 0:
        raise RuntimeError(f"building the GUI demo model failed (exit {r.returncode}): its output is above")
    return Path(out_dir)


def gui_demo_model_path(log=print) -> Path:
    """The shipped weights if they match ``RECIPE``, else built once and cached."""
    return shipped_or_cached(SHIPPED, RECIPE, "gui-demo-model", lambda path: build_gui_demo_model(path, log=log))
