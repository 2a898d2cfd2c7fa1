"""What a teacher's scoring costs a step of the demo run in async mode (on-policy distillation's overhead).

Two runs per seed, each its own process, their order alternating by seed, the same in all but one thing:

- ``grpo``: ``relayrl train run.mode=async``, the verifier's reward;
- ``+ teacher scoring``: the same, and a teacher (``teacher.path``) scoring every trained token, with
  ``teacher.coef=0``: the teacher's calls run exactly as in distillation (batched, beside generation, under
  the episode's deadline) while the update stays GRPO's, so the two runs train alike and only the scoring
  differs.

Reported: the median step wall time of each (the first ``--skip`` steps left out: start-up), the extra time
per step with teacher scoring (its cost), and the teacher's own compute per step (``time/teacher``, summed over
its calls) as a share of the step. The teacher is ``relayrl train``'s default run (``--teacher``, or made once
under ``--work`` as benchmarks/distill.py makes it); a teacher of the student's size, so its forward costs
what the student's does.

    python benchmarks/teacher_cost.py                   # 3 seeds x 2 runs of 40 steps (~12 min on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_info, write_results  # noqa: E402
from distill import make_teacher  # noqa: E402

SYSTEMS = {"grpo": [], "+ teacher scoring": ["teacher.coef=0"]}


def run(system: str, seed: int, steps: int, teacher: str, work: Path) -> list[dict]:
    out = work / f"{system.replace(' ', '_').replace('+', 'plus')}-{seed}"
    extra = [f"teacher.path={teacher}"] if system != "grpo" else []
    subprocess.run([sys.executable, "-m", "relayrl.cli", "train", "run.mode=async", f"run.seed={seed}",
                    f"run.steps={steps}", f"run.output_dir={out}", "run.name=r", "run.progress=false",
                    "data.eval_path=null", *SYSTEMS[system], *extra], check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return [json.loads(x) for x in (out / "r" / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skip", type=int, default=3, help="first steps left out (start-up)")
    ap.add_argument("--teacher", help="the teacher's checkpoint (default: made once under --work)")
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "relayrl-distill"))
    ap.add_argument("--name", default="teacher_cost")
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args()
    teacher = a.teacher or str(make_teacher(Path(a.work)))
    step_times: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    share: list[float] = []
    runs: dict[str, list] = {s: [] for s in SYSTEMS}
    with tempfile.TemporaryDirectory() as d:
        for seed in range(a.seeds):
            for s in SYSTEMS if seed % 2 == 0 else reversed(list(SYSTEMS)):
                print(f"seed {seed}: {s} ...", flush=True)
                rows = [r for r in run(s, seed, a.steps, teacher, Path(d)) if "step_time" in r][a.skip:]
                step_times[s].append(statistics.median(r["step_time"] for r in rows))
                if s != "grpo":
                    share.append(statistics.mean(r["time/teacher"] / r["step_time"] for r in rows))
                runs[s].append([{k: r.get(k) for k in ("step", "step_time", "time/teacher", "time/generate",
                                                        "time/train")} for r in rows])
    base = step_times["grpo"]
    taught = step_times["+ teacher scoring"]
    extra = [(t - b) / b for t, b in zip(taught, base)]
    rows = [["grpo", ", ".join(f"{x:.2f}" for x in base), f"{statistics.median(base):.2f}", "—", "—"],
            ["+ teacher scoring", ", ".join(f"{x:.2f}" for x in taught), f"{statistics.median(taught):.2f}",
             ", ".join(f"{100 * x:+.0f}%" for x in extra) + f" (median {100 * statistics.median(extra):+.0f}%)",
             ", ".join(f"{100 * x:.0f}%" for x in share)]]
    header = ["run (async)", "median step time per seed (s)", "median of seeds (s)", "step time vs grpo",
              "teacher's compute / step time"]
    write_results(Path(a.out), a.name, header, rows,
                  {"machine": machine_info(), "args": vars(a), "step_times": step_times, "share": share, "runs": runs})


if __name__ == "__main__":
    main()
