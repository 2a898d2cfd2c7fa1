"""The proposer-solver curriculum (``examples/proposer_solver.yaml``) against plain GRPO on the demo task, at
equal wall time: the solver's held-out accuracy.

    python benchmarks/proposer_solver.py --seeds 3 --steps 40 --parallel 6

1. The warm start, once: ``relayrl sft`` of the demo model on ``builtin:proposer-sft`` (problems written on
   request, and worked solutions). Both arms start from it.
2. Per seed, one arm after the other (``run.threads=2`` each; ``--parallel`` seeds at once: keep 2 × that
   under the machine's cores): the curriculum for ``--steps`` steps, then plain GRPO (the demo's own config:
   ``builtin:demo``) saving a checkpoint every ``--save-every`` steps until it passes the curriculum's time.
   (An earlier version ran the two side by side, 4 threads on 2 cores: both ran ~15x slower than alone, in
   about the same proportion, so its step counts hold, but its times do not.)
3. Equal wall time: the curriculum's training seconds T; plain GRPO's last checkpoint trained within T (its
   ``state.json``'s ``wall_seconds``).
4. Each final checkpoint evaluated by ``relayrl eval`` on ``builtin:demo-eval`` (single-turn, ``reward.fn=math``):
   sampled (T=1) and greedy accuracy, beside the warm start's.

Writes ``benchmarks/results/proposer_solver.json`` and prints a Markdown table, with the machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from seeds import cpu, versions  # noqa: E402


def relayrl(*args: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "relayrl.cli", *args], cwd=ROOT, stdout=log.open("w"),
                            stderr=subprocess.STDOUT)


def finished(proc: subprocess.Popen, what: str, log: Path) -> None:
    if proc.wait() != 0:
        raise SystemExit(f"{what} failed ({proc.returncode}): {log.read_text()[-3000:]}")


def accuracy(ckpt: Path, out: Path, size: int) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    log = out / "eval.log"
    finished(relayrl("eval", f"model.path={ckpt}", "data.eval_path=builtin:demo-eval", "reward.fn=math",
                     f"eval.size={size}", "eval.samples=4", "run.threads=2", "-o", str(out), log=log), "eval", log)
    r = json.loads((out / "eval.json").read_text())["result"]
    return {"sampled": r["accuracy"], "greedy": r["accuracy_greedy"]}


def arm_pair(seed: int, warm: Path, out: Path, steps: int, save_every: int, size: int) -> dict:
    common = ["run.threads=2", "run.progress=false", f"run.seed={seed}", f"run.output_dir={out}", f"model.path={warm}"]
    ps = relayrl("train", "examples/proposer_solver.yaml", *common, f"run.steps={steps}", f"run.save_every={steps}",
                 f"run.name=ps{seed}", log=out / f"ps{seed}.log")
    finished(ps, f"the curriculum, seed {seed}", out / f"ps{seed}.log")
    budget = json.loads((out / f"ps{seed}" / "summary.json").read_text())["wall_seconds"]
    grpo = relayrl("train", *common, f"run.steps={steps * 20}", f"run.save_every={save_every}",
                   "run.keep_checkpoints=1000", f"run.name=grpo{seed}", log=out / f"grpo{seed}.log")
    while grpo.poll() is None:  # until its checkpoints pass the curriculum's time
        done = [json.loads((d / "state.json").read_text())["wall_seconds"]
                for d in (out / f"grpo{seed}" / "checkpoints").glob("step_*") if (d / "state.json").exists()]
        if done and max(done) > budget:
            grpo.terminate()
            break
        time.sleep(2)
    grpo.wait()
    within = sorted((json.loads((d / "state.json").read_text())["wall_seconds"], d)
                    for d in (out / f"grpo{seed}" / "checkpoints").glob("step_*") if (d / "state.json").exists())
    within = [(w, d) for w, d in within if w <= budget]
    if not within:
        raise SystemExit(f"seed {seed}: plain GRPO saved no checkpoint within {budget:.0f} s (--save-every)")
    grpo_seconds, grpo_ckpt = within[-1]
    ps_ckpt = max((out / f"ps{seed}" / "checkpoints").glob("step_*"))
    return {"seed": seed, "seconds": budget, "grpo_seconds": grpo_seconds, "grpo_step": int(grpo_ckpt.name[5:]),
            "curriculum": accuracy(ps_ckpt, out / f"eval-ps{seed}", size),
            "grpo": accuracy(grpo_ckpt, out / f"eval-grpo{seed}", size)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--parallel", type=int, default=1, help="seeds run at once (each: two runs of 2 threads)")
    ap.add_argument("--eval-size", type=int, default=500)
    ap.add_argument("--out", default=None, help="where the runs go (default: a temporary folder)")
    ap.add_argument("--result", default=None, help="where the JSON goes (default: benchmarks/results/)")
    ap.add_argument("--warm", default=None, help="a warm start made before (its checkpoint): no relayrl sft here")
    a = ap.parse_args()
    out = Path(a.out or tempfile.mkdtemp(prefix="proposer-solver-"))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if a.warm is None:
        log = out / "sft.log"
        finished(relayrl("sft", "model.path=builtin:demo", "data.path=builtin:proposer-sft", "data.eval_path=null",
                         "sft.epochs=1", "run.progress=false", f"run.output_dir={out}", "run.name=warm", log=log),
                 "the warm start", log)
    warm = Path(a.warm).resolve() if a.warm else max((out / "warm" / "checkpoints").glob("step_*"))
    start = accuracy(warm, out / "eval-warm", a.eval_size)
    with ThreadPoolExecutor(a.parallel) as pool:
        rows = list(pool.map(lambda s: arm_pair(s, warm, out, a.steps, a.save_every, a.eval_size),
                             range(1, a.seeds + 1)))
    result = {"machine": cpu(), "versions": versions(), "warm_start": start, "runs": rows, "args": vars(a),
              "seconds": round(time.perf_counter() - t0)}
    dest = Path(a.result) if a.result else ROOT / "benchmarks" / "results" / "proposer_solver.json"
    dest.write_text(json.dumps(result, indent=1))
    print(f"machine: {result['machine']} ({result['versions']}); warm start: sampled {start['sampled']:.1%}, "
          f"greedy {start['greedy']:.1%}")
    print("| seed | wall s | curriculum sampled / greedy | plain GRPO (step) sampled / greedy |\n|---|---|---|---|")
    for r in rows:
        c, g = r["curriculum"], r["grpo"]
        print(f"| {r['seed']} | {r['seconds']:.0f} | {c['sampled']:.1%} / {c['greedy']:.1%} | "
              f"({r['grpo_step']}) {g['sampled']:.1%} / {g['greedy']:.1%} |")
    print(f"written: {dest}")


if __name__ == "__main__":
    main()
