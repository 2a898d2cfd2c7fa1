"""Speculation's host time a decoding step, before and after: the Python bookkeeping of ``rollout.speculative``
(drafts looked up, the step's width, the verification's comparison and counts) by two versions of relayrl's code,
alternated in one run, with no model.

On a GPU this is what a verification step adds to the forward, on the host, where the GPU waits for it (one H200,
2026-11-28: at 256 rows it was as long as the demo model's step, 0.81x the rollout's speed). Each measurement is its
own process importing relayrl from one source tree (``--base``: another checkout's ``src``; ``--new``: this
one's). The workload: ``--rows`` rows, 8 to a prompt, whose prompts' earlier responses are history (an earlier
epoch); the policy is simulated: at each position a row draws that response's token with probability ``--keep``,
else a random one (a trained model's regular responses: 0.97), and its tokens go back as a verification's would.
Batch 1 warms up (history indexed), batch 2 (48 steps) is timed: milliseconds a step in ``Speculator.drafts`` and
in ``verify`` + ``accepted``; the drawing of the tokens is not timed (a GPU's).

    git worktree add /tmp/base HEAD~1
    python benchmarks/speculative_host.py --base /tmp/base/src
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_info, write_results  # noqa: E402

HERE = Path(__file__).resolve().parent
SOURCES = {"default": ("siblings", "history"), "all": ("siblings", "history", "prompt", "recent")}


def step_times(rows_n: int, sources, keep: float, steps: int = 48, group: int = 8, vocab: int = 1000) -> dict:
    import torch

    from relayrl.engine.speculative import Speculator, verify

    rng = random.Random(0)
    spec = Speculator(sources, batch_tokens=10**6)
    for _ in range(20):  # (a GPU-like forward: as long whatever its width, so the widest width is chosen)
        spec.timed(rows_n, 0.010)
        spec.timed(rows_n * 9, 0.0101)
    prompts = [[rng.randrange(vocab) for _ in range(60)] for _ in range(rows_n // group)]
    earlier = [[rng.randrange(vocab) for _ in range(steps * 10)] for _ in prompts]
    for p, r in zip(prompts, earlier):
        spec.store.finished(p, spec.store.index(p, r))
    times, emitted, forwards = {"drafts": 0.0, "verify": 0.0}, 0, 0
    for batch in range(2):
        rows = [(f"{batch}-{j}", prompts[j // group], j // group) for j in range(rows_n)]
        spec.batch([p for _, p, _ in rows])
        response: dict[str, list[int]] = {rid: [] for rid, _, _ in rows}
        draws = random.Random(batch)
        for _ in range(steps):
            t0 = time.perf_counter()
            drafts, srcs = spec.drafts([(rid, p, response[rid], 10**4) for rid, p, _ in rows])
            t1 = time.perf_counter()
            width = max(map(len, drafts)) + 1
            drawn = torch.tensor([[earlier[i][len(response[rid]) + j] if draws.random() < keep
                                   else draws.randrange(vocab) for j in range(width)] for rid, _, i in rows])
            scores = torch.zeros(rows_n, width, vocab)
            t2 = time.perf_counter()
            if width > 1:
                tokens, _, accepted = verify(scores, drafts, lambda s: drawn)
                spec.accepted([r[0] for r in rows], drafts, accepted, srcs)
            else:
                tokens = drawn[:, :1].tolist()
                spec.plain(tokens, None)
            t3 = time.perf_counter()
            if batch == 1:
                times["drafts"] += t1 - t0
                times["verify"] += t3 - t2
                emitted, forwards = emitted + sum(map(len, tokens)), forwards + rows_n
            for (rid, _, _), t in zip(rows, tokens):
                response[rid].extend(t)
    return {**{k: v / steps * 1e3 for k, v in times.items()}, "tokens_per_forward": emitted / forwards}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the other version's src directory")
    ap.add_argument("--new", default=str(HERE.parent / "src"), help="this version's src directory")
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--sources", nargs="+", choices=list(SOURCES), default=list(SOURCES))
    ap.add_argument("--keep", type=float, default=0.97, help="a row draws the earlier response's token with this "
                    "probability")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--name", default="speculative_host")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        rows, sources = a.child.split(":")
        return print(json.dumps(step_times(int(rows), SOURCES[sources], a.keep)))
    table = []
    for rows in a.rows:
        for sources in a.sources:
            runs: dict[str, list[dict]] = {"base": [], "new": []}
            for r in range(a.repeats):
                for side in ("base", "new") if r % 2 == 0 else ("new", "base"):
                    out = subprocess.run([sys.executable, __file__, "--base", a.base, "--keep", str(a.keep), "--child",
                                          f"{rows}:{sources}"], env={**os.environ, "PYTHONPATH": getattr(a, side)},
                                         check=True, capture_output=True, text=True).stdout
                    runs[side].append(json.loads(out.strip().splitlines()[-1]))
            med = {s: {k: statistics.median(x[k] for x in v) for k in v[0]} for s, v in runs.items()}
            host = {s: m["drafts"] + m["verify"] for s, m in med.items()}
            table.append([str(rows), "+".join(SOURCES[sources])] + [
                f"{med[s]['drafts']:.2f} + {med[s]['verify']:.2f} (tokens a forward {med[s]['tokens_per_forward']:.2f})"
                for s in ("base", "new")] + [f"{host['base'] / host['new']:.2f}x"])
            print(table[-1], flush=True)
    write_results(Path(a.out), a.name, ["rows", "sources", "base: ms a step, drafts + verify", "new: ms a step, "
                                        "drafts + verify", "base / new"], table,
                  {"machine": machine_info(), "keep": a.keep, "repeats": a.repeats, "base": a.base, "new": a.new})


if __name__ == "__main__":
    main()
