"""A task of a user's own shape, after SFT: the default algorithm against ``algo.preset=grpo`` over seeds.

    python benchmarks/user_task.py --seeds 3

The task, as a new user brings it: the remainder of a ÷ b (300 training rows, 100 held out), their own reward
file (1 for the right remainder, 0.2 for an answer that is a number but not it, 0 otherwise), a warm start by
``relayrl sft`` on 300 worked answers from the demo model, then ``relayrl train`` from that checkpoint with the
default settings and with ``algo.preset=grpo``, ``--steps`` steps, seeds 0..N-1, one run at a time. Prints and
writes (``benchmarks/results/user_task.{md,json}``) each run's held-out accuracy before → after (sampled and
greedy), its wall time and the groups it generated per group trained.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import machine_info, results_dir, write_results  # noqa: E402

REWARD = '''import re


def remainder(completion, answer, metadata):
    """1 for the right remainder, 0.2 for another number, 0 for no number."""
    found = re.findall(r"-?\\d+", completion)
    if not found:
        return 0.0
    return 1.0 if found[-1] == str(answer) else 0.2
'''


def rows(n: int, seed: int, sft: bool) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(10, 99), rng.randint(2, 9)
        row = {"id": f"r{seed}-{i}", "prompt": f"Remainder: a={a} b={b}", "answer": str(a % b)}
        if sft:
            row["response"] = f"{a}={b}*{a // b}+{a % b} \\boxed{{{a % b}}}"
        out.append(row)
    return out


def write(path: Path, data: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in data))
    return path


def relayrl(*args: str, cwd: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "relayrl.cli", *args, "run.progress=false"], cwd=cwd,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"relayrl {' '.join(args)} failed: {proc.stderr[-2000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--sft-steps", type=int, default=60)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "my_reward.py").write_text(REWARD)
        train, held, sft = (write(tmp / "train.jsonl", rows(300, 1, False)), write(tmp / "eval.jsonl", rows(100, 2, False)),
                            write(tmp / "sft.jsonl", rows(300, 3, True)))
        common = [f"data.eval_path={held}", "reward.fn=my_reward.py:remainder", "run.output_dir=runs"]
        t = time.perf_counter()
        relayrl("sft", f"data.path={sft}", f"run.steps={a.sft_steps}", "run.name=warm", *common, cwd=tmp)
        sft_seconds = time.perf_counter() - t
        results = []
        for preset in ("relayrl", "grpo"):
            for seed in range(a.seeds):
                name = f"{preset}-{seed}"
                t = time.perf_counter()
                relayrl("train", "model.path=runs/warm", f"data.path={train}", f"run.steps={a.steps}", f"run.seed={seed}",
                        f"algo.preset={preset}", f"run.name={name}", *common, cwd=tmp)
                s = json.loads((tmp / "runs" / name / "summary.json").read_text())
                metrics = [json.loads(x) for x in (tmp / "runs" / name / "metrics.jsonl").read_text().splitlines()]
                made = metrics[-1].get("dynamic/filtered_total", 0) + a.steps * 8  # groups generated (trained + filtered)
                results.append({"preset": preset, "seed": seed, "seconds": round(time.perf_counter() - t, 1),
                                "groups_per_trained": made / (a.steps * 8),
                                **{k: s.get(k) for k in ("eval_accuracy_before", "eval_accuracy_after",
                                                         "eval_greedy_accuracy_before", "eval_greedy_accuracy_after")}})
                print(json.dumps(results[-1]), flush=True)
    rows_md = []
    for preset in ("relayrl", "grpo"):
        rs = [r for r in results if r["preset"] == preset]
        after = [r["eval_accuracy_after"] for r in rs]
        greedy = [r["eval_greedy_accuracy_after"] for r in rs]
        rows_md.append([f"algo.preset={preset}", f"{rs[0]['eval_accuracy_before']:.1%}",
                        f"{statistics.mean(after):.1%} ± {statistics.pstdev(after):.1%} (min {min(after):.1%})",
                        f"{rs[0]['eval_greedy_accuracy_before']:.1%}",
                        f"{statistics.mean(greedy):.1%} ± {statistics.pstdev(greedy):.1%} (min {min(greedy):.1%})",
                        f"{statistics.mean(r['groups_per_trained'] for r in rs):.2f}",
                        f"{statistics.mean(r['seconds'] for r in rs):.0f} s"])
    write_results(results_dir(a.out), "user_task", ["setting", "sampled before", "sampled after (seeds)",
                                                     "greedy before", "greedy after (seeds)", "groups made per trained",
                                                     "run time"], rows_md,
                  {"machine": machine_info(), "runs": results, "sft_seconds": sft_seconds, "steps": a.steps,
                   "seeds": a.seeds})


if __name__ == "__main__":
    main()
