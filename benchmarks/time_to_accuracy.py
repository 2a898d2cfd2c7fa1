"""Time to a target accuracy: relayrl against TRL's GRPOTrainer, side by side, over seeds.

Each run trains the demo model on the demo task (the workload of ``vs_trl.py``: same weights and
tokenizer, prompts with the chat template, ``math`` verifier, 8 prompts × G=8 per step, 128 new
tokens, T=1, lr 1e-4 constant after 3 warm-up steps, AdamW β=(0.9, 0.99), grad clip 1, token-mean
PPO clip 0.2/0.28, no KL) and is evaluated every ``--every`` steps on the held-out set (256 prompts,
one sampled response each at T=1: relayrl's evaluator, the same code for both systems). Its time to
target is the wall time from the start of the training call (model loading and start-up included)
to the first evaluation whose sampled accuracy reaches ``--target``, with every evaluation's own
time taken out, on both sides. A run stops there (relayrl: ``eval.stop_at``; TRL: a callback), or
after ``--max-steps`` without reaching it, which is shown as such. Each run is its own process;
seeds alternate the order of the systems. The ratio is TRL's median time over the system's.

TRL's settings are vs_trl.py's (its docstring says why each), with ``max_steps`` and the seed.
relayrl's rows: sync doing TRL's work (fixed groups, nothing filtered), the same decoding through the
model's own forward (``rollout.fast_decode=false``: an ablation row), the fastest mode of
``async_vs_sync.py`` (async, η=4) doing the same, and the adaptive-sampling pieces on top: dynamic
sampling (DAPO), prompt selection (VADE, with the demo's number of terms as the prior's group key),
adaptive budgets — each alone on the fast mode (an ablation row each), budgets with dynamic
sampling (sync and async), and all three. The KL rows add relayrl's default KL term (β = 0.05, k3 in
the loss) to sync, and the same β to TRL (its ``beta``, the same k3 term), each side with its frozen
reference model. The bf16 rows train in mixed precision on both sides (TRL's ``bf16=True``, relayrl's
``trainer.bf16``: bfloat16 autocast around float32 weights), and sync with bf16 — the fastest mode on
an AVX512-BF16 CPU — gets the adaptive-sampling pieces each alone and all three (ablation rows).

    python benchmarks/time_to_accuracy.py                    # 3 seeds of the headline rows (~20 min on 2 cores)
    python benchmarks/time_to_accuracy.py --systems all      # every row (~1.5 h)
    python benchmarks/time_to_accuracy.py --seeds 5 --target 0.7 --systems trl "relayrl sync"
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_info, write_results  # noqa: E402
from vs_trl import (G, LR, MAX_NEW, PROMPTS, TEMP, WARMUP, peak_rss_gib, shared_overrides, trl_config,  # noqa: E402
                    warm_imports)

FAST = ["run.mode=async", "rollout.max_staleness=4"]
# (shared_overrides turns all three off: TRL's work)
DS, SELECT, BUDGET = ["rollout.dynamic_sampling=true"], ["data.selection=vade", "data.selection_key=terms"], \
    ["rollout.budget=adaptive"]
KL = ["algo.kl_coef=0.05"]  # relayrl's default since 2026-11-26 (shared_overrides turns it off: TRL's default)
# every memory feature of the trainer on (checkpointing, the head in chunks of 1,024, packing; share_prefix
# off, as packing needs)
MEMORY = ["trainer.gradient_checkpointing=on", "trainer.logprob_chunk_tokens=1024", "trainer.pack=true",
          "trainer.share_prefix=false"]
BF16 = ["trainer.bf16=true"]  # mixed precision, as TRL's bf16=True (its rows: the same flag)
TRL_SYSTEMS = {"trl": {}, "trl, KL β=0.05": {"beta": 0.05}, "trl, bf16": {"bf16": True}}  # GRPOConfig fields changed
SYSTEMS = {
    "trl": None,
    "trl, KL β=0.05": None,
    "trl, bf16": None,
    "relayrl sync, bf16": ["run.mode=sync"] + BF16,
    "sync, bf16 + dynamic sampling": ["run.mode=sync"] + BF16 + DS,
    "sync, bf16 + selection": ["run.mode=sync"] + BF16 + SELECT,
    "sync, bf16 + budgets": ["run.mode=sync"] + BF16 + BUDGET,
    "sync, bf16 + all three": ["run.mode=sync"] + BF16 + DS + SELECT + BUDGET,
    "relayrl sync + KL 0.05": ["run.mode=sync"] + KL,
    "relayrl sync": ["run.mode=sync"],
    "sync, bf16 engine": ["run.mode=sync", "rollout.dtype=bfloat16"],  # (the trainer in float32)
    "sync, bf16 engine + TIS": ["run.mode=sync", "rollout.dtype=bfloat16", "algo.offpolicy=tis"],
    "sync, no shared prefix": ["run.mode=sync", "trainer.share_prefix=false"],  # (what packing needs, alone)
    "sync, packed": ["run.mode=sync", "trainer.pack=true", "trainer.share_prefix=false"],  # (packing: no prefix)
    "sync, every memory feature": ["run.mode=sync"] + MEMORY,
    "sync, the model's own decoding forward": ["run.mode=sync", "rollout.fast_decode=false"],
    "sync + budgets + dynamic sampling": ["run.mode=sync"] + BUDGET + DS,
    "relayrl async η=4": FAST,
    "sync + speculative": ["run.mode=sync", "rollout.speculative=on"],  # (drafts: siblings, history; the defaults)
    "async η=4 + speculative": FAST + ["rollout.speculative=on"],
    "sync + speculative, recent": ["run.mode=sync", "rollout.speculative=on",
                                   "rollout.speculative_sources=[siblings,history,recent]"],  # (every prompt's drafts)
    "sync + speculative, recent, 576": ["run.mode=sync", "rollout.speculative=on",  # (the width chosen within 576)
                                        "rollout.speculative_sources=[siblings,history,recent]",
                                        "rollout.speculative_batch_tokens=576"],
    "sync + speculative, 576": ["run.mode=sync", "rollout.speculative=on",  # (the default sources; a GPU's budget:
                                "rollout.speculative_batch_tokens=576"],  # 64 rows × 9, the width chosen in it)
    "async η=4 + speculative, 576": FAST + ["rollout.speculative=on", "rollout.speculative_batch_tokens=576"],
    "async η=4 + dynamic sampling": FAST + DS,
    "async η=4 + selection": FAST + SELECT,
    "async η=4 + budgets": FAST + BUDGET,
    "async η=4 + budgets + dynamic sampling": FAST + BUDGET + DS,
    "async η=4 + all three": FAST + DS + SELECT + BUDGET,
}

# the default rows: TRL in both precisions, relayrl sync as TRL's work in both, and the fastest measured
HEADLINE = ["trl", "trl, bf16", "relayrl sync", "relayrl sync, bf16", "sync, bf16 + selection"]


def child_relayrl(name: str, model: str, a, workdir: str) -> dict:
    from relayrl.config import load_config
    from relayrl.run.loop import train

    cfg = load_config(None, shared_overrides(model, a.max_steps, workdir, "bench") + SYSTEMS[name] + [
        "data.eval_path=builtin:demo-eval", f"eval.size={a.eval_size}", f"eval.every={a.every}",
        f"eval.stop_at={a.target}", f"run.seed={a.seed}", f"rollout.device={a.device}", f"trainer.device={a.device}"])
    summary = train(cfg)
    rows = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    curve, evals = [], 0.0  # wall_seconds at step k counts the evaluations before it, not its own
    for r in rows:
        if "eval/accuracy" in r:
            curve.append({"step": r["step"], "samples": r["samples"], "accuracy": r["eval/accuracy"],
                          "seconds": summary["startup_seconds"] + r["wall_seconds"] - evals})
            evals += r["time/eval"]
    return {"curve": curve, "startup": summary["startup_seconds"], "tokens": sum(r["generated_tokens"] for r in rows)}


class Evaluator:
    """relayrl's held-out evaluation of a live model (TRL's), through an hf engine that gets its weights."""

    def __init__(self, model: str, a):
        from relayrl.config import load_config
        from relayrl.data.datasets import load_prompts
        from relayrl.engine.hf import HFEngine
        from relayrl.models import load_policy, load_tokenizer
        from relayrl.run.build import make_reward_runner, make_runner
        from relayrl.engine.spec import eos_token_ids

        self.cfg = load_config(None, [f"model.path={model}", f"eval.size={a.eval_size}",
                                      f"rollout.max_new_tokens={MAX_NEW}", f"rollout.temperature={TEMP}"])
        self.tok = load_tokenizer(model)
        self.prompts = load_prompts("builtin:demo-eval", limit=a.eval_size)
        self.engine = HFEngine(load_policy(model).to(a.device), self.tok)
        self.reward = make_reward_runner(self.cfg)
        self.runner = make_runner(self.cfg, self.engine, self.tok, self.reward, None, eos_token_ids(model, self.tok))

    def __call__(self, model, step: int) -> float:
        from relayrl.run.build import eval_settings
        from relayrl.run.evaluation import evaluate

        self.engine.load_weights({k: v.detach() for k, v in model.state_dict().items()}, step)
        return evaluate(self.runner, self.tok, self.prompts, eval_settings(self.cfg))["accuracy"]

    def close(self):
        self.runner.close()
        self.engine.close()
        self.reward.close()


def child_trl(model: str, a, workdir: str, changed: dict) -> dict:
    import datasets
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from relayrl.data.datasets import load_prompts
    from relayrl.rewards.verifiers import math_reward

    prompts = load_prompts("builtin:demo", limit=PROMPTS * a.max_steps * 2)
    ds = datasets.Dataset.from_list([{"prompt": p.messages, "answer": p.answer} for p in prompts])
    tokens = [0]

    def reward(prompts, completions, answer, completion_ids=None, **kw):
        tokens[0] += sum(len(c) for c in completion_ids or [])
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [math_reward(t, ans, {}) for t, ans in zip(texts, answer)]

    evaluator = Evaluator(model, a)
    curve, excluded = [], [0.0]

    class EvalEvery(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step % a.every:
                return
            t = time.perf_counter()
            acc = evaluator(model, state.global_step)
            curve.append({"step": state.global_step, "samples": state.global_step * PROMPTS * G, "accuracy": acc,
                          "seconds": t - t0 - excluded[0]})
            excluded[0] += time.perf_counter() - t
            control.should_training_stop = acc >= a.target

    args = trl_config(workdir, a.max_steps, a.seed, a.device, **changed)
    t0 = time.perf_counter()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds, callbacks=[EvalEvery()])
    startup = time.perf_counter() - t0
    try:
        trainer.train()
    finally:
        evaluator.close()
    return {"curve": curve, "startup": startup, "tokens": tokens[0]}


def run_child(a) -> None:
    import torch

    warm_imports(a.model)
    if a.device == "cuda":  # before the clock on both sides (TRL's evaluator initialises CUDA before it too)
        torch.zeros(1, device="cuda")
    torch.manual_seed(a.seed)
    with tempfile.TemporaryDirectory() as d:
        res = child_trl(a.model, a, d, TRL_SYSTEMS[a.child]) if a.child in TRL_SYSTEMS else \
            child_relayrl(a.child, a.model, a, d)
    res["peak_rss_gib"] = peak_rss_gib()
    if torch.cuda.is_available():
        res["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
    Path(a.result).write_text(json.dumps(res))


def reached(res: dict, target: float) -> dict | None:
    return next((p for p in res["curve"] if p["accuracy"] >= target), None)


def summarise(runs: list[dict], target: float) -> dict:
    hits = [reached(r, target) for r in runs]
    secs = [h["seconds"] if h else math.inf for h in hits]
    return {"reached": sum(h is not None for h in hits), "runs": len(runs), "seconds": secs,
            "failed": sum("failed" in r for r in runs),
            "median": statistics.median(secs), "steps": [h["step"] if h else None for h in hits],
            "samples": [h["samples"] if h else None for h in hits],
            "best": [max((p["accuracy"] for p in r["curve"]), default=None) for r in runs]}


def fmt_s(x: float) -> str:
    return "never" if math.isinf(x) else f"{x:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:demo")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=0, help="seeds first-seed .. first-seed+seeds-1")
    ap.add_argument("--target", type=float, default=0.70)
    ap.add_argument("--every", type=int, default=5, help="evaluate every N steps")
    ap.add_argument("--max-steps", type=int, default=100)
    ap.add_argument("--eval-size", type=int, default=256)
    ap.add_argument("--systems", nargs="+", default=HEADLINE, help=f"'all', or some of: {', '.join(SYSTEMS)}")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                    help="where every system trains and decodes, and the evaluator runs ('auto': CUDA if present)")
    ap.add_argument("--name", default="time_to_accuracy")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return run_child(a)
    a.systems = list(SYSTEMS) if a.systems == ["all"] else a.systems
    unknown = [s for s in a.systems if s not in SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; valid: {list(SYSTEMS)}")
    from relayrl.models import resolve_model_path

    model = resolve_model_path(a.model)
    if a.device == "auto":
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    runs: dict[str, list[dict]] = {s: [] for s in a.systems}
    for seed in range(a.first_seed, a.first_seed + a.seeds):
        for s in a.systems if seed % 2 == 0 else reversed(a.systems):  # alternate the order
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                cmd = [sys.executable, __file__, "--child", s, "--seed", str(seed), "--result", f.name,
                       "--model", model, "--target", str(a.target), "--every", str(a.every),
                       "--max-steps", str(a.max_steps), "--eval-size", str(a.eval_size), "--device", a.device]
                print(f"seed {seed}: {s} ...", flush=True)
                proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1"})
                if proc.returncode:  # shown as failed (never as not reached); the other runs go on
                    print(f"  FAILED ({proc.returncode}): {proc.stderr[-3000:]}", flush=True)
                    res = {"curve": [], "failed": proc.stderr[-3000:]}
                else:
                    res = json.loads(Path(f.name).read_text())
            res["seed"] = seed
            runs[s].append(res)
            if "failed" not in res:
                hit = reached(res, a.target)
                where = f"reached at step {hit['step']} in {hit['seconds']:.1f} s" if hit else "not reached"
                print(f"  {where}; best {max(p['accuracy'] for p in res['curve']):.1%}", flush=True)
            report(a, runs)  # after every run: an interrupted benchmark keeps what it measured


def report(a, runs: dict[str, list[dict]]) -> None:
    stats = {s: summarise(r, a.target) for s, r in runs.items() if r}
    base = stats.get("trl")
    header = ["system", "reached", "time to target s: median", "per seed", "steps per seed", "samples, median",
              "best accuracy per seed", "vs TRL (median time)"]
    rows = []
    for s, v in stats.items():
        ratio = "n/a"
        if base and not math.isinf(v["median"]) and not math.isinf(base["median"]):
            ratio = f"{base['median'] / v['median']:.2f}x"
        samples = [x for x in v["samples"] if x is not None]
        failed = f" ({v['failed']} failed)" if v["failed"] else ""
        rows.append([s, f"{v['reached']}/{v['runs']}{failed}", fmt_s(v["median"]),
                     ", ".join(fmt_s(x) for x in v["seconds"]),
                     ", ".join(str(x) if x is not None else "—" for x in v["steps"]),
                     f"{statistics.median(samples):,.0f}" if samples else "—",
                     ", ".join(f"{x:.1%}" for x in v["best"] if x is not None), ratio])
    data = {"machine": machine_info(), "device": a.device, "target": a.target, "every": a.every,
            "max_steps": a.max_steps, "eval_size": a.eval_size, "seeds": a.seeds,
            "systems": {s: SYSTEMS[s] for s in a.systems},
            "workload": {"prompts_per_step": PROMPTS, "group_size": G, "max_new_tokens": MAX_NEW, "temperature": TEMP,
                         "lr": LR, "warmup_steps": WARMUP}, "stats": stats, "raw": runs}
    write_results(Path(a.out), a.name, header, rows, data)

if __name__ == "__main__":
    main()
