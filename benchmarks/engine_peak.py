"""The engine's peak generation rate on this machine, and how much of it training achieves.

Peak: the default model decoding full batches with EOS disabled, so every row runs its whole
budget and nothing idles (the physical ceiling for rollout here). Achieved: a short default
training run's generated tokens per second of generation time, and per second of wall time.

    python benchmarks/engine_peak.py                      # default model, a few minutes on 2 cores
    python benchmarks/engine_peak.py --model PATH --batches 64 256 --tokens 256 --steps 20
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import FIXED_GROUPS, machine_info, write_results  # noqa: E402

from relayrl.config import load_config  # noqa: E402
from relayrl.data.datasets import load_prompts  # noqa: E402
from relayrl.engine import make_engine  # noqa: E402
from relayrl.models import load_policy, load_tokenizer, resolve_model_path  # noqa: E402
from relayrl.models.prompts import encode_prompt  # noqa: E402
from relayrl.records import GenRequest, SamplingParams  # noqa: E402


def peak(model_path: str, engine: str, batch: int, tokens: int, repeats: int) -> float:
    cfg = load_config(None, [f"rollout.engine={engine}", f"rollout.max_batch={batch}",
                             f"rollout.max_new_tokens={tokens}"])
    tok = load_tokenizer(model_path)
    eng = make_engine(cfg.rollout, load_policy(model_path), tok)
    eng.eos_ids = set()  # no early stops: every row decodes its full budget
    prompts = load_prompts("builtin:demo-eval", limit=batch)
    ids = [encode_prompt(tok, p.messages) for p in prompts]
    params = SamplingParams(tokens, 1.0)
    try:
        eng.generate([GenRequest(f"warm{i}", ids[i], SamplingParams(4, 1.0)) for i in range(min(batch, 8))])
        best = 0.0
        for r in range(repeats):
            t0 = time.perf_counter()
            outs = eng.generate([GenRequest(f"r{r}-{i}", ids[i], params) for i in range(batch)])
            dt = time.perf_counter() - t0
            best = max(best, sum(len(c.token_ids) for c in outs) / dt)
        return best
    finally:
        eng.close()


def achieved(steps: int, extra: list[str]) -> dict:
    from relayrl.run.loop import train

    with tempfile.TemporaryDirectory() as d:
        cfg = load_config(None, [f"run.output_dir={d}", f"run.steps={steps}", "run.progress=false",
                                 "data.eval_path=null", "run.save_every=0", *FIXED_GROUPS, *extra])
        train(cfg)
        rows = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    gen_tokens = sum(r["generated_tokens"] for r in rows)
    gen_time = sum(r["time/generate"] for r in rows)
    wall = sum(r["time/step"] for r in rows)
    return {"tokens": gen_tokens, "gen_seconds": gen_time, "wall_seconds": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:demo")
    ap.add_argument("--engine", default="hf", choices=["hf", "hf-cb"])
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--tokens", type=int, default=128, help="tokens per row in the peak measurement")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10, help="training steps for the achieved rate")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    model_path = resolve_model_path(args.model)

    rates = {b: peak(model_path, args.engine, b, args.tokens, args.repeats) for b in args.batches}
    ceiling_batch = max(rates, key=rates.get)
    ceiling = rates[ceiling_batch]
    run = achieved(args.steps, [f"model.path={model_path}", f"rollout.engine={args.engine}"])
    gen_rate = run["tokens"] / run["gen_seconds"]
    wall_rate = run["tokens"] / run["wall_seconds"]
    rows = [[f"peak, batch {b} × {args.tokens} tokens", f"{r:,.0f}", f"{r / ceiling:.2f}x"] for b, r in rates.items()]
    rows += [
        ["training: rollout tokens / generation time", f"{gen_rate:,.0f}", f"{gen_rate / ceiling:.2f}x"],
        ["training: rollout tokens / wall time", f"{wall_rate:,.0f}", f"{wall_rate / ceiling:.2f}x"],
    ]
    data = {"machine": machine_info(), "engine": args.engine, "model": args.model, "peak_tokens_per_s": rates,
            "ceiling": ceiling, "achieved": run, "achieved_gen_fraction": gen_rate / ceiling,
            "achieved_wall_fraction": wall_rate / ceiling}
    write_results(Path(args.out), "engine_peak", ["measurement", "tokens/s", "of ceiling"], rows, data)


if __name__ == "__main__":
    main()
