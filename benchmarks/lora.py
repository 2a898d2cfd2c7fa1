"""LoRA (``model.lora.r``) against full fine-tuning, side by side: what the trainer holds, what a weight
update carries, how long it takes, and whether the demo still learns.

Three parts, each printed as a table with ratios against full fine-tuning:

  sizes     (in this process, seconds) for the demo model and a randomly initialised model of
            Qwen2.5-0.5B's shape (``trainer_scale.QWEN25_05B``, no download), full and each rank: the
            trained parameters, the optimiser state (AdamW's, allocated by a step on zero gradients and
            summed tensor by tensor), the bytes of a weight update (``Trainer.full_state_dict``: whole
            weights, or the adapter's tensors), and for the demo the seconds an in-process ``hf`` engine
            takes to load it (median of ``--repeats``; merged into the base it keeps, for an adapter).
  peak      (``--peak``: a process per cell, minutes each on a CPU) one training step of the 0.5B shape
            over two rows of ``--length`` tokens, every memory feature on (``trainer_memory.py``'s cell):
            peak memory and tokens/s, full against LoRA at ``--peak-rank``.
  learning  the demo's 5-seed results (``benchmarks/seeds.py``'s JSON files, by name: ``--runs
            LABEL=NAME``), sampled and greedy held-out accuracy and the pass rule; ``--run-seeds`` runs the
            missing ones first (``seeds.py --seeds 5 --jobs 2 -- run.threads=1 <the label's overrides>``).

    python benchmarks/lora.py                                   # sizes + learning from existing results
    python benchmarks/lora.py --peak                            # + the 0.5B-shape step, full vs r=8
    python benchmarks/lora.py --run-seeds --runs full=default_after_package "r=1=lora_r1" "r=32=lora_r32"

vLLM's update (bytes and seconds, adapter against full weights) is ``benchmarks/vllm_lora_sync.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_info, write_results  # noqa: E402
from trainer_scale import QWEN25_05B  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def _mb(n: float) -> str:
    return f"{n / 1e6:,.2f} MB" if n < 1e9 else f"{n / 1e9:,.2f} GB"


def _trainer(model, rank: int):
    """A trainer of ``model`` (an adapter of ``rank`` on it when > 0) with its Adam state allocated."""
    import torch

    from relayrl.config import AlgoCfg, LoraCfg, TrainerCfg
    from relayrl.train import lora
    from relayrl.train.trainer import Trainer

    if rank:
        model, _ = lora.wrap(model, LoraCfg(r=rank))
    tr = Trainer(model, TrainerCfg(warmup_steps=0), AlgoCfg(kl_coef=0.0), 1.0, 10, 64)
    for p in tr.params:
        p.grad = torch.zeros_like(p)
    tr.opt.step()  # (zero gradients: nothing moves; the state is allocated)
    tr.opt.zero_grad(set_to_none=True)
    return tr


def _bytes(tensors) -> int:
    """Bytes of the distinct tensors (a tied head is the embedding's storage: counted once)."""
    seen = {(t.data_ptr(), t.numel()): t.numel() * t.element_size() for t in tensors}
    return sum(seen.values())


def sizes(ranks: list[int], repeats: int) -> list[dict]:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from relayrl.config import RolloutCfg
    from relayrl.engine.spec import EngineSpec, build_local_engine
    from relayrl.lora_weights import LoraSpec
    from relayrl.models import load_policy, resolve_model_path

    demo = resolve_model_path("builtin:demo", log=lambda *a, **k: None)
    out = []
    for shape in ("demo", "Qwen2.5-0.5B shape"):
        for rank in [0, *ranks]:
            torch.manual_seed(0)
            model = load_policy(demo) if shape == "demo" else Qwen2ForCausalLM(Qwen2Config(**QWEN25_05B))
            tr = _trainer(model, rank)
            update = tr.full_state_dict()
            row = {"model": shape, "rank": rank, "trained_params": sum(p.numel() for p in tr.params),
                   "optimizer_bytes": _bytes(t for st in tr.opt.state.values() for t in st.values()
                                             if torch.is_tensor(t) and t.dim() > 0),
                   "update_bytes": _bytes(update.values())}
            if shape == "demo":  # an in-process hf engine taking the update
                spec = LoraSpec(rank, float(tr.model.peft_config["default"].lora_alpha),
                                tuple(tr.model.peft_config["default"].target_modules)) if rank else None
                engine = build_local_engine(EngineSpec(RolloutCfg(), demo, demo, "float32", lora=spec))
                times = []
                for v in range(repeats):
                    t0 = time.perf_counter()
                    engine.load_weights(update, v + 1)
                    times.append(time.perf_counter() - t0)
                engine.close()
                row["hf_load_s"] = statistics.median(times)
            out.append(row)
            print(row, flush=True)
            del tr, model, update
    return out


def size_rows(results: list[dict]) -> list[list[str]]:
    full = {r["model"]: r for r in results if r["rank"] == 0}
    rows = []
    for r in results:
        f = full[r["model"]]
        ratio = {k: "" if r["rank"] == 0 else f"{f[k] / r[k]:,.0f}x smaller" for k in ("optimizer_bytes", "update_bytes")}
        load = f"{r['hf_load_s'] * 1e3:.2f} ms" if "hf_load_s" in r else ""
        rows.append([r["model"], "full" if r["rank"] == 0 else f"r={r['rank']}", f"{r['trained_params']:,}",
                     f"{_mb(r['optimizer_bytes'])} {ratio['optimizer_bytes']}".strip(),
                     f"{_mb(r['update_bytes'])} {ratio['update_bytes']}".strip(), load])
    return rows


def peak(rank: int, length: int, timeout: float) -> list[list[str]]:
    import trainer_memory as tm

    rows = []
    for r in (0, rank):
        spec = {"scale": "0.5b", "device": "cpu", "steps": 1, "micro_batch_tokens": 0, "length": length, "rows": 2,
                "lora_r": r, "overrides": {"share_prefix": False, "gradient_checkpointing": "on",
                                           "logprob_chunk_tokens": 1024}}
        res = tm.run_one(spec, timeout)
        print(res, flush=True)
        rows.append(["full" if r == 0 else f"r={r}", tm.cell(res)])
    return rows


def learning(runs: dict[str, str], run_seeds: bool) -> list[list[str]]:
    rows, full = [], None
    for label, name in runs.items():
        f = RESULTS / f"seeds_{name}.json"
        if not f.exists() and run_seeds:
            extra = [] if label == "full" else [f"model.lora.r={label.split('=')[1]}"]
            subprocess.run([sys.executable, str(ROOT / "benchmarks" / "seeds.py"), "--seeds", "5", "--jobs", "2",
                            "--name", name, "--", "run.threads=1", *extra], check=True)
        if not f.exists():
            rows.append([label, f"(no {f.name}: --run-seeds)", "", "", ""])
            continue
        d = json.loads(f.read_text())
        after = [r["eval_accuracy_after"] * 100 for r in d["rows"]]
        greedy = [r["eval_greedy_accuracy_after"] * 100 for r in d["rows"]]
        passes = sum(a - r["eval_accuracy_before"] * 100 >= 20 and r["eval_greedy_accuracy_after"]
                     >= r["eval_greedy_accuracy_before"] for a, r in zip(after, d["rows"]))
        mean = statistics.mean(after)
        full = mean if label == "full" else full
        diff = "" if label == "full" or full is None else f"{mean - full:+.1f} points"
        rows.append([label, f"{mean:.1f}% ± {statistics.pstdev(after):.1f}% (min {min(after):.1f}%)",
                     f"{statistics.mean(greedy):.1f}% ± {statistics.pstdev(greedy):.1f}%", f"{passes}/{len(after)}",
                     diff + f" ({' '.join(d['args'])})"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--peak", action="store_true", help="the 0.5B-shape training step, full against LoRA")
    ap.add_argument("--peak-rank", type=int, default=8)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--runs", nargs="+", default=["full=default_after_package", "r=8=lora_r8"],
                    help="LABEL=NAME: seeds_NAME.json under benchmarks/results (label 'full' or 'r=N')")
    ap.add_argument("--run-seeds", action="store_true", help="run the seeds a --runs entry lacks")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--name", default="lora")
    a = ap.parse_args()
    data = {"machine": machine_info(), "args": vars(a)}
    data["sizes"] = sizes(a.ranks, a.repeats)
    rows = [["**what the trainer holds and sends**", "", "trained parameters", "optimiser state (AdamW)",
             "one weight update", "hf engine load (demo)"], *size_rows(data["sizes"])]
    if a.peak:
        rows += [[f"**one step, 0.5B shape, 2 rows of {a.length:,} tokens**", "peak memory, tokens/s", "", "", "",
                  ""], *[["0.5B shape", *r, "", "", ""] for r in peak(a.peak_rank, a.length, a.timeout)]]
    runs = dict(x.rsplit("=", 1) for x in a.runs)
    rows += [["**demo, 5 seeds**", "sampled after", "greedy after", "pass rule", "against full", ""],
             *[[*r, ""] for r in learning(runs, a.run_seeds)]]
    write_results(Path(a.out), a.name, ["model", "setting", "", "", "", ""], rows, data)


if __name__ == "__main__":
    main()
