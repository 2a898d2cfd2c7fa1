"""relayrl sft's training speed: its step against the RL trainer's at Qwen2.5-0.5B's shape, and packing on the
demo's demonstrations, side by side in one run.

1. **SFT vs RL, 0.5B shape** (``trainer_scale.QWEN25_05B``, random init, float32, every memory feature of the
   defaults: checkpointing on at this size, the head in chunks of 1,024): one batch of rows of a long tail of
   lengths (``trainer_memory.make_batch``: 128 prompt tokens, responses up to ``--length``), stepped by
   ``Trainer.sft_step`` (packed, as relayrl sft's default, and padded) and by ``Trainer.step`` (relayrl train's:
   one update, no KL, padded; packing off as its default), interleaved; tokens per second of the rows' real
   tokens, the median of ``--steps`` steps after one warm-up each.
2. **Packing on the demo**: ``Trainer.sft_step`` on batches of 32 of ``builtin:demo-sft``'s demonstrations
   (their lengths differ: 10 to 100 response tokens), the demo model, packed against padded, interleaved.

    python benchmarks/sft_speed.py                 # ~15 min on 2 quiet cores
    python benchmarks/sft_speed.py --scale tiny    # check the script
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_info, results_dir, write_results  # noqa: E402
from trainer_memory import SCALES, make_batch, prime_optimizer  # noqa: E402


def timed(fn, batch, steps: int) -> list[float]:
    out = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        fn(batch)
        out.append(time.perf_counter() - t0)
    return out[1:]


def shape_rows(a) -> list[list[str]]:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from relayrl.config import AlgoCfg, TrainerCfg
    from relayrl.train.trainer import Trainer

    shape = SCALES[a.scale]
    torch.manual_seed(0)
    base = Qwen2ForCausalLM(Qwen2Config(**shape))
    b = make_batch({"rows": a.rows, "length": a.length, "kind": "longtail", "seed": 0}, shape["vocab_size"])
    tokens = int(b.attention_mask.sum())
    common = {"micro_batch_tokens": a.micro_batch_tokens, "warmup_steps": 0, "share_prefix": False,
              "gradient_checkpointing": "on"}
    systems = {
        "relayrl sft (packed: its default)": ("sft", {**common, "pack": True}),
        "relayrl sft, padded": ("sft", {**common, "pack": False}),
        "relayrl train's step (padded: its default)": ("rl", {**common, "pack": False}),
    }
    # (one model and one optimiser for the three: three copies of a 0.5B model with their Adam states took
    # 24 GiB and were killed for memory; the speed of a step does not depend on the weights' values)
    trainers, first = {}, None
    for name, (kind, over) in systems.items():
        tr = Trainer(base, TrainerCfg(**over), AlgoCfg(kl_coef=0.0), 1.0, 100, a.length)
        if first is None:
            prime_optimizer(tr)
            first = tr
        tr.opt, tr.sched = first.opt, first.sched
        trainers[name] = (kind, tr)
    times: dict[str, list[float]] = {n: [] for n in systems}
    for _ in range(a.steps):  # (interleaved: a neighbour's load lands on every system alike)
        for name, (kind, tr) in trainers.items():
            times[name] += timed(tr.sft_step if kind == "sft" else tr.step, b, 1)
    rl = statistics.median(times["relayrl train's step (padded: its default)"])
    return [[name, f"{tokens}", f"{statistics.median(t):.1f}", f"{tokens / statistics.median(t):.1f}",
             f"{rl / statistics.median(t):.2f}x"] for name, t in times.items()]


def demo_rows(a) -> list[list[str]]:
    import torch

    from relayrl.config import AlgoCfg, TrainerCfg
    from relayrl.data.datasets import PromptSampler
    from relayrl.data.sft import load_examples
    from relayrl.models import load_policy, load_tokenizer, resolve_model_path
    from relayrl.run.sft import sft_batch
    from relayrl.train.trainer import Trainer

    path = resolve_model_path("builtin:demo")
    tok = load_tokenizer(path)
    examples = load_examples("builtin:demo-sft", tok)
    sampler = PromptSampler(examples, 0)
    batches = [sft_batch(sampler.take(32), tok.pad_token_id) for _ in range(a.demo_steps + 1)]
    out = {}
    torch.manual_seed(0)
    for pack in (True, False):
        tr = Trainer(load_policy(path), TrainerCfg(pack=pack), AlgoCfg(kl_coef=0.0), 1.0, 100, 1)
        out[pack] = tr
    times = {True: [], False: []}
    for i, b in enumerate(batches):
        for pack, tr in out.items():
            t0 = time.perf_counter()
            tr.sft_step(b)
            if i:  # (the first: warm-up)
                times[pack].append(time.perf_counter() - t0)
    tokens = statistics.mean(int(b.attention_mask.sum()) for b in batches[1:])
    padded = statistics.median(times[False])
    return [[f"demo, {'packed' if pack else 'padded'}", f"{tokens:.0f}", f"{statistics.median(t) * 1000:.0f} ms",
             f"{tokens / statistics.median(t):.0f}", f"{padded / statistics.median(t):.2f}x"] for pack, t in times.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", choices=list(SCALES), default="0.5b")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--micro-batch-tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--demo-steps", type=int, default=12)
    ap.add_argument("--name", default="sft_speed")
    ap.add_argument("--out", help="the results' folder (default: benchmarks/results; --scale tiny: a temporary one)")
    a = ap.parse_args()
    rows = shape_rows(a)
    print(rows, flush=True)
    rows += demo_rows(a)
    header = ["system", "tokens a step", "seconds a step (median)", "tokens/s", "speed vs relayrl train's step "
              "(demo rows: vs padded)"]
    write_results(results_dir(a.out, check=a.scale == "tiny"), a.name, header, rows,
                  {"machine": machine_info(), "args": vars(a)})


if __name__ == "__main__":
    main()
