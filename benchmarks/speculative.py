"""Exact speculative rollouts (``rollout.speculative``): what the drafts buy, side by side in one run.

1. **Rollout tokens/s** of the ``hf`` engine (relayrl's decoding forward) over a set of ``--prompts`` prompts of
   the demo task × ``--group`` samples, generated ``--epochs`` times (the same prompts each epoch, as a
   GSM8K-sized set trained for several epochs), without speculation and with each draft source alone and all
   together; one engine per setting (warmed up on other prompts), kept across epochs (its history), settings
   interleaved epoch by epoch.
   Epoch 1 has no history; the later ones report the rate with it. For ``builtin:demo`` at its start and for
   ``--trained`` (a checkpoint after RL, where responses are regular; default: ``runs/demo`` when it exists),
   at several batch sizes: a verification forward of many rows costs about what its tokens cost on a CPU, of
   few rows (an agent's turns, a rollout's long tail) about what one token does.
2. **The verification forward at Qwen2.5-0.5B's shape** (random weights; ``--verify-model builtin:demo``: the demo
   model): one forward over k + 1 tokens against k + 1 one-token decoding forwards, per batch size, after a
   ``--context`` of 64 tokens: the number that decides the gain on real models (a draft of k accepted whole costs
   the first, plain decoding the second).
3. **Training for several epochs**: ``relayrl train`` over ``--train-prompts`` prompts (128: 16 steps an epoch)
   for ``--train-epochs`` epochs, without speculation, with it (its default sources: siblings and history) and
   with the lead as well (``rollout.speculative_lead``, Seer's divided rollout), ``--seeds`` seeds interleaved:
   per epoch the rollout's seconds and tokens/s, the drafts made and kept (from history), tokens per forward.
   Part 1's ``siblings + lead`` and ``all + lead`` settings count the lead's time in the rollout's; ``recent`` (every
   prompt's last responses) drafts in epoch 1 too, from the warm-up prompts' responses.
4. **Across a resume** (``--parts resume``, not in the default parts): the second epoch of part 3's run with
   speculation, uninterrupted and resumed after the first, with its rollout records (history rebuilt from them)
   and without.

    python benchmarks/speculative.py                   # ~50 min on 2 quiet cores (part 3: ~35)
    python benchmarks/speculative.py --scale tiny      # check the script
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_info, results_dir, write_results  # noqa: E402
from trainer_scale import QWEN25_05B, SMALL  # noqa: E402

ALL = ["siblings", "history", "prompt"]
# (name, sources, rollout.speculative_lead)
SETTINGS = [("off", None, False), ("prompt", ["prompt"], False), ("history", ["history"], False),
            ("siblings", ["siblings"], False), ("siblings + lead", ["siblings"], True), ("all", ALL, False),
            ("all + lead", ALL, True), ("recent", ["recent"], False), ("all + recent", ALL + ["recent"], False),
            ("siblings + history", ["siblings", "history"], False)]  # (the last: rollout.speculative_sources' default)
EVERY = ", every draft"
# part 3: relayrl train without and with speculation (its default sources), and with the lead
TRAINING = [("off", []), ("on", ["rollout.speculative=on"]),
            ("on + lead", ["rollout.speculative=on", "rollout.speculative_lead=true"])]


def requests(tok, prompts, group: int, epoch: int, budget: int):
    from relayrl.models.prompts import encode_prompt
    from relayrl.records import GenRequest, SamplingParams

    return [GenRequest(f"e{epoch}.{i}.{j}", encode_prompt(tok, p.messages), SamplingParams(budget))
            for i, p in enumerate(prompts) for j in range(group)]


def rollout_rates(path: str, n_prompts: int, a) -> list[list[str]]:
    from relayrl.data.datasets import load_prompts
    from relayrl.engine.hf import HFEngine
    from relayrl.engine.speculative import Speculator, metrics
    from relayrl.models import load_policy, load_tokenizer, resolve_model_path

    path = resolve_model_path(path)
    tok, model = load_tokenizer(path), load_policy(path).eval().to(a.device)
    # --fresh: new prompts every epoch (the default demo's rollouts: no prompt repeats), else the same ones
    pool = load_prompts("builtin:demo", limit=n_prompts * (a.epochs + 2))
    # "NAME, every draft": NAME with every draft verified whole (the step's width not chosen: ``Widths``)
    known = {name: (src, lead) for name, src, lead in SETTINGS}
    settings = [(n, *known[n.removesuffix(EVERY)], n.endswith(EVERY)) for n in a.settings]
    engines = {name: HFEngine(model, tok, fast_decode=True, max_batch=256, speculator=Speculator(
                   src, a.max_draft, a.batch_tokens, lead=lead, choose=not every) if src else None)
               for name, src, lead, every in settings}
    warm = pool[n_prompts:2 * n_prompts]  # (other prompts: history stays empty)
    for eng in engines.values():
        eng.generate(requests(tok, warm, a.group, -1, a.max_new_tokens))
        eng.take_spec()
    rates = {name: [] for name, *_ in settings}
    counts = {name: {} for name, *_ in settings}
    try:
        for epoch in range(a.epochs):
            for name, eng in engines.items():
                torch.manual_seed(epoch)
                prompts = pool[(epoch + 2) * n_prompts:(epoch + 3) * n_prompts] if a.fresh else pool[:n_prompts]
                reqs = requests(tok, prompts, a.group, epoch, a.max_new_tokens)
                t0 = time.perf_counter()
                out = eng.generate(reqs)  # (its lists come back from the device: the clock waits for the GPU)
                rates[name].append(sum(len(c.token_ids) for c in out) / (time.perf_counter() - t0))
                counts[name] = eng.take_spec()
                print(f"  {path}, {len(reqs)} rows: epoch {epoch + 1} {name}: {rates[name][-1]:.0f} tokens/s", flush=True)
    finally:
        for eng in engines.values():
            eng.close()
    rows = []
    for name, *_ in settings:
        first, later = rates[name][0], statistics.median(rates[name][1:]) if a.epochs > 1 else float("nan")
        m = metrics(counts[name]) if counts[name] else {}
        accepted = f"{m['spec/accepted'] / max(1.0, m['spec/drafted']):.0%}" if m.get("spec/drafted") else "-"
        rows.append([a.label, str(n_prompts * a.group), name, f"{first:.0f}", f"{first / rates['off'][0]:.2f}x",
                     f"{later:.0f}", f"{later / statistics.median(rates['off'][1:]):.2f}x" if a.epochs > 1 else "-",
                     f"{m.get('spec/tokens_per_forward', 1.0):.2f}", accepted])
    return rows


def train_data(a) -> tuple[Path, Path]:
    """Parts 3 and 4's folder (``--train-dir`` or a new one) and their prompts, the demo task's first
    ``--train-prompts``."""
    import json
    import tempfile

    from relayrl.data.datasets import load_prompts

    tmp = Path(a.train_dir or tempfile.mkdtemp(prefix="relayrl-speculative-"))
    tmp.mkdir(parents=True, exist_ok=True)
    data = tmp / "prompts.jsonl"
    with data.open("w") as f:
        for p in load_prompts("builtin:demo", limit=a.train_prompts):
            f.write(json.dumps({"id": p.id, "prompt": p.messages, "answer": p.answer, **p.metadata}) + "\n")
    return tmp, data


def resumed_epoch(a) -> list[list[str]]:
    """Part 4: a run of two epochs over ``--train-prompts`` prompts with speculation (its default sources), and the
    same run stopped after its first epoch and resumed, with its rollout records (history rebuilt from them) and
    without (its rollouts folder removed: history empty); per setting, over ``--seeds`` seeds, the second epoch's
    drafts from history and tokens per forward."""
    import json
    import subprocess

    tmp, data = train_data(a)
    per_epoch = a.train_prompts // 8
    results: dict[str, list[list[dict]]] = {"uninterrupted": [], "resumed with its records": [],
                                            "resumed without records": []}

    def train(out: Path, steps: int, *extra: str) -> None:
        cmd = [sys.executable, "-m", "relayrl.cli", "train", f"data.path={data}", "rollout.prompts_per_step=8",
               f"run.steps={steps}", f"run.save_every={per_epoch}", f"run.output_dir={out}", "run.name=r",
               "run.progress=false", "rollout.speculative=on", "data.eval_path=null", *extra]
        subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=tmp)

    for seed in range(a.seeds):
        whole, cut, bare = (tmp / f"resume-{name}-{seed}" for name in ("whole", "cut", "bare"))
        for d in (whole, cut, bare):
            shutil.rmtree(d, ignore_errors=True)
        train(whole, 2 * per_epoch, f"run.seed={seed}")
        train(cut, per_epoch, f"run.seed={seed}")
        shutil.copytree(cut, bare)
        shutil.rmtree(bare / "r" / "rollouts")
        for d in (cut, bare):
            train(d, 2 * per_epoch, f"run.seed={seed}", "--resume")
        for name, d in zip(results, (whole, cut, bare)):
            steps = [json.loads(x) for x in (d / "r" / "metrics.jsonl").read_text().splitlines()]
            results[name].append([m for m in steps if m["step"] > per_epoch])
        print(f"  resume, seed {seed}: done", flush=True)
    rows = []
    for name, runs in results.items():
        total = lambda key: sum(m.get(key, 0.0) for ms in runs for m in ms)  # noqa: E731
        rate = statistics.median(sum(m["generated_tokens"] for m in ms) / sum(m["time/generate"] for m in ms)
                                 for ms in runs)
        kept = f"{total('spec/accepted_history') / total('spec/drafted_history'):.0%}" if total(
            "spec/drafted_history") else "-"
        first = statistics.mean(ms[0].get("spec/tokens_per_forward", 1.0) for ms in runs)
        rows.append([name, f"{total('spec/drafted_history') / len(runs):.0f}", kept, f"{first:.2f}",
                     f"{statistics.mean(m.get('spec/tokens_per_forward', 1.0) for ms in runs for m in ms):.2f}",
                     f"{rate:.0f}"])
    return rows


def training_epochs(a) -> list[list[str]]:
    """Part 3: ``relayrl train`` over ``--train-prompts`` prompts of the demo task for ``--train-epochs`` epochs
    (8 prompts a step), without speculation, with it and with its lead, the same ``--seeds``; per setting and
    epoch, over the seeds: the rollout's seconds (``time/generate`` summed over the epoch's steps), draft tokens
    made and kept (and from history), tokens per forward; and the held-out accuracy after."""
    import json
    import subprocess

    tmp, data = train_data(a)
    per_epoch = a.train_prompts // 8
    print(f"  training runs in {tmp}", flush=True)
    runs: dict[str, list[tuple[list[dict], dict]]] = {name: [] for name, _ in TRAINING}
    for seed in range(a.seeds):
        for name, overrides in TRAINING:  # (interleaved: the machine's drift falls on every setting)
            out = tmp / f"{name.replace(' ', '')}-{seed}"
            if not list(out.glob("*/summary.json")):  # (--train-dir: the runs already there are kept)
                cmd = [sys.executable, "-m", "relayrl.cli", "train", f"data.path={data}", "rollout.prompts_per_step=8",
                       f"run.steps={per_epoch * a.train_epochs}", f"run.seed={seed}", f"run.output_dir={out}",
                       "run.progress=false", *overrides]
                shutil.rmtree(out, ignore_errors=True)
                subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=tmp)
            run = next(out.iterdir())
            steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            runs[name].append((steps, json.loads((run / "summary.json").read_text())))
            print(f"  train {name}, seed {seed}: {sum(m['time/generate'] for m in steps):.1f} s of rollout, "
                  f"held-out {runs[name][-1][1]['eval_accuracy_after']:.1%}", flush=True)
    rows = []
    for e in range(a.train_epochs):
        off = None
        for name, _ in TRAINING:
            epoch = [[m for m in steps if e * per_epoch < m["step"] <= (e + 1) * per_epoch] for steps, _ in runs[name]]
            secs = statistics.median(sum(m["time/generate"] for m in ms) for ms in epoch)
            # (the runs' samples part where a verification forward's rounding moves a draw: tokens/s compares them)
            rate = statistics.median(sum(m["generated_tokens"] for m in ms) / sum(m["time/generate"] for m in ms)
                                     for ms in epoch)
            off = off or rate
            total = lambda key: sum(m.get(key, 0.0) for ms in epoch for m in ms)  # noqa: E731
            kept = f"{total('spec/accepted') / total('spec/drafted'):.0%}" if total("spec/drafted") else "-"
            history = (f"{total('spec/accepted_history') / total('spec/drafted_history'):.0%}"
                       if total("spec/drafted_history") else "-")
            tpf = statistics.mean(m.get("spec/tokens_per_forward", 1.0) for ms in epoch for m in ms)
            rows.append([str(e + 1), name, f"{secs:.1f}", f"{rate:.0f}", f"{rate / off:.2f}x",
                         f"{total('spec/drafted') / len(epoch):.0f}", kept, history, f"{tpf:.2f}", ""])
    for name, _ in TRAINING:
        acc = [s["eval_accuracy_after"] for _, s in runs[name]]
        wall = statistics.median(s["wall_seconds"] for _, s in runs[name])
        rows.append(["all", name, f"{statistics.median(sum(m['time/generate'] for m in st) for st, _ in runs[name]):.1f}",
                     "", "", "", "", "", "", f"{', '.join(f'{x:.1%}' for x in acc)} (wall {wall:.0f} s)"])
    return rows


def verify_cost(a) -> list[list[str]]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from relayrl.engine.fast_decode import FastDecoder

    torch.manual_seed(0)
    if a.verify_model:  # (a checkpoint: the demo model's 4 heads take the matrix-product attention, no grouped heads)
        from relayrl.models import load_policy, resolve_model_path

        model = load_policy(resolve_model_path(a.verify_model)).eval().to(a.device, getattr(torch, a.dtype))
        vocab = model.config.vocab_size
    else:
        shape = SMALL if a.scale == "tiny" else QWEN25_05B
        model = Qwen2ForCausalLM(Qwen2Config(**shape)).eval().to(a.device, getattr(torch, a.dtype))
        vocab = shape["vocab_size"]
    dec = FastDecoder(model)
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    rows = []
    for b in a.batches:
        ids = torch.randint(10, vocab, (b, a.context), device=a.device)
        att, pos = torch.ones_like(ids), torch.arange(a.context, device=a.device).expand(b, a.context)
        for k in a.draft_lengths:
            plain, spec = [], []
            for _ in range(a.repeats + 1):  # (the first: warm-up)
                n = a.context
                _, cache = dec.prefill(ids, att, pos, n + 2 * (k + 1))
                sync()
                t0 = time.perf_counter()
                for j in range(k + 1):
                    dec.decode(ids[:, j], torch.full((b,), n + j, device=a.device), cache)
                sync()
                plain.append(time.perf_counter() - t0)
                _, cache = dec.prefill(ids, att, pos, n + 2 * (k + 1))
                sync()
                t0 = time.perf_counter()
                dec.verify(ids[:, : k + 1], n + torch.arange(k + 1, device=a.device).expand(b, k + 1), cache)
                sync()
                spec.append(time.perf_counter() - t0)
            p, s = statistics.median(plain[1:]), statistics.median(spec[1:])
            rows.append([str(b), str(k), f"{p * 1e3:.1f}", f"{s * 1e3:.1f}", f"{p / s:.2f}x"])
            print(f"  verify: batch {b}, k {k}: {k + 1} decodes {p * 1e3:.1f} ms, one verify {s * 1e3:.1f} ms",
                  flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", choices=["full", "tiny"], default="full")
    ap.add_argument("--trained", default="runs/demo", help="a checkpoint after RL (skipped if missing)")
    ap.add_argument("--prompts", type=int, nargs="+", default=[1, 4, 32], help="prompts per batch (× --group rows)")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--fresh", action="store_true", help="part 1: new prompts every epoch (none repeats, as in the "
                    "default demo), not the same ones")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-draft", type=int, default=8)
    ap.add_argument("--batch-tokens", type=int, default=64, help="rollout.speculative_batch_tokens")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--context", type=int, default=64, help="tokens in the cache before the measured forwards")
    ap.add_argument("--draft-lengths", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--verify-model", help="part 2's model (e.g. builtin:demo; default: Qwen2.5-0.5B's shape, "
                    "random weights)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--settings", nargs="+", default=[s[0] for s in SETTINGS], help="part 1's settings (a name with "
                    "', every draft' after it: every draft verified whole, the step's width not chosen)")
    ap.add_argument("--train-prompts", type=int, default=128)
    ap.add_argument("--train-epochs", type=int, default=5)
    ap.add_argument("--seeds", type=int, default=3, help="part 3's seeds")
    ap.add_argument("--train-dir", help="part 3's folder (default: a new one); runs already in it are kept")
    ap.add_argument("--parts", nargs="+", choices=["rollout", "verify", "train", "resume"],
                    default=["rollout", "verify", "train"])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="parts 1 and 2 (part 3: the CPU)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="part 2's model")
    ap.add_argument("--name", default="speculative", help="the results' file names: NAME_rollout, NAME_verify, ...")
    ap.add_argument("--out", help="the results' folder (default: benchmarks/results; --scale tiny: a temporary one)")
    a = ap.parse_args()
    out = results_dir(a.out, check=a.scale == "tiny")
    if a.scale == "tiny":
        a.prompts, a.group, a.epochs, a.batches, a.draft_lengths, a.repeats = [1, 4], 4, 2, [2], [4], 2
        a.train_prompts, a.train_epochs, a.seeds = 16, 2, 1
    torch.set_num_threads(torch.get_num_threads())
    models = ["builtin:demo"] + ([a.trained] if a.trained and Path(a.trained).exists() else [])
    if "rollout" in a.parts:
        rows = []
        for m in models:
            a.label = "builtin:demo" if m == "builtin:demo" else f"{m} (after RL)"
            rows += [r for n in a.prompts for r in rollout_rates(m, n, a)]
        write_results(out, f"{a.name}_rollout",
                      ["model", "rows", "drafts", "epoch 1 tokens/s", "vs off", "later epochs tokens/s", "vs off",
                       "tokens per forward", "draft tokens accepted"], rows,
                      {"machine": machine_info(), "args": vars(a)})
    if "train" in a.parts:
        write_results(out, f"{a.name}_training",
                      ["epoch", "speculation", "rollout s (median over seeds)", "rollout tokens/s", "vs off",
                       "draft tokens a seed",
                       "kept", "kept from history", "tokens per forward", "held-out after (per seed)"],
                      training_epochs(a), {"machine": machine_info(), "args": vars(a)})
    if "resume" in a.parts:
        write_results(out, f"{a.name}_resume",
                      ["epoch 2 of a run", "draft tokens from history a seed", "kept", "tokens per forward, its "
                       "first step", "tokens per forward", "rollout tokens/s (median over seeds)"],
                      resumed_epoch(a), {"machine": machine_info(), "args": vars(a)})
    if "verify" in a.parts:
        write_results(out, f"{a.name}_verify",
                      ["batch", "k", "k+1 decoding forwards (ms)", "one verification forward (ms)", "ratio"],
                      verify_cost(a), {"machine": machine_info(), "args": vars(a)})


if __name__ == "__main__":
    main()
