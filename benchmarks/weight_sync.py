"""A full-weight update to vLLM: through a file in /dev/shm against through the collective (rollout.weight_sync),
side by side on one engine, on vLLM's CPU build (or a GPU build: gloo either way; NCCL is not wired).

The model is random weights of a real model's shape (Qwen2.5-0.5B by default; ``--shape 8b-layers`` is Llama-3-8B's
width with 2 of its 32 layers, what one engine's update of an 8B model's layers moves per layer pair). Each path
updates ``--repeats`` times; printed: seconds an update (generation paused for all of it: the stall it adds to a
step, in the sync and the async modes alike), the trainer's and the engine core's peak resident memory above their
level before the updates, and the ratio file / collective.

    python benchmarks/weight_sync.py
    python benchmarks/weight_sync.py --shape 8b-layers --bucket-mb 1100 2048
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_info, results_dir, write_results  # noqa: E402

SHAPES = {  # (config class, fields)
    "qwen2.5-0.5b": ("Qwen2Config", dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                                         num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                                         tie_word_embeddings=True, max_position_embeddings=2048)),
    "8b-layers": ("LlamaConfig", dict(hidden_size=4096, num_hidden_layers=2, num_attention_heads=32,
                                      num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                                      tie_word_embeddings=False, max_position_embeddings=2048)),
}


class Peak:
    """The peak resident memory of some processes above their level at start, sampled every 20 ms."""

    def __init__(self, procs):
        self.procs, self.base = procs, [p.memory_info().rss for p in procs]
        self.peak, self.stop = [0] * len(procs), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.wait(0.02):
            for i, p in enumerate(self.procs):
                try:
                    self.peak[i] = max(self.peak[i], p.memory_info().rss - self.base[i])
                except Exception:  # noqa: BLE001 (a process gone: its last peak stands)
                    pass

    def end(self) -> list[float]:
        self.stop.set()
        self.thread.join()
        return [x / 2**30 for x in self.peak]


def build(shape: str, folder: Path, dtype: str):
    import torch
    import transformers

    cls, fields = SHAPES[shape]
    config = getattr(transformers, cls)(**fields, torch_dtype=dtype)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=getattr(torch, dtype))
    model.save_pretrained(folder)
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--bucket-mb", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import psutil

    from relayrl.engine.vllm import VLLMEngine

    rows, data = [], {"machine": machine_info(), "shape": args.shape, "dtype": args.dtype, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        model = build(args.shape, Path(tmp), args.dtype)
        sd = model.state_dict()
        new = {k: v + 1e-3 for k, v in sd.items()}  # (other weights than the engine started with)
        size = sum(v.numel() * v.element_size() for v in sd.values()) / 2**30
        print(f"{args.shape}: {sum(v.numel() for v in sd.values()) / 1e9:.2f}B parameters, {size:.2f} GiB in {args.dtype}")
        for bucket in args.bucket_mb:
            eng = VLLMEngine(tmp, [0], dtype=args.dtype, max_model_len=512, weight_sync="collective",
                             sync_bucket_mb=bucket, sync_timeout_s=600)
            core = max(psutil.Process().children(recursive=True), key=lambda p: p.memory_info().rss)
            channel, times = eng._channel, {}
            try:
                for path in ("file", "collective"):
                    eng._channel = channel if path == "collective" else None  # (the same engine, either path)
                    peak, took = Peak([psutil.Process(), core]), []
                    for i in range(args.repeats):
                        t0 = time.perf_counter()
                        eng.load_weights(new, i + 1)
                        took.append(time.perf_counter() - t0)
                    mem = peak.end()
                    times[path] = min(took)
                    data["runs"].append({"path": path, "bucket_mb": bucket, "seconds": took, "peak_gib": mem})
                    rows.append([path, str(bucket) if path == "collective" else "—", f"{min(took):.2f}",
                                 f"{sum(took) / len(took):.2f}", f"{mem[0]:.2f}", f"{mem[1]:.2f}"])
                rows.append(["file / collective", str(bucket), f"{times['file'] / times['collective']:.2f}x", "", "", ""])
            finally:
                eng._channel = channel
                eng.close()
    header = ["path", "bucket MB", "s an update (best)", "s (mean)", "trainer peak +GiB", "engine core peak +GiB"]
    write_results(results_dir(args.out), f"weight_sync-{args.shape}", header, rows, data)


if __name__ == "__main__":
    main()
