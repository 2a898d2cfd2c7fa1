"""What one weight update costs the vLLM engine: the full weights (a safetensors file in /dev/shm, reloaded by the
workers) against a LoRA adapter (``model.lora``: PEFT's files in /dev/shm, loaded as a new version beside the base
weights), on the same model.

Bytes: what each update writes (the files vLLM reads), and the tensors' bytes in memory. Seconds: ``load_weights``
as the trainer calls it, the median of ``--repeats`` updates after a first one (left out: vLLM's first load of
anything pays once), with nothing generating. The adapter targets every linear layer (PEFT's
q/k/v/o and gate/up/down on a Llama), alpha = 2r; its values are random (the cost does not depend on them). Each
setting runs in its own process (``engines.in_fresh_process``).

    python benchmarks/vllm_lora_sync.py                      # the demo model, r = 1, 8, 32
    python benchmarks/vllm_lora_sync.py --ranks 8 --repeats 20
    python benchmarks/vllm_lora_sync.py --qwen-shape --dtype bfloat16 --repeats 3 --name vllm_lora_sync_qwen05b

``--qwen-shape``: a randomly initialised model of Qwen2.5-0.5B's shape (benchmarks/trainer_scale.py), saved with
the demo's tokenizer (nothing is generated: the tokenizer only names the end token).

``measure_full`` and ``measure_lora`` are importable (benchmarks/lora.py's sync columns).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_info, write_results
from engines import in_fresh_process
from trainer_scale import QWEN25_05B

from relayrl.lora_weights import LoraSpec
from relayrl.models import load_policy, load_tokenizer, resolve_model_path

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _engine(path: str, dtype: str, lora: LoraSpec | None):
    from relayrl.engine.spec import eos_token_ids
    from relayrl.engine.vllm import VLLMEngine

    return VLLMEngine(path, eos_token_ids(path, load_tokenizer(path)), dtype=dtype, max_model_len=512,
                      lora=lora, lora_versions=3)


def qwen_shape(folder: Path, dtype: str) -> str:
    """A random model of Qwen2.5-0.5B's shape in ``folder``, with the demo's tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from relayrl.demo.model import demo_model_path
    from relayrl.models import DTYPES

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**QWEN25_05B)).to(DTYPES[dtype]).save_pretrained(folder)
    load_tokenizer(str(demo_model_path(log=lambda *a: None))).save_pretrained(folder)
    return str(folder)


def _files(folder: Path, pattern: str) -> int:
    return sum(p.stat().st_size for p in folder.glob(pattern) if p.is_file())


def _timed(eng, state_dict: dict, repeats: int, written) -> tuple[float, int]:
    """(median seconds per update after the first, bytes the last update left on disk). The median: on a machine
    shared with other jobs one update in a few can take several times as long."""
    eng.load_weights(state_dict, 1)
    times = []
    for v in range(2, repeats + 2):
        t0 = time.perf_counter()
        eng.load_weights(state_dict, v)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), written()


def measure_full(path: str, repeats: int, dtype: str = "float32") -> dict:
    sd = load_policy(path, dtype).state_dict()
    eng = _engine(path, dtype, None)
    try:
        seconds, on_disk = _timed(eng, sd, repeats, lambda: _files(eng._shm, "model.safetensors"))
    finally:
        eng.close()
    return {"seconds": seconds, "file_bytes": on_disk,
            "tensor_bytes": sum(v.numel() * v.element_size() for v in sd.values())}


def measure_lora(path: str, r: int, repeats: int, dtype: str = "float32") -> dict:
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    spec = LoraSpec(r, 2.0 * r, TARGETS)
    model = get_peft_model(load_policy(path, dtype), LoraConfig(r=r, lora_alpha=spec.alpha,
                                                                target_modules=list(TARGETS)))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.01)
    sd = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    eng = _engine(path, dtype, spec)
    try:
        seconds, on_disk = _timed(eng, sd, repeats, lambda: _files(eng._shm, "adapter-*/*"))
    finally:
        eng.close()
    return {"seconds": seconds, "file_bytes": on_disk,
            "tensor_bytes": sum(v.numel() * v.element_size() for v in sd.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:demo")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="vllm_lora_sync")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="model.dtype (the engine's)")
    ap.add_argument("--qwen-shape", action="store_true", help="a random model of Qwen2.5-0.5B's shape, not --model")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = qwen_shape(Path(tmp), args.dtype) if args.qwen_shape else str(resolve_model_path(args.model))
        run(args, path)


def run(args, path: str) -> None:
    full = in_fresh_process(measure_full, path, args.repeats, args.dtype)
    rows = [["full weights", f"{full['file_bytes']:,}", "1", f"{full['seconds'] * 1000:.1f}", "1"]]
    model = "random, Qwen2.5-0.5B's shape" if args.qwen_shape else args.model
    data = {"machine": machine_info(), "model": model, "dtype": args.dtype, "repeats": args.repeats, "full": full,
            "lora": {}}
    print(rows[-1], flush=True)
    for r in args.ranks:
        m = in_fresh_process(measure_lora, path, r, args.repeats, args.dtype)
        data["lora"][r] = m
        rows.append([f"LoRA r={r} (every linear layer)", f"{m['file_bytes']:,}",
                     f"{full['file_bytes'] / m['file_bytes']:.0f}x smaller", f"{m['seconds'] * 1000:.1f}",
                     f"{full['seconds'] / m['seconds']:.1f}x faster"])
        print(rows[-1], flush=True)
    write_results(Path(args.out), args.name, ["vLLM weight update", "bytes written", "bytes vs full",
                                              "ms per update", "time vs full"], rows, data)


if __name__ == "__main__":
    main()
