"""Peak memory and speed of one training step as responses grow, with each memory feature off and on.

A randomly initialised model of Qwen2.5-0.5B's shape (``trainer_scale.QWEN25_05B``: built from its
config, no download; ``--model-scale tiny``: a small Qwen2 to check the script) takes training
steps through relayrl's ``Trainer.step`` on a batch of two rows of L tokens each (128 of them
prompt), for each response length L and each configuration:

    all off                         gradient_checkpointing=off, logprob_chunk_tokens=0, pack=false
    <feature>=<on>                  all off but that feature (one ablation row per feature)
    all on                          every feature on

each in float32 and under bfloat16 autocast (``trainer.bf16=true``). The features are TrainerCfg
fields passed as overrides (``trainer.gradient_checkpointing``, ``trainer.logprob_chunk_tokens``,
``trainer.pack``); one this version of TrainerCfg rejects is skipped: an "on" row that needs it reads
"not available in this version", an "off" value it lacks is left out (a version without the
feature runs without it). ``trainer.share_prefix`` is off in every row (``--base`` to change), so
each row measures its features alone. Each cell is its own process (this script with ``--one``), so
peaks do not mix: the process's peak RSS on a CPU (``ru_maxrss``: weights, gradients, optimiser state
and activations), ``torch.cuda.max_memory_allocated`` on a GPU, measured over the last of
``--steps`` steps (the first warms up: kernels, allocator; Adam's state is allocated before it, by a
step on zero gradients, so a single step already holds everything), and the tokens per second of
that step. A cell whose peak, extrapolated from its row's shorter lengths, would pass ``--limit-gib``
is not run (on a CPU without swap the kernel would kill it, or a neighbour). Also printed: how fast the peak grows per 1,024 tokens of row length from 1,024 to
4,096 (or the first and last of ``--lengths``; not the one-row ``--long`` cell, nor with one length), as a ratio
to the all-off row of its precision;
and, with ``trainer.pack``, a long-tail batch (``--longtail-rows`` rows, lengths log-normal up to
``--longtail-length``) packed against padded: the padded micro-batches' padding fraction, step
time and peak of each.

    python benchmarks/trainer_memory.py --device cuda                  # the table, on a GPU
    python benchmarks/trainer_memory.py --device cuda --long           # + 32,768 tokens (one row)
    python benchmarks/trainer_memory.py --model-scale tiny --lengths 256 --device cpu   # check the script
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_info, results_dir, write_results  # noqa: E402
from trainer_scale import LLAMA31_8B, QWEN3_30B_A3B, QWEN25_05B, SMALL  # noqa: E402

SCALES = {"0.5b": QWEN25_05B, "tiny": SMALL, **{f"30b-a3b-{n}l": dict(QWEN3_30B_A3B, num_hidden_layers=n) for n in (1, 2, 4, 8)},
          **{f"8b-{n}l": dict(LLAMA31_8B, num_hidden_layers=n) for n in (1, 2, 4)}, "8b": LLAMA31_8B,
          "tiny-moe": dict(QWEN3_30B_A3B, hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=1000,
                           num_hidden_layers=2)}
PROMPT = 128
LONG = 32768  # --long: this length, with one row
NA = "not available in this version"


def features(chunk: int) -> dict[str, tuple]:
    """Each memory feature's (off, on) value, by TrainerCfg field."""
    return {"gradient_checkpointing": ("off", "on"), "logprob_chunk_tokens": (0, chunk), "pack": (False, True)}


def configurations(chunk: int, precisions: list[str]) -> list[tuple[str, dict]]:
    """(row name, TrainerCfg overrides): all off, each feature on alone, all on; per precision."""
    feats = features(chunk)
    off = {k: v[0] for k, v in feats.items()}
    out = []
    for prec in precisions:
        bf16 = {"bf16": prec == "bf16"}
        out.append((f"{prec} · all off", {**off, **bf16}))
        out += [(f"{prec} · {k}={_show(v[1])}", {**off, k: v[1], **bf16}) for k, v in feats.items()]
        out.append((f"{prec} · all on", {**{k: v[1] for k, v in feats.items()}, **bf16}))
    return out


def _show(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def unavailable(overrides: dict) -> list[str]:
    """The fields of ``overrides`` that this version's TrainerCfg rejects as unknown (each tried alone:
    a value it knows but refuses is a real error, raised)."""
    from pydantic import ValidationError

    from relayrl.config import TrainerCfg

    out = []
    for k, v in overrides.items():
        try:
            TrainerCfg.model_validate({k: v})
        except ValidationError as e:
            if all(err["type"] == "extra_forbidden" for err in e.errors()):
                out.append(k)
            else:
                raise
    return out


def plan(overrides: dict, chunk: int) -> tuple[dict, list[str], list[str]]:
    """(overrides this version takes, "on" features it lacks: the row cannot run, "off" values left out)."""
    feats = features(chunk)
    missing = unavailable(overrides)
    lacking = [k for k in missing if k in feats and overrides[k] != feats[k][0]]
    dropped = [k for k in missing if k not in lacking]
    return {k: v for k, v in overrides.items() if k not in missing}, lacking, dropped


# -- one configuration, in its own process ------------------------------------------------------------
def rows_of(spec: dict) -> list[tuple[int, int]]:
    """(prompt, response) lengths of the batch's rows: ``rows`` rows of ``length`` tokens, or a long tail."""
    import torch

    L, prompt = spec["length"], min(PROMPT, spec["length"] // 2)
    if spec.get("kind") != "longtail":
        return [(prompt, L - prompt)] * spec["rows"]
    g = torch.Generator().manual_seed(spec.get("seed", 0))
    # log-normal responses, median an eighth of the room, the first row as long as allowed
    room = L - prompt
    draws = torch.exp(torch.randn(spec["rows"], generator=g) + math.log(room / 8)).long().clamp(16, room).tolist()
    draws[0] = room
    return [(prompt, r) for r in draws]


def make_batch(spec: dict, vocab: int):
    import torch

    from relayrl.records import FinishReason, Prompt, Trajectory
    from relayrl.train.trainer import build_batch

    g = torch.Generator().manual_seed(spec.get("seed", 0))
    trajs = []
    for i, (p, r) in enumerate(rows_of(spec)):
        ids = torch.randint(10, vocab, (p + r,), generator=g).tolist()
        trajs.append(Trajectory(Prompt(f"p{i}", []), f"g{i}", 0, ids[:p], ids[p:], [-2.0] * r, [0] * r,
                                FinishReason.STOP))
    n = len(trajs)
    adv = torch.linspace(-1, 1, n) if n > 1 else torch.ones(1)
    return build_batch(trajs, adv, 0)


def padding_fraction(batch, budget: int, packed: bool = False) -> float:
    """The share of the token positions the trainer's micro-batches forward that are padding (rows ×
    longest, grouped by length under the token budget, as the trainer groups them; packed: none)."""
    from relayrl.train.batch import micro_batches
    from relayrl.train.packing import padding_fraction as fraction

    return fraction(batch.attention_mask.sum(1).tolist(), micro_batches(batch, budget, packed=packed), packed)


def prime_optimizer(tr) -> None:
    """Adam's state allocated before the first step (a step on zero gradients: the weights do not move), so
    that even a single measured step holds weights, gradients, optimiser state and activations at once."""
    import torch

    for p in tr.model.parameters():
        if p.requires_grad:  # (a LoRA adapter: its tensors only)
            p.grad = torch.zeros_like(p)
    tr.opt.step()
    tr.opt.zero_grad(set_to_none=True)


def measure_one(spec: dict) -> dict:
    import resource

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from relayrl.config import AlgoCfg, TrainerCfg
    from relayrl.train.trainer import Trainer

    shape = SCALES[spec["scale"]]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # (the interpreter, torch, transformers)
    torch.manual_seed(0)
    shape = {"model_type": "qwen2", **shape}  # (a mixture of experts' scales name theirs: qwen3_moe)
    dtype = torch.bfloat16 if spec.get("base_dtype") == "bfloat16" else torch.float32  # (model.dtype)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**shape), dtype=dtype)
    if spec.get("lora_r"):  # (benchmarks/lora.py: a LoRA adapter of this rank on every linear layer, trained alone)
        from relayrl.config import LoraCfg
        from relayrl.train import lora

        model, _ = lora.wrap(model, LoraCfg(r=spec["lora_r"]))
    b = make_batch(spec, shape["vocab_size"])
    tokens = int(b.attention_mask.sum())
    budget = spec["micro_batch_tokens"] or b.size * b.input_ids.shape[1]
    cfg = TrainerCfg.model_validate({"device": spec["device"], "micro_batch_tokens": budget, "warmup_steps": 0,
                                     **spec["overrides"]})
    tr = Trainer(model, cfg, AlgoCfg(kl_coef=0.0), 1.0, 10, spec["length"])
    prime_optimizer(tr)
    cuda = tr.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for i in range(spec["steps"]):
        if cuda and i == spec["steps"] - 1:
            sync()
            torch.cuda.reset_peak_memory_stats()
        sync()
        t0 = time.perf_counter()
        m = tr.step(b)
        sync()
        step_s = time.perf_counter() - t0
    out = {"tokens": tokens, "rows": b.size, "step_s": step_s, "tokens_per_s": tokens / step_s,
           "cpu_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "cpu_rss_before_model_gib": before,
           "padding_fraction": padding_fraction(b, budget, bool(spec["overrides"].get("pack"))), "micro_batch_tokens": budget, "loss": m["loss"]}
    if cuda:
        out["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["gpu_peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    out["peak_gib"] = out["gpu_peak_gib"] if cuda else out["cpu_peak_rss_gib"]
    return out


def run_one(spec: dict, timeout: float) -> dict:
    """``spec`` measured in a fresh process: its result, or {"error": ...}."""
    cmd = [sys.executable, __file__, "--one", json.dumps(spec)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout ({timeout:.0f} s)"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (p.stderr or "").strip().splitlines()[-5:]
    oom = p.returncode == -9 or any("out of memory" in t.lower() or "OutOfMemory" in t for t in tail)
    return {"error": "OOM" if oom else f"failed (exit {p.returncode})", "stderr": tail}


def cell(r: dict | None) -> str:
    if r is None:
        return ""
    if r.get("unavailable"):
        return NA + f" ({', '.join(r['unavailable'])})"
    if "error" in r:
        return r["error"]
    return f"{r['peak_gib']:.2f} GiB, {r['tokens_per_s']:,.0f} tok/s"


def growth(results: dict[int, dict], a: int, b: int) -> tuple[float, int] | None:
    """(GiB of peak per 1,024 tokens of row length from length ``a`` to ``b``, or to the longest length measured
    below ``b``; that length)."""
    done = [L for L, r in results.items() if a < L <= b and "peak_gib" in r]
    if "peak_gib" not in results.get(a, {}) or not done:
        return None
    b = max(done)
    return (results[b]["peak_gib"] - results[a]["peak_gib"]) / ((b - a) / 1024), b


def projected(per_length: dict[int, dict], L: int) -> float | None:
    """The peak at length ``L`` extrapolated linearly from the two longest lengths measured below it (memory
    that grows faster than linearly makes this an underestimate), or None."""
    done = sorted(x for x, r in per_length.items() if x < L and "peak_gib" in r)
    if len(done) < 2:
        return None
    a, b = done[-2:]
    ga, gb = per_length[a]["peak_gib"], per_length[b]["peak_gib"]
    return gb + (gb - ga) * (L - b) / (b - a)


def _memory_gib() -> float:
    """The machine's memory, GiB (0 where it cannot be read)."""
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return 0.0


# -- the table ------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # (a child: one configuration, as JSON)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--model-scale", choices=list(SCALES), default="0.5b")
    ap.add_argument("--lengths", type=int, nargs="*", default=[1024, 2048, 4096, 8192],
                    help="tokens per row, prompt (128) included")
    ap.add_argument("--long", action="store_true", help=f"also {LONG:,} tokens, with one row")
    ap.add_argument("--rows", type=int, default=2, help="rows per batch")
    ap.add_argument("--precisions", nargs="+", choices=["float32", "bf16"], default=["float32", "bf16"])
    ap.add_argument("--configs", nargs="+", help="only the rows whose name (after the precision) is one of "
                    "these, e.g. 'all off' 'gradient_checkpointing=on' (default: all)")
    ap.add_argument("--chunk", type=int, default=1024, help="logprob_chunk_tokens in its 'on' rows")
    ap.add_argument("--steps", type=int, default=2, help="steps per cell; the last is measured")
    ap.add_argument("--micro-batch-tokens", type=int, default=0, help="0: the whole batch in one micro-batch")
    ap.add_argument("--base", nargs="*", default=["share_prefix=false"], help="TrainerCfg overrides of every row")
    ap.add_argument("--longtail-rows", type=int, default=16, help="0: no long-tail packed-vs-padded rows")
    ap.add_argument("--longtail-length", type=int, default=4096)
    ap.add_argument("--limit-gib", type=float, default=None,
                    help="skip a cell whose peak, extrapolated from its row's shorter lengths, exceeds this (0: run "
                    "all; default on a CPU: the machine's memory less 1 GiB, where the kernel would kill the cell and "
                    "maybe a neighbour: this machine has no swap; on a GPU: 0, an OOM there is an exception)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per cell")
    ap.add_argument("--lora-r", type=int, default=0, help="a LoRA adapter of this rank (model.lora.targets=all-linear) "
                    "in every cell, trained alone (0: full fine-tuning)")
    ap.add_argument("--base-dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the model's weights' dtype (model.dtype); bfloat16 with --lora-r: a LoRA step on a bfloat16 "
                    "base, its adapter in float32 (PEFT's)")
    ap.add_argument("--out", help="the results' folder (default: benchmarks/results; --model-scale tiny: a "
                    "temporary one)")
    ap.add_argument("--name", default="trainer_memory")
    a = ap.parse_args()
    if a.limit_gib is None:
        a.limit_gib = 0.0 if a.device == "cuda" else _memory_gib() - 1
    if a.one:
        print("RESULT " + json.dumps(measure_one(json.loads(a.one))), flush=True)
        return
    base = {k: json.loads(v) if v in ("true", "false") or v.lstrip("-").isdigit() else v
            for k, v in (x.split("=", 1) for x in a.base)}
    configs = configurations(a.chunk, a.precisions)
    if a.configs:
        configs = [(n, o) for n, o in configs if n.split(" · ", 1)[1] in a.configs]
    lengths = a.lengths + ([LONG] if a.long else [])
    common = {"scale": a.model_scale, "device": a.device, "steps": a.steps, "micro_batch_tokens": a.micro_batch_tokens,
              "lora_r": a.lora_r, "base_dtype": a.base_dtype}
    data = {"machine": machine_info(), "args": vars(a), "results": {}}
    table = []
    for name, overrides in configs:
        takes, lacking, dropped = plan({**base, **overrides}, a.chunk)
        per_length = {}
        for L in lengths:
            guess = projected(per_length, L)
            failed = [x for x, r in per_length.items() if x < L and r.get("error") == "OOM"]
            if lacking:
                r = {"unavailable": lacking}
            elif failed:  # (longer only needs more)
                r = {"error": f"not run: OOM at L={failed[0]:,}"}
            elif a.limit_gib and guess is not None and guess > a.limit_gib:  # (no swap here: the kernel would kill)
                r = {"error": f"not run: projected ≥ {guess:.1f} GiB > {a.limit_gib:g} GiB"}
            else:
                spec = {**common, "overrides": takes, "length": L, "rows": 1 if L == LONG else a.rows}
                r = {**run_one(spec, a.timeout), "overrides": takes, "left_out": dropped}
            per_length[L] = r
            data["results"][f"{name}/{L}"] = r
            print(f"{name}, L={L}: {cell(r)}", flush=True)
        table.append((name, per_length))
    header, rows = memory_table(a, table, lengths, data)
    if a.longtail_rows:
        rows += longtail(a, base, common, data, len(header))
    unit = "GPU max_memory_allocated" if a.device == "cuda" else "CPU peak RSS"
    data["note"] = f"peak: {unit}; model {a.model_scale}; cells: peak GiB, tokens/s of the last of {a.steps} steps"
    print(data["note"])
    write_results(results_dir(a.out, check=a.model_scale.startswith("tiny")), a.name, header, rows, data)


def growth_span(lengths: list[int]) -> tuple[int, int] | None:
    """The row lengths the growth is read between: 1,024 → 4,096 where both ran, else the first and last of
    ``--lengths`` (two-row cells only: the one-row --long cell holds half the batch's tokens); None with one."""
    ls = sorted(set(lengths))
    if {1024, 4096} <= set(ls):
        return 1024, 4096
    return (ls[0], ls[-1]) if len(ls) > 1 else None


def memory_table(a, table: list[tuple[str, dict]], lengths: list[int], data: dict) -> tuple[list, list]:
    """(header, rows): each configuration's cells, and how fast its peak grows against all off's."""
    span = growth_span(a.lengths)
    header = ["configuration", *[f"L={L:,}" + (" (1 row)" if L == LONG else f" ({a.rows} rows)") for L in lengths]]
    if span:
        header += [f"peak GiB per 1k tokens of row length, L {span[0]:,}→{span[1]:,} ({a.rows} rows)", "vs all off"]
    all_off = {n.split(" · ")[0]: growth(p, *span) for n, p in table if n.endswith("· all off") and span}
    rows = []
    for name, per_length in table:
        row = [name, *[cell(per_length[L]) for L in lengths]]
        if span:
            g, ref = growth(per_length, *span), all_off.get(name.split(" · ")[0])
            ratio = f"{g[0] / ref[0]:.2f}x" if g is not None and ref and ref[0] else ""
            data["results"][f"{name}/growth"] = {"gib_per_1k": g and g[0], "to_length": g and g[1], "vs_all_off": ratio}
            row += ["" if g is None else f"{g[0]:.3f}" + ("" if g[1] == span[1] else f" (to {g[1]:,})"), ratio]
        rows.append(row)
    return header, rows


def longtail(a, base: dict, common: dict, data: dict, width: int) -> list[list[str]]:
    """A long-tail batch, padded against packed (the other features on): padding fraction, step time, peak."""
    out = []
    budget = a.micro_batch_tokens or 2 * a.longtail_length
    for prec in a.precisions:
        for label, pack in (("padded", False), ("packed", True)):
            # (the other memory features on: the padded rows of a long tail would not fit otherwise)
            overrides = {**base, **{k: v[1] for k, v in features(a.chunk).items()}, "pack": pack, "bf16": prec == "bf16"}
            takes, lacking, dropped = plan(overrides, a.chunk)
            name = f"{prec} · long tail, {a.longtail_rows} rows ≤ {a.longtail_length:,}, {label} (the rest on)"
            if lacking:
                r = {"unavailable": lacking}
                text = cell(r)
            else:
                spec = {**common, "overrides": takes, "length": a.longtail_length, "rows": a.longtail_rows,
                        "kind": "longtail", "micro_batch_tokens": budget}
                r = {**run_one(spec, a.timeout), "left_out": dropped}
                text = cell(r) if "error" in r else (
                    f"{r['peak_gib']:.2f} GiB, step {r['step_s']:.2f} s, {r['tokens_per_s']:,.0f} tok/s"
                    + ("" if pack else f", padding {r['padding_fraction']:.0%}"))
            data["results"][name] = r
            print(f"{name}: {text}", flush=True)
            out.append([name, text] + [""] * (width - 2))
    return out


if __name__ == "__main__":
    main()
