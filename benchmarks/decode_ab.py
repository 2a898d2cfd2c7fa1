"""Before and after: the hf engine's decoding of the demo workload by two versions of relayrl's code,
alternated in one run.

Each measurement is its own process importing relayrl from one source tree (``--base``: another
checkout's ``src``, e.g. ``git worktree add /tmp/base HEAD~1``; ``--new``: this one's): the demo
model decodes 12 batches of 8 prompts × 8 samples (T=1, 128 new tokens, relayrl's decoding forward,
``torch.manual_seed(0)``), the first 2 as warm-up; tokens/s over the other 10. The versions alternate
``--repeats`` times; the ratio is the new median over the base median. ``--speculative recent`` (draft sources,
comma-separated) decodes with ``rollout.speculative`` on, ``--batch-tokens`` its verification budget.

    git worktree add /tmp/base HEAD~1
    python benchmarks/decode_ab.py --base /tmp/base/src
    python benchmarks/decode_ab.py --base /tmp/base/src --speculative recent --batch-tokens 128
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_info, write_results  # noqa: E402

HERE = Path(__file__).resolve().parent


def child(a) -> None:
    import time

    import torch

    from relayrl.data.datasets import load_prompts
    from relayrl.engine.hf import HFEngine
    from relayrl.engine.speculative import Speculator
    from relayrl.models import load_policy, load_tokenizer, resolve_model_path
    from relayrl.records import GenRequest, SamplingParams

    torch.set_num_threads(2)
    path = resolve_model_path("builtin:demo", log=lambda *_: None)
    tok, model = load_tokenizer(path), load_policy(path)
    spec = Speculator(a.speculative.split(","), batch_tokens=a.batch_tokens) if a.speculative else None
    eng = HFEngine(model, tok, fast_decode=True, speculator=spec)
    prompts = load_prompts("builtin:demo", limit=96)
    ids = [tok.apply_chat_template(p.messages, add_generation_prompt=True)["input_ids"] for p in prompts]
    torch.manual_seed(0)
    seconds, tokens = 0.0, 0
    for b in range(12):
        reqs = [GenRequest(f"{b}-{i}-{j}", list(ids[b * 8 + i]), SamplingParams(128, 1.0)) for i in range(8)
                for j in range(8)]
        start = time.perf_counter()
        out = eng.generate(reqs)
        if b >= 2:
            seconds += time.perf_counter() - start
            tokens += sum(len(c.token_ids) for c in out)
    eng.close()
    counts = eng.take_spec()
    print(json.dumps({"tokens_per_s": tokens / seconds, "ms_per_batch": seconds / 10 * 1e3,
                      "tokens_per_forward": counts["emitted"] / counts["row_forwards"] if counts else 1.0}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the other version's src directory")
    ap.add_argument("--new", default=str(HERE.parent / "src"), help="this version's src directory")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--speculative", default="", help="draft sources, comma-separated (default: no speculation)")
    ap.add_argument("--batch-tokens", type=int, default=64, help="rollout.speculative_batch_tokens")
    ap.add_argument("--name", default="decode_ab")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a)
    runs: dict[str, list[dict]] = {"base": [], "new": []}
    for r in range(a.repeats):
        for side in ("base", "new") if r % 2 == 0 else ("new", "base"):
            env = {**os.environ, "PYTHONPATH": getattr(a, side)}
            args = ["--child", "--base", a.base, "--speculative", a.speculative, "--batch-tokens", str(a.batch_tokens)]
            out = subprocess.run([sys.executable, __file__, *args], env=env, check=True,
                                 capture_output=True, text=True).stdout
            runs[side].append(json.loads(out.strip().splitlines()[-1]))
            print(side, runs[side][-1], flush=True)
    med = {s: statistics.median(x["tokens_per_s"] for x in v) for s, v in runs.items()}
    rows = [[s, getattr(a, s), f"{med[s]:,.0f}", ", ".join(f"{x['tokens_per_s']:,.0f}" for x in runs[s]),
             f"{med[s] / med['base']:.2f}x"] for s in ("base", "new")]
    write_results(Path(a.out), a.name, ["version", "src", "tokens/s (median)", "per repeat", "vs base"], rows,
                  {"machine": machine_info(), "runs": runs, "speculative": a.speculative or None,
                   "batch_tokens": a.batch_tokens})


if __name__ == "__main__":
    main()
