"""How a run slows when the CPU is shared: steps/s of ``relayrl train`` with 0, 1 and 2 busy neighbour
processes (single-threaded spinners, as ``yes > /dev/null`` is: a browser tab, a second seed, CI beside
an editor), the default thread setting against ``run.threads=1``, side by side in one run.

    python benchmarks/busy_neighbours.py [--steps 10] [--hogs 0 1 2] [--variant NAME=OVERRIDES ...]

Each cell is its own ``relayrl train`` process (fixed groups, no evaluation: the same work every step);
its median step time over the steps after the first (``metrics.jsonl``), and its ratio to the same
setting with no neighbour. A run that passes ``--limit`` seconds is stopped and shown as such.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import FIXED_GROUPS, machine_info, write_results  # noqa: E402

VARIANTS = {"default": [], "run.threads=1": ["run.threads=1"]}


def neighbour(kind: str, env: dict, out: str) -> subprocess.Popen:
    """A busy neighbour: a single-threaded spinner, or another ``relayrl train`` with its defaults."""
    if kind == "spin":
        return subprocess.Popen(["yes"], stdout=subprocess.DEVNULL)
    cmd = [sys.executable, "-m", "relayrl.cli", "train", "run.steps=100000", "data.eval_path=null", "run.progress=false",
           f"run.output_dir={out}", f"run.name=neighbour{time.monotonic_ns()}", "run.save_every=0"]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    time.sleep(15)  # (loaded and stepping before the measured run starts)
    return p


def one_run(overrides: list[str], hogs: int, steps: int, limit: float, env: dict, kind: str = "spin",
            neighbour_env: dict | None = None) -> dict:
    scratch = tempfile.mkdtemp()
    spinners = [neighbour(kind, neighbour_env or env, scratch) for _ in range(hogs)]
    try:
        with tempfile.TemporaryDirectory() as out:
            cmd = [sys.executable, "-m", "relayrl.cli", "train", f"run.steps={steps}", "data.eval_path=null",
                   "run.progress=false", f"run.output_dir={out}", "run.name=busy", *FIXED_GROUPS, *overrides]
            start = time.perf_counter()
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env)
            except subprocess.TimeoutExpired:
                return {"timed_out": True, "seconds": limit}
            if p.returncode:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stderr[-2000:]}")
            lines = [json.loads(x) for x in (Path(out) / "busy" / "metrics.jsonl").read_text().splitlines()]
            times = [m["step_time"] for m in lines[1:]]  # (the first step includes the first compilation)
            chosen = re.search(r"threads: trainer (\d+)", p.stdout)
            return {"step_s": statistics.median(times), "seconds": time.perf_counter() - start,
                    "trainer_threads": int(chosen.group(1)) if chosen else None}
    finally:
        for s in spinners:
            s.kill()
            s.wait()
        shutil.rmtree(scratch, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--hogs", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--limit", type=float, default=300.0, help="seconds a run may take before it is stopped")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=override,override (added to the default and run.threads=1)")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for every run's environment")
    ap.add_argument("--neighbour", choices=["spin", "relayrl"], default="spin",
                    help="what a busy neighbour is: a single-threaded spinner (yes > /dev/null), or another "
                    "relayrl train with its default settings (running the same code, or --neighbour-env's)")
    ap.add_argument("--neighbour-env", action="append", default=[], help="KEY=VALUE for the neighbours' environment")
    ap.add_argument("--name", default="busy_neighbours")
    ns = ap.parse_args()
    variants = dict(VARIANTS)
    for v in ns.variant:
        name, _, ov = v.partition("=")
        variants[name] = [x for x in ov.split(",") if x]
    env = {**os.environ, **dict(e.split("=", 1) for e in ns.env)}
    nenv = {**env, **dict(e.split("=", 1) for e in ns.neighbour_env)}
    results: dict[str, dict[int, dict]] = {v: {} for v in variants}
    for hogs in ns.hogs:  # the variants alternate at each load: the machine drifts, the comparison does not
        for name, ov in variants.items():
            results[name][hogs] = r = one_run(ov, hogs, ns.steps, ns.limit, env, ns.neighbour, nenv)
            print(f"{name:>20} with {hogs} busy neighbour(s) ({ns.neighbour}): {r}", flush=True)
    what = "busy" if ns.neighbour == "spin" else "relayrl runs beside"
    header = ["setting", *[f"{h} {what}: s/step (× quiet)" for h in ns.hogs]]
    rows = []
    for name in variants:
        quiet = results[name].get(0, {}).get("step_s")
        cells = []
        for h in ns.hogs:
            r = results[name][h]
            if r.get("timed_out"):
                cells.append(f"> {ns.limit:.0f} s for {ns.steps} steps")
            else:
                cells.append(f"{r['step_s']:.2f}" + (f" ({r['step_s'] / quiet:.2f}×)" if quiet else "")
                             + (f", {r['trainer_threads']} thr" if r.get("trainer_threads") else ""))
        rows.append([name, *cells])
    write_results(Path(__file__).parent / "results", ns.name, header, rows,
                  {"machine": machine_info(), "steps": ns.steps, "env": ns.env, "neighbour": ns.neighbour,
                   "neighbour_env": ns.neighbour_env, "results": results})


if __name__ == "__main__":
    main()
