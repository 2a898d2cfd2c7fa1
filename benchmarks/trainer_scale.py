"""The trainer at a real size: one optimiser step of a randomly initialised model of Qwen2.5-0.5B's
shape (built from its config: no download) over a batch of realistic lengths, per dtype.

Prints tokens trained per second (the timed step after one warm-up step), peak GPU memory, and the
time to gather the full state dict for the engine (``Trainer.full_state_dict``: on the CPU, as
engines get it). Written for a GPU (``--device cuda``, the default where CUDA is present); on a CPU
``--small`` shrinks everything to check the script itself.

    python benchmarks/trainer_scale.py                            # 64 sequences x 1,024 tokens, fp32 and bf16
    python benchmarks/trainer_scale.py --small --device cpu       # a smoke run of the script
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_info, results_dir, write_results  # noqa: E402

# Qwen2.5-0.5B's shape (its config.json), and a small one for checking the script on a CPU
QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
                  tie_word_embeddings=True, rms_norm_eps=1e-6)
# Qwen3-30B-A3B's per-layer shape (hidden 2048, 128 experts of FFN 768, 8 per token, 32 query / 4 KV heads of 128,
# vocab 151,936, untied), with only as many layers as fit a 24 GiB machine: trainer_memory.py's MoE rows
QWEN3_30B_A3B = dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_experts=128, num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6,
                     tie_word_embeddings=False, rms_norm_eps=1e-6, norm_topk_prob=True, decoder_sparse_step=1,
                     mlp_only_layers=[])
# Llama-3.1-8B's shape (its config.json: hidden 4096, 32 layers, 32 query / 8 KV heads, FFN 14,336, vocab 128,256,
# untied), with as many layers as a run names: trainer_memory.py's 8B rows (a LoRA step on a bfloat16 base)
LLAMA31_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                  rope_theta=500000.0, tie_word_embeddings=False, rms_norm_eps=1e-5)
SMALL = dict(QWEN25_05B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1000)


def batch(n: int, length: int, vocab: int, seed: int = 0):
    """``n`` responses, prompt 128 tokens, response lengths spread up to ``length`` (a long tail:
    half the rows at most a quarter of it), group advantages in [-1, 1]."""
    from relayrl.records import FinishReason, Prompt, Trajectory
    from relayrl.train.trainer import build_batch

    g = torch.Generator().manual_seed(seed)
    prompt_len = min(128, length // 4)
    out = []
    for i in range(n):
        top = length - prompt_len if i % 2 else (length - prompt_len) // 4
        r = int(torch.randint(max(1, top // 2), top + 1, (1,), generator=g))
        ids = torch.randint(10, vocab, (prompt_len + r,), generator=g).tolist()
        out.append(Trajectory(Prompt(f"p{i // 8}", []), f"g{i // 8}", i % 8, ids[:prompt_len], ids[prompt_len:],
                              [-2.0] * r, [0] * r, FinishReason.STOP))
    return build_batch(out, torch.linspace(-1, 1, n), 0)


def measure(dtype: str, a) -> dict:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from relayrl.config import AlgoCfg, TrainerCfg
    from relayrl.train.trainer import Trainer

    shape = SMALL if a.small else QWEN25_05B
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**shape)).to(getattr(torch, dtype))
    params = sum(p.numel() for p in model.parameters())
    tr = Trainer(model, TrainerCfg(device=a.device, micro_batch_tokens=a.micro_batch_tokens, warmup_steps=0),
                 AlgoCfg(), 1.0, 10, a.length)
    b = batch(a.sequences, a.length, shape["vocab_size"])
    tokens = int(b.attention_mask.sum())
    sync = torch.cuda.synchronize if tr.device.type == "cuda" else (lambda: None)
    tr.step(b)  # warm-up: kernels, allocator, the optimiser's state
    sync()
    if tr.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    m = tr.step(b)
    sync()
    step_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    sd = tr.full_state_dict()
    gather_s = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**30 if tr.device.type == "cuda" else float("nan")
    assert all(v.device.type == "cpu" for v in sd.values())
    return {"dtype": dtype, "params": params, "tokens": tokens, "step_s": step_s, "tokens_per_s": tokens / step_s,
            "peak_gpu_gib": peak, "state_dict_s": gather_s, "loss": m["loss"], "grad_norm": m["grad_norm"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--length", type=int, default=1024, help="longest sequence, prompt included")
    ap.add_argument("--micro-batch-tokens", type=int, default=16384)
    ap.add_argument("--small", action="store_true", help="a tiny model of the same family (checks the script)")
    ap.add_argument("--out", help="the results' folder (default: benchmarks/results; --small: a temporary one)")
    ap.add_argument("--name", default="trainer_scale")
    a = ap.parse_args()
    if a.small:
        a.sequences, a.length = min(a.sequences, 8), min(a.length, 64)
    rows, data = [], {"machine": machine_info(), "device": a.device, "sequences": a.sequences, "length": a.length,
                      "micro_batch_tokens": a.micro_batch_tokens, "results": []}
    for dtype in a.dtypes:
        r = measure(dtype, a)
        data["results"].append(r)
        rows.append([dtype, f"{r['params'] / 1e6:.0f}M", f"{a.sequences} x ≤{a.length}", f"{r['tokens']:,}",
                     f"{r['step_s']:.2f}", f"{r['tokens_per_s']:,.0f}", f"{r['peak_gpu_gib']:.1f}",
                     f"{r['state_dict_s']:.2f}", f"{r['loss']:.4f}"])
        print(rows[-1], flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    write_results(results_dir(a.out, check=a.small), a.name,
                  ["dtype", "parameters", "batch", "tokens", "step s", "tokens/s trained", "peak GPU GiB",
                   "full state dict s", "loss"], rows, data)


if __name__ == "__main__":
    main()
