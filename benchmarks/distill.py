"""Learning from a teacher against learning from the verifier alone, on the demo task, over seeds.

The teacher is the demo model after RL: ``relayrl train`` with its defaults (80 steps, seed 0), made once
into ``--work`` (or ``--teacher PATH``). The student is ``builtin:demo`` in every row. Rows:

- ``grpo``: relayrl train's defaults, the verifier's reward (the baseline).
- ``opd``: on-policy distillation alone (``teacher.path``, ``algo.reward_coef=0``; the verifier still scores,
  for the curve, and is not trained on).
- ``opd + verifier``: both signals (``algo.reward_coef=1``, ``teacher.coef=1``).
- ``sft on teacher, then grpo``: rejection sampling from the teacher (``relayrl eval --samples 4`` on 512
  training prompts, the correct ones kept: ``data.min_reward=1``), ``relayrl sft`` on them (``--sft-steps``), then
  GRPO from that checkpoint; its time counts the sampling, the fine-tuning and the RL (its steps: SFT + RL).

Each run is evaluated every ``--every`` steps on 256 held-out prompts (sampled, T=1) and stops at the first
evaluation reaching ``--target``; time to target is wall time from the start of the training call with
every evaluation's own time taken out (time_to_accuracy.py's rule), steps are optimiser steps. Every run is
its own process, the systems' order alternating by seed.

    python benchmarks/distill.py                       # 3 seeds (~30 min on 2 cores, the teacher made once)
    python benchmarks/distill.py --seeds 1 --systems grpo opd
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_info, write_results  # noqa: E402
from time_to_accuracy import fmt_s, summarise  # noqa: E402

SYSTEMS = {
    "grpo": [],
    "opd": ["algo.reward_coef=0"],
    "opd + verifier": [],
    "sft on teacher, then grpo": [],
}
TEACHER_ROWS = ("opd", "opd + verifier")


def make_teacher(work: Path) -> Path:
    """The demo model after relayrl train's default run (seed 0), once."""
    run = work / "teacher" / "rl"
    ckpt = run / "checkpoints" / "step_000080"
    if not ckpt.is_dir():
        print("making the teacher: relayrl train (80 steps, seed 0) ...", flush=True)
        subprocess.run([sys.executable, "-m", "relayrl.cli", "train", f"run.output_dir={work / 'teacher'}",
                        "run.name=rl", "run.progress=false"], check=True, stdout=subprocess.DEVNULL)
    return ckpt


def rejection_samples(teacher: Path, work: Path, seed: int) -> tuple[Path, float]:
    """The teacher's samples on training prompts (relayrl eval --samples 4), and the seconds it took."""
    out = work / f"teacher_samples_{seed}"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "relayrl.cli", "eval", "--checkpoint", str(teacher), "--samples", "4",
                    "-o", str(out), "data.eval_path=builtin:demo", "eval.size=512", f"eval.seed={seed}"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out / "eval_samples.jsonl", time.perf_counter() - t0


def curve_of(run_dir: Path, startup: float, offset_steps: int = 0, offset_s: float = 0.0) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve, evals = [], 0.0
    for r in rows:
        if "eval/accuracy" in r:
            curve.append({"step": offset_steps + r["step"], "samples": r["samples"], "accuracy": r["eval/accuracy"],
                          "seconds": offset_s + startup + r["wall_seconds"] - evals})
            evals += r["time/eval"]
    return curve


def child(a) -> dict:
    from relayrl.config import load_config
    from relayrl.run.loop import train

    stop = ["data.eval_path=builtin:demo-eval", "eval.size=256", f"eval.every={a.every}", f"eval.stop_at={a.target}",
            f"run.seed={a.seed}", f"run.steps={a.max_steps}", "run.progress=false"]
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        model, before_steps, before_s = "builtin:demo", 0, 0.0
        if a.child == "sft on teacher, then grpo":
            samples, sampling_s = rejection_samples(Path(a.teacher), d, a.seed)
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "relayrl.cli", "sft", f"data.path={samples}", "data.min_reward=1",
                            f"run.steps={a.sft_steps}", f"run.output_dir={d}", "run.name=sft", "data.eval_path=null",
                            f"run.seed={a.seed}", "run.progress=false"], check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            model = str(d / "sft" / "checkpoints" / f"step_{a.sft_steps:06d}")
            before_steps, before_s = a.sft_steps, sampling_s + time.perf_counter() - t0
        extra = [f"teacher.path={a.teacher}"] if a.child in TEACHER_ROWS else []
        cfg = load_config(None, [f"model.path={model}", f"run.output_dir={d}", "run.name=bench", *stop,
                                 *SYSTEMS[a.child], *extra])
        summary = train(cfg)
        rows = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
        share = [r["time/teacher"] / r["step_time"] for r in rows if "time/teacher" in r]
        return {"curve": curve_of(cfg.run_dir, summary["startup_seconds"], before_steps, before_s),
                "before_steps": before_steps, "before_seconds": before_s,
                "teacher_share": statistics.mean(share) if share else None,
                "reverse_kl": [r.get("teacher/reverse_kl") for r in rows]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--target", type=float, default=0.70)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--max-steps", type=int, default=100)
    ap.add_argument("--sft-steps", type=int, default=30)
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS))
    ap.add_argument("--teacher", help="the teacher's checkpoint (default: made once under --work)")
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "relayrl-distill"))
    ap.add_argument("--name", default="distill")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        Path(a.result).write_text(json.dumps(child(a)))
        return
    a.teacher = a.teacher or str(make_teacher(Path(a.work)))
    runs: dict[str, list[dict]] = {s: [] for s in a.systems}
    for seed in range(a.seeds):
        for s in a.systems if seed % 2 == 0 else reversed(a.systems):
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                print(f"seed {seed}: {s} ...", flush=True)
                cmd = [sys.executable, __file__, "--child", s, "--seed", str(seed), "--result", f.name, "--teacher",
                       a.teacher, "--target", str(a.target), "--every", str(a.every), "--max-steps", str(a.max_steps),
                       "--sft-steps", str(a.sft_steps)]
                proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1"})
                res = json.loads(Path(f.name).read_text()) if proc.returncode == 0 else \
                    {"curve": [], "failed": proc.stderr[-3000:]}
                if proc.returncode:
                    print(f"  FAILED: {proc.stderr[-2000:]}", flush=True)
            runs[s].append(res)
    base = summarise(runs["grpo"], a.target) if "grpo" in runs else None
    rows = []
    for s, rs in runs.items():
        m = summarise(rs, a.target)
        steps = [x for x in m["steps"] if x is not None]
        share = [r["teacher_share"] for r in rs if r.get("teacher_share") is not None]
        rows.append([s, f"{m['reached']}/{m['runs']}", ", ".join(str(x) for x in m["steps"]),
                     statistics.median(steps) if steps else "—", ", ".join(fmt_s(x) for x in m["seconds"]),
                     fmt_s(m["median"]),
                     f"{base['median'] / m['median']:.2f}x" if base and m["median"] != float("inf") else "—",
                     f"{100 * statistics.mean(share):.0f}%" if share else "—",
                     ", ".join(f"{b:.1%}" for b in m["best"] if b is not None)])
    header = ["system", f"reached {a.target:.0%}", "steps per seed", "median steps", "seconds per seed",
              "median s", "speed-up vs grpo", "teacher's share of a step", "best accuracy per seed"]
    write_results(Path(a.out), a.name, header, rows, {"machine": machine_info(), "args": vars(a), "runs": runs})


if __name__ == "__main__":
    main()
