"""Learning over seeds: the same command with ``run.seed`` = 0..N-1, one after another, and the held-out
accuracy before → after of each (sampled at the training temperature, and greedy), with the spread.

    python benchmarks/seeds.py                                   # the default demo, 5 seeds
    python benchmarks/seeds.py --seeds 3 -- examples/agent_demo.yaml
    python benchmarks/seeds.py --name ds -- rollout.dynamic_sampling=true

Everything after ``--`` goes to ``relayrl train`` as it is. Writes
``benchmarks/results/seeds_<name>.json`` (every run's summary and its metrics' curves: reward,
entropy, KL, clip fraction, gradient norm, response length) and prints a Markdown table. A seed
passes when its sampled accuracy gains at least ``--min-gain`` points and its greedy accuracy does
not end below its start.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CURVES = ("reward_mean", "entropy", "kl", "clip_frac", "grad_norm", "response_len_mean")


def cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions() -> str:
    import torch
    import transformers

    return f"torch {torch.__version__}, transformers {transformers.__version__}"


def run_seed(seed: int, args: list[str], out: Path) -> dict:
    cmd = [sys.executable, "-m", "relayrl.cli", "train", *args, f"run.seed={seed}", f"run.output_dir={out}",
           f"run.name=seed{seed}", "run.progress=false"]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"seed {seed} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    run_dir = out / f"seed{seed}"
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"seed": seed, "seconds": round(time.perf_counter() - t, 1),
            **{k: summary[k] for k in ("eval_accuracy_before", "eval_accuracy_after", "eval_greedy_accuracy_before",
                                       "eval_greedy_accuracy_after", "wall_seconds")},
            "curves": {k: [m.get(k) for m in metrics] for k in CURVES}}


def spread(values: list[float]) -> str:
    return f"{statistics.mean(values):.1%} ± {statistics.pstdev(values):.1%} (min {min(values):.1%})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--first", type=int, default=0, help="the first seed (seeds first .. first+seeds-1)")
    p.add_argument("--name", default="default")
    p.add_argument("--min-gain", type=float, default=0.20)
    p.add_argument("--jobs", type=int, default=1, help="seeds run at once (with run.threads=1 each, the results are "
                   "those of one at a time; the seconds are not)")
    p.add_argument("train_args", nargs="*")
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(a.jobs) as pool:
        runs = pool.map(lambda seed: run_seed(seed, a.train_args, Path(tmp)), range(a.first, a.first + a.seeds))
        for seed, r in zip(range(a.first, a.first + a.seeds), runs):
            rows.append(r)
            print(f"seed {seed}: {r['eval_accuracy_before']:.1%} → {r['eval_accuracy_after']:.1%}, greedy "
                  f"{r['eval_greedy_accuracy_before']:.1%} → {r['eval_greedy_accuracy_after']:.1%} ({r['seconds']} s)",
                  flush=True)
    lines = ["| seed | sampled before → after | gain | greedy before → after | passes |", "|---|---|---|---|---|"]
    passed = 0
    for r in rows:
        gain = r["eval_accuracy_after"] - r["eval_accuracy_before"]
        ok = gain >= a.min_gain and r["eval_greedy_accuracy_after"] >= r["eval_greedy_accuracy_before"]
        passed += ok
        lines.append(f"| {r['seed']} | {r['eval_accuracy_before']:.1%} → {r['eval_accuracy_after']:.1%} | "
                     f"{gain * 100:+.1f} | {r['eval_greedy_accuracy_before']:.1%} → "
                     f"{r['eval_greedy_accuracy_after']:.1%} | {'yes' if ok else 'NO'} |")
    after = [r["eval_accuracy_after"] for r in rows]
    greedy = [r["eval_greedy_accuracy_after"] for r in rows]
    lines.append(f"\nsampled after: {spread(after)}; greedy after: {spread(greedy)}; {passed}/{len(rows)} seeds pass "
                 f"(gain ≥ {a.min_gain:.0%} points, greedy not below its start); machine: {cpu()}, {versions()}; "
                 f"args: {' '.join(a.train_args) or '(defaults)'}")
    print("\n".join(lines))
    out = ROOT / "benchmarks" / "results" / f"seeds_{a.name}.json"
    out.write_text(json.dumps({"machine": cpu(), "versions": versions(), "args": a.train_args, "rows": rows, "table": "\n".join(lines)},
                              indent=1))
    print(f"wrote {out}")
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
