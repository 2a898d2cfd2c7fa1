"""The endpoint's overhead: the agent demo's task as a plain OpenAI-SDK program
(``examples/openai_agent.py``: every turn an HTTP request to relayrl's endpoint, recorded as tokens)
against the in-process ``ToolEnv`` (``examples/agent_demo.yaml``: the same model, prompts, tool,
budgets and reward), one run each, each in its own process, the full demo (40 steps) by default.

Prints samples/s of the training loop (the before/after evaluations left out) and their ratio (the
endpoint's overhead), held-out accuracy sampled and greedy before → after, the tool-call rate, and
the whole command's time.

    python benchmarks/agent_endpoint.py                      # both, 40 steps (~1 min each on 2 idle cores)
    python benchmarks/agent_endpoint.py --steps 20 run.mode=async
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_info, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SETUPS = {
    "ToolEnv (in-process)": "examples/agent_demo.yaml",
    "OpenAI-SDK program via the endpoint": "examples/openai_agent.yaml",
}


def run_setup(config: str, steps: int | None, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "relayrl.cli", "train", config, f"run.output_dir={d}", "run.name=bench",
               "run.progress=false", "run.save_every=0", *([f"run.steps={steps}"] if steps else []), *extra]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH"))
                                                            if p)}
        t0 = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
        seconds = time.perf_counter() - t0
        run = Path(d) / "bench"
        s = json.loads((run / "summary.json").read_text())
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    loop = sum(r["time/step"] for r in rows)
    return {"samples_per_s": s["samples"] / loop, "loop_seconds": loop, "command_seconds": seconds,
            "accuracy": (s["eval_accuracy_before"], s["eval_accuracy_after"]),
            "greedy": (s["eval_greedy_accuracy_before"], s["eval_greedy_accuracy_after"]),
            "tool_call_rate": (s["eval_tool_call_rate_before"], s["eval_tool_call_rate_after"]),
            "failed": sum(s["episodes_left_out"].values()),
            "branches": sum(r.get("serve/branches", 0) for r in rows),
            "overrides": sum(r.get("serve/sampling_overrides", 0) for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: the demo's 40)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--name", default="agent_endpoint", help="results file name (without extension)")
    ap.add_argument("overrides", nargs="*", help="extra section.key=value for both setups")
    args = ap.parse_args()
    res = {name: run_setup(config, args.steps, args.overrides) for name, config in SETUPS.items()}
    base = res["ToolEnv (in-process)"]["samples_per_s"]
    pct = lambda a: f"{a[0]:.1%} → {a[1]:.1%}"  # noqa: E731
    header = ["setup", "samples/s", "vs ToolEnv", "accuracy (sampled)", "greedy", "tool-call rate",
              "episodes failed", "extra branches", "whole command"]
    rows = [[name, f"{v['samples_per_s']:.2f}", f"{v['samples_per_s'] / base:.2f}x", pct(v["accuracy"]),
             pct(v["greedy"]), pct(v["tool_call_rate"]), v["failed"], v["branches"], f"{v['command_seconds']:.0f} s"]
            for name, v in res.items()]
    write_results(Path(args.out), args.name, header, rows,
                  {"machine": machine_info(), "steps": args.steps or 40, "overrides": args.overrides, "results": res})


if __name__ == "__main__":
    main()
