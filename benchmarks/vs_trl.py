"""relayrl vs TRL's GRPOTrainer on identical work, side by side, in one invocation.

Same weights and tokenizer (the demo model), same prompts (the demo task, chat template
applied by both), same reward function (relayrl's ``math`` verifier), group size, max new
tokens, temperature, learning rate and schedule, optimiser (AdamW, β=(0.9, 0.99), no weight
decay, grad-norm clip 1.0), loss (token-mean PPO clip, ε_low 0.2 / ε_high 0.28, no KL, one
update per batch), number of training samples and evaluation set. Each system runs in its own
child process (so peak memory is its own), alternating, ``--runs`` times each. Accuracy is
measured afterwards by the same code for both (relayrl's evaluator on the saved weights).

TRL settings, and why (what a competent TRL user would set on CPU):
  use_cpu=True, bf16=False        — no GPU; fp32 like relayrl's default
  use_vllm=False                  — vLLM does not run on CPU; TRL then uses transformers generate
  use_transformers_paged=False    — TRL's paged (continuous batching) path measured slower on CPU
  per_device_train_batch_size = prompts × G, num_generations = G, steps_per_generation=1
                                  — one generation batch per optimiser step, as relayrl's sync step
  loss_type="dapo", epsilon=0.2, epsilon_high=0.28, beta=0.0, scale_rewards="group"
                                  — the same objective as relayrl's defaults
  lr_scheduler_type="constant_with_warmup", warmup_steps, adam_beta2=0.99, weight_decay=0
  gradient_checkpointing=False   — TRL turns it on by default; it only costs compute for a small model
  report_to="none", save_strategy="no", logging_steps=1

    python benchmarks/vs_trl.py                        # ~6 minutes on 2 cores
    python benchmarks/vs_trl.py --runs 5 --steps 20 --model PATH
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
from common import FIXED_GROUPS, machine_info, write_results  # noqa: E402

PROMPTS, G, MAX_NEW, TEMP, LR, WARMUP = 8, 8, 128, 1.0, 1e-4, 3

# relayrl rows: name -> config overrides on top of the shared workload
# relayrl's plain sync mode, and its fastest mode in benchmarks/async_vs_sync.py: asynchronous with
# staleness bound 4 (the engine in its own process, one core each).
RELAYRL_MODES = {
    "relayrl sync": ["run.mode=sync", "rollout.partial=false"],
    "relayrl async η=4": ["run.mode=async", "rollout.max_staleness=4", "rollout.partial=false"],
}


def peak_rss_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def shared_overrides(model: str, steps: int, out: str, name: str) -> list[str]:
    return [
        f"model.path={model}", f"run.output_dir={out}", f"run.name={name}", f"run.steps={steps}",
        "run.progress=false", "run.save_every=0", "data.eval_path=null", "reward.fn=math",
        f"rollout.prompts_per_step={PROMPTS}", f"rollout.group_size={G}", f"rollout.max_new_tokens={MAX_NEW}",
        f"rollout.temperature={TEMP}", f"trainer.lr={LR}", f"trainer.warmup_steps={WARMUP}",
        "trainer.schedule=constant", "algo.advantage=grpo", "algo.agg=token_mean", "algo.clip_low=0.2",
        "algo.clip_high=0.28", "algo.dual_clip=null", "algo.kl_coef=0",
        # the work TRL does: every prompt its G responses, every group trained (whatever relayrl's defaults)
        *FIXED_GROUPS, "data.selection=uniform",
    ]


def child_relayrl(mode: str, model: str, steps: int, workdir: str) -> dict:
    from relayrl.config import load_config
    from relayrl.run.loop import train

    cfg = load_config(None, shared_overrides(model, steps, workdir, "bench") + RELAYRL_MODES[mode])
    t0 = time.perf_counter()
    summary = train(cfg)
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    tokens = sum(r["generated_tokens"] for r in rows)
    final = cfg.run_dir / "checkpoints" / f"step_{steps:06d}"
    return {"wall": wall, "samples": summary["samples"], "tokens": tokens, "weights": str(final),
            "gen_seconds": sum(r["time/generate"] for r in rows)}


def trl_config(workdir: str, steps: int, seed: int = 0, device: str = "cpu", **changed):
    """TRL's settings (the module docstring says why each); ``device``: 'cuda' trains on the GPU (fp32);
    ``changed``: GRPOConfig fields set otherwise (``beta=0.05``: a KL term)."""
    from trl import GRPOConfig

    kw = dict(
        output_dir=workdir, use_cpu=device == "cpu", bf16=False, use_vllm=False, use_transformers_paged=False,
        per_device_train_batch_size=PROMPTS * G, num_generations=G, steps_per_generation=1,
        gradient_accumulation_steps=1, max_completion_length=MAX_NEW, temperature=TEMP, top_k=0, top_p=1.0,
        learning_rate=LR, lr_scheduler_type="constant_with_warmup", warmup_steps=WARMUP, adam_beta2=0.99,
        weight_decay=0.0, max_grad_norm=1.0, loss_type="dapo", epsilon=0.2, epsilon_high=0.28, beta=0.0,
        scale_rewards="group", num_iterations=1, max_steps=steps, logging_steps=1, report_to="none",
        save_strategy="no", seed=seed, data_seed=seed, disable_dropout=True, gradient_checkpointing=False,
    )
    return GRPOConfig(**{**kw, **changed})


def child_trl(model: str, steps: int, workdir: str) -> dict:
    import datasets
    from trl import GRPOTrainer

    from relayrl.data.datasets import load_prompts
    from relayrl.rewards.verifiers import math_reward

    prompts = load_prompts("builtin:demo", limit=PROMPTS * steps * 2)
    ds = datasets.Dataset.from_list([{"prompt": p.messages, "answer": p.answer} for p in prompts])
    counted = {"tokens": 0, "samples": 0}

    def reward(prompts, completions, answer, completion_ids=None, **kw):
        counted["samples"] += len(completions)
        if completion_ids is not None:
            counted["tokens"] += sum(len(c) for c in completion_ids)
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [math_reward(t, a, {}) for t, a in zip(texts, answer)]

    args = trl_config(workdir, steps)
    t0 = time.perf_counter()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds)
    generate, gen_time = trainer.model.generate, [0.0]

    def timed_generate(*a, **kw):  # generation time, to compare phases with relayrl's time/generate
        g0 = time.perf_counter()
        try:
            return generate(*a, **kw)
        finally:
            gen_time[0] += time.perf_counter() - g0

    trainer.model.generate = timed_generate
    trainer.train()
    wall = time.perf_counter() - t0
    final = Path(workdir) / "final"
    trainer.save_model(str(final))
    trainer.processing_class.save_pretrained(str(final))
    if not counted["tokens"]:  # older TRL: no completion_ids for reward functions
        counted["tokens"] = float("nan")
    return {"wall": wall, "samples": counted["samples"], "tokens": counted["tokens"], "weights": str(final),
            "gen_seconds": gen_time[0]}


def evaluate_weights(path: str, eval_size: int) -> float:
    from relayrl.config import load_config
    from relayrl.run.build import evaluate_only

    cfg = load_config(None, [f"model.path={path}", f"eval.size={eval_size}", f"rollout.max_new_tokens={MAX_NEW}",
                             f"rollout.temperature={TEMP}"])
    return evaluate_only(cfg)


def warm_imports(model: str) -> None:
    """Import the model's transformers modules before the clock starts, for both systems alike:
    library import time (seconds, once per process) is not RL throughput."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    AutoTokenizer.from_pretrained(model)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))


def run_child(args) -> None:
    import torch

    warm_imports(args.model)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        if args.child == "trl":
            res = child_trl(args.model, args.steps, d)
        else:
            res = child_relayrl(args.child, args.model, args.steps, d)
        res["peak_rss_gib"] = peak_rss_gib()
        res["eval"] = evaluate_weights(res.pop("weights"), args.eval_size)
    Path(args.result).write_text(json.dumps(res))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:demo")
    ap.add_argument("--steps", type=int, default=20, help=f"optimiser steps ({PROMPTS}×{G} samples each)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--eval-size", type=int, default=256)
    ap.add_argument("--systems", nargs="+", default=["trl", *RELAYRL_MODES])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return run_child(args)

    from relayrl.models import resolve_model_path

    model = resolve_model_path(args.model)
    results: dict[str, list[dict]] = {s: [] for s in args.systems}
    for r in range(args.runs):
        for s in args.systems if r % 2 == 0 else reversed(args.systems):  # alternate the order
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                cmd = [sys.executable, __file__, "--child", s, "--result", f.name, "--model", model,
                       "--steps", str(args.steps), "--eval-size", str(args.eval_size)]
                print(f"run {r + 1}/{args.runs}: {s} ...", flush=True)
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
                res = json.loads(Path(f.name).read_text())
            results[s].append(res)
            print(f"  {res['samples'] / res['wall']:.2f} samples/s, {res['wall']:.1f}s, "
                  f"accuracy {res['eval']['accuracy']:.1%}", flush=True)

    def mean(s, key):
        vals = [x[key] for x in results[s]]
        return sum(vals) / len(vals)

    stats = {}
    for s in args.systems:
        stats[s] = {
            "samples_per_s": mean(s, "samples") / mean(s, "wall"),
            "tokens_per_s": sum(x["tokens"] for x in results[s]) / sum(x["wall"] for x in results[s]),
            "wall": mean(s, "wall"),
            "accuracy": sum(x["eval"]["accuracy"] for x in results[s]) / len(results[s]),
            "accuracy_greedy": sum(x["eval"]["accuracy_greedy"] for x in results[s]) / len(results[s]),
            "peak_rss_gib": max(x["peak_rss_gib"] for x in results[s]),
            "gen_seconds": mean(s, "gen_seconds"),
        }
    base = stats.get("trl")
    header = ["system", "samples/s", "gen tokens/s", "wall s", "of which generating s", "accuracy (T=1)",
              "greedy acc", "peak RSS GiB", "samples/s vs TRL"]
    rows = []
    for s, v in stats.items():
        ratio = f"{v['samples_per_s'] / base['samples_per_s']:.2f}x" if base else "n/a"
        rows.append([s, f"{v['samples_per_s']:.2f}", f"{v['tokens_per_s']:,.0f}", f"{v['wall']:.1f}",
                     f"{v['gen_seconds']:.1f}",
                     f"{v['accuracy']:.1%}", f"{v['accuracy_greedy']:.1%}", f"{v['peak_rss_gib']:.2f}", ratio])
    data = {"machine": machine_info(), "model": args.model, "steps": args.steps, "runs": args.runs,
            "workload": {"prompts_per_step": PROMPTS, "group_size": G, "max_new_tokens": MAX_NEW,
                         "temperature": TEMP, "lr": LR, "warmup_steps": WARMUP},
            "stats": stats, "raw": results}
    write_results(Path(args.out), "vs_trl", header, rows, data)


if __name__ == "__main__":
    main()
