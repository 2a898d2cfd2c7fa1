"""Pipeline modes side by side on the default long-tail task.

Same model, prompts, group size, number of training samples and held-out set in each mode;
prints samples/s, generated tokens/s, engine idle %, trainer idle %, held-out accuracy, and each
mode's speed ratio to ``sync``. Overlapped modes run with their default placement (the engine in
its own process, the cores split). Async runs are not deterministic: repeat them before reading
an accuracy difference.

    python benchmarks/async_vs_sync.py                 # the full default run per mode (1.5-4 min each)
    python benchmarks/async_vs_sync.py --steps 30 --modes sync "async η=4"
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import FIXED_GROUPS, machine_info, write_results  # noqa: E402

MODES = {
    "sync": ["run.mode=sync", "rollout.partial=false"],
    "sync+partial": ["run.mode=sync", "rollout.partial=true"],
    "periodic": ["run.mode=periodic", "rollout.partial=false"],
    "periodic+partial": ["run.mode=periodic", "rollout.partial=true"],
    "async η=2+partial": ["run.mode=async", "rollout.max_staleness=2", "rollout.partial=true"],
    "async η=4+partial": ["run.mode=async", "rollout.max_staleness=4", "rollout.partial=true"],
    "async η=2": ["run.mode=async", "rollout.max_staleness=2", "rollout.partial=false"],
    "async η=4": ["run.mode=async", "rollout.max_staleness=4", "rollout.partial=false"],
}


def slug(mode: str) -> str:
    return "".join(c if c.isalnum() or c in "_-" else "_" for c in mode.replace("η=", "eta"))


def run_mode(name: str, steps: int, extra: list[str], out: Path, setup: list[str] | None = None) -> dict:
    """One training run of the default task (``setup``: its overrides, default ``MODES[name]``)."""
    from relayrl.config import load_config
    from relayrl.run.loop import train

    with tempfile.TemporaryDirectory() as d:
        cfg = load_config(None, [f"run.output_dir={d}", f"run.name={slug(name)}", f"run.steps={steps}",
                                 "run.progress=false", *FIXED_GROUPS, *(MODES[name] if setup is None else setup),
                                 *extra])
        t0 = time.perf_counter()
        summary = train(cfg)
        rows = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(cfg.run_dir / "timeline.png", out / f"timeline_{slug(name)}.png")
    wall = sum(r["time/step"] for r in rows)  # the training loop, without the before/after evaluations
    weighted = lambda k: sum(r[k] * r["time/step"] for r in rows) / wall  # noqa: E731
    return {
        "samples_per_s": summary["samples"] / wall,
        "tokens_per_s": sum(r["generated_tokens"] for r in rows) / wall,
        "engine_idle": weighted("engine_idle_frac"),
        "trainer_idle": weighted("trainer_idle_frac"),
        "accuracy": summary["eval_accuracy_after"],
        "greedy_accuracy": summary["eval_greedy_accuracy_after"],
        "staleness_max": max(r["staleness_max"] for r in rows),
        "response_len_trained": sum(r["response_len_mean"] for r in rows) / len(rows),
        "accuracy_before": summary["eval_accuracy_before"],
        "loop_seconds": wall,
        "total_seconds": time.perf_counter() - t0,
        "partial_resumed": rows[-1].get("partial_resumed_total", 0),
        "offpolicy_token_frac": sum(r.get("offpolicy_token_frac", 0) for r in rows) / len(rows),
        "mismatch_mean": sum(r.get("logprob_mismatch_mean") or 0 for r in rows) / len(rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="async_vs_sync", help="results file name (without extension)")
    ap.add_argument("overrides", nargs="*", help="extra section.key=value for every mode")
    args = ap.parse_args()
    res = {m: run_mode(m, args.steps, args.overrides, Path(args.out)) for m in args.modes}
    base = res.get("sync")
    header = ["mode", "samples/s", "gen tokens/s", "engine idle", "trainer idle", "accuracy after", "greedy after",
              "off-policy tokens", "max staleness", "vs sync"]
    rows = [[m, f"{v['samples_per_s']:.1f}", f"{v['tokens_per_s']:,.0f}", f"{v['engine_idle']:.0%}",
             f"{v['trainer_idle']:.0%}", f"{v['accuracy']:.1%}", f"{v['greedy_accuracy']:.1%}",
             f"{v['offpolicy_token_frac']:.1%}", v["staleness_max"],
             f"{v['samples_per_s'] / base['samples_per_s']:.2f}x" if base else "n/a"] for m, v in res.items()]
    write_results(Path(args.out), args.name, header, rows,
                  {"machine": machine_info(), "steps": args.steps, "results": res})


if __name__ == "__main__":
    main()
