"""The algorithm suite on the two demos: each advantage estimator and policy loss, over seeds.

For each row (an estimator or a loss; everything else at its default) on the default demo and on the
agent demo (``examples/agent_demo.yaml``), ``relayrl train`` runs once per seed, one run after another,
and the table gives the held-out accuracy after training (sampled at the training temperature, and
greedy) as mean ± spread (population std) over the seeds, with the range; the time per step (median
over the run's steps); for the critic's estimators (gae, evpo) the critic's share of the step (its
values' forward and its update, ``time/critic`` / ``step_time``) and its state in memory (weights,
gradients and AdamW's two moments, fp32); and the peak RSS of the run's process (sync mode: the
engine runs in it). EVPO's per-step choice (``evpo/use_critic``) and explained variance (``evpo/ev``)
are plotted against the critic's EV under ``gae`` and the reward curves of both fixed baselines
(``gae``: always the critic; ``reinforce_pp``: always the batch mean, EVPO's other branch) in
``benchmarks/results/evpo.png``.

    python benchmarks/algorithms.py                      # everything (cached runs are reused)
    python benchmarks/algorithms.py --only gae evpo      # some rows
    python benchmarks/algorithms.py --demo agent --seeds 1
    python benchmarks/algorithms.py --async              # also each required row once with run.mode=async
    python benchmarks/algorithms.py --table              # rebuild the table and plot from the cache only

Runs are cached in ``benchmarks/results/algorithms_runs.json`` (keyed by demo, row, seed, steps and
mode), so an interrupted benchmark continues where it stopped. Every run uses ``run.threads=1``: on a
2-core machine shared with other work, two torch threads per matmul spin against each other (measured:
a tiny model's step 50× slower); it makes the rows' times comparable, not the machine's best.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import FIXED_GROUPS, machine_info, markdown_table  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CACHE = RESULTS / "algorithms_runs.json"
ROWS = {  # name -> overrides (everything else at its default: GRPO's group baseline, ppo_clip, decoupled)
    "grpo": [],
    "reinforce_pp": ["algo.advantage=reinforce_pp"],
    "reinforce_pp_baseline": ["algo.advantage=reinforce_pp_baseline"],
    "gae": ["algo.advantage=gae"],
    "evpo": ["algo.advantage=evpo"],
    # the losses differ only where π_θ ≠ π_old when the gradient is taken: with one update per batch of
    # on-policy data every ratio is 1 and ppo_clip, gspo (token_mean) and cispo give the same gradient
    # -A·∇log π (ONCE_ROWS shows it: the same run as grpo). So the losses are compared at two updates
    # per batch (the second mini-batch is trained one update away from π_old), GSPO with its paper's
    # aggregation (the mean over sequences) and its clip (3e-4/4e-4), CISPO with its (no floor, 0.28).
    "ppo_clip_2upd": ["trainer.updates_per_step=2"],
    "gspo_2upd": ["algo.loss=gspo", "algo.agg=seq_mean_token_mean", "trainer.updates_per_step=2"],
    "cispo_2upd": ["algo.loss=cispo", "trainer.updates_per_step=2"],
    "gspo": ["algo.loss=gspo"],
    "cispo": ["algo.loss=cispo"],
}
SEED_ROWS = ("grpo", "reinforce_pp", "reinforce_pp_baseline", "gae", "evpo", "ppo_clip_2upd", "gspo_2upd",
             "cispo_2upd")
ONCE_ROWS = ("gspo", "cispo")  # default demo, seed 0: at the defaults these are grpo's run (checked)
ASYNC_ROWS = ("gae", "evpo", "reinforce_pp", "gspo", "cispo")  # the "each with run.mode=async too"
# the agent demo's held-out set is evaluated on 100 of its prompts (its config says 200): agent episodes with
# tool calls cost several turns each, and its greedy accuracy moves from 0 to ~100%, far beyond that noise
DEMOS = {"default": FIXED_GROUPS, "agent": [str(ROOT / "examples" / "agent_demo.yaml"), "eval.size=100"]}
STEPS = {"default": 40, "agent": 15}
CURVES = ("reward_mean", "step_time", "time/critic", "critic/ev", "evpo/ev", "evpo/use_critic", "critic/loss",
          "clip_frac", "entropy")

# the run's peak RSS, reported by the child itself (RUSAGE_CHILDREN would be the largest of all runs so far)
CHILD = ("import json, resource, sys; from relayrl.cli import main; rc = main(sys.argv[1:]); "
         "print('PEAK_RSS_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(rc)")


def key(demo: str, row: str, seed: int, steps: int, mode: str) -> str:
    return f"{demo}/{row}/seed{seed}/steps{steps}/{mode}"


def run_one(demo: str, row: str, seed: int, steps: int, mode: str, out: Path) -> dict:
    args = [*DEMOS[demo], *ROWS[row], f"run.seed={seed}", f"run.steps={steps}", f"run.mode={mode}",
            f"run.output_dir={out}", f"run.name={demo}-{row}-{seed}-{mode}", "run.progress=false", "run.threads=1",
            "run.save_every=0"]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, "train", *args], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{demo}/{row} seed {seed} failed ({proc.returncode}): {proc.stderr[-3000:]}")
    run_dir = out / f"{demo}-{row}-{seed}-{mode}"
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rss = next(int(x.split()[1]) for x in proc.stdout.splitlines() if x.startswith("PEAK_RSS_KIB"))
    critic_params = None
    if row in ("gae", "evpo"):  # the critic's size: the policy's body and a scalar head
        import torch

        state = torch.load(run_dir / "checkpoints" / f"step_{steps:06d}" / "trainer.pt", weights_only=False)
        critic_params = sum(v.numel() for v in state["critic"]["weights"].values())
    return {"demo": demo, "row": row, "seed": seed, "steps": steps, "mode": mode,
            "seconds": round(time.perf_counter() - t0, 1), "peak_rss_mib": round(rss / 1024, 1),
            "critic_params": critic_params,
            **{k: summary.get(k) for k in ("eval_accuracy_before", "eval_accuracy_after", "eval_greedy_accuracy_before",
                                            "eval_greedy_accuracy_after", "eval_tool_call_rate_greedy_after",
                                            "wall_seconds")},
            "curves": {k: [m.get(k) for m in metrics] for k in CURVES}}


def pm(values: list[float], pct: bool = True) -> str:
    f = (lambda x: f"{x:.1%}") if pct else (lambda x: f"{x:.2f}")
    if len(values) == 1:
        return f(values[0])
    return f"{f(statistics.mean(values))} ± {f(statistics.pstdev(values))} ({f(min(values))}–{f(max(values))})"


def table(runs: dict, demos: list[str], seeds: int) -> tuple[list[str], list[list[str]]]:
    header = ["demo", "row", "seeds", "sampled before → after", "greedy before → after", "s/step (median)",
              "critic share of the step", "critic state (MiB)", "peak RSS MiB", "EVPO: steps on the critic"]
    rows = []
    for demo in demos:
        for row in SEED_ROWS:
            rs = [r for r in runs.values() if r["demo"] == demo and r["row"] == row and r["mode"] == "sync"
                  and r["steps"] == STEPS[demo] and r["seed"] < seeds]
            if not rs:
                continue
            before = statistics.mean(r["eval_accuracy_before"] for r in rs)
            gbefore = statistics.mean(r["eval_greedy_accuracy_before"] for r in rs)
            step_s = [statistics.median(r["curves"]["step_time"]) for r in rs]
            share = [sum(r["curves"]["time/critic"]) / sum(r["curves"]["step_time"]) for r in rs
                     if r["curves"]["time/critic"][0] is not None]
            params = rs[0]["critic_params"]
            use = [statistics.mean(r["curves"]["evpo/use_critic"]) for r in rs if row == "evpo"]
            rows.append([demo, row, str(len(rs)), f"{before:.1%} → {pm([r['eval_accuracy_after'] for r in rs])}",
                         f"{gbefore:.1%} → {pm([r['eval_greedy_accuracy_after'] for r in rs])}",
                         pm(step_s, pct=False), pm(share) if share else "—",
                         f"{params * 16 / 2**20:.1f}" if params else "—",
                         f"{statistics.mean(r['peak_rss_mib'] for r in rs):.0f}", pm(use) if use else "—"])
    return header, rows


def once_table(runs: dict) -> tuple[list[str], list[list[str]]]:
    """The losses at the defaults (one update per batch), seed 0, against grpo's run of the same seed."""
    header = ["row (default demo, seed 0)", "sampled before → after", "greedy before → after",
              "the same run as grpo's?"]
    rows = []
    ref = runs.get(key("default", "grpo", 0, STEPS["default"], "sync"))
    for row in ONCE_ROWS:
        r = runs.get(key("default", row, 0, STEPS["default"], "sync"))
        if r and ref:
            rewards = r["curves"]["reward_mean"] == ref["curves"]["reward_mean"]
            entropy = max(abs(x - y) for x, y in zip(r["curves"]["entropy"], ref["curves"]["entropy"]))
            rows.append([row, f"{r['eval_accuracy_before']:.1%} → {r['eval_accuracy_after']:.1%}",
                         f"{r['eval_greedy_accuracy_before']:.1%} → {r['eval_greedy_accuracy_after']:.1%}",
                         ("yes" if rewards else "no") + f": rewards {'equal' if rewards else 'differ'} at every step, "
                         + (f"entropy within {entropy:.1g} (float rounding)" if entropy else "entropy equal too")])
    return header, rows


def async_table(runs: dict) -> tuple[list[str], list[list[str]]]:
    header = ["row (run.mode=async, default demo)", "seed", "sampled before → after", "greedy before → after",
              "s/step (median)", "wall s"]
    rows = []
    for row in ASYNC_ROWS:
        for r in (r for r in runs.values() if r["row"] == row and r["mode"] == "async" and r["demo"] == "default"):
            rows.append([row, str(r["seed"]), f"{r['eval_accuracy_before']:.1%} → {r['eval_accuracy_after']:.1%}",
                         f"{r['eval_greedy_accuracy_before']:.1%} → {r['eval_greedy_accuracy_after']:.1%}",
                         f"{statistics.median(r['curves']['step_time']):.2f}", f"{r['wall_seconds']:.0f}"])
    return header, rows


def plot_evpo(runs: dict, demos: list[str], path: Path) -> None:
    """Per step: EVPO's EV and the critic's EV under gae; EVPO's choice; the reward of evpo, gae and the
    batch-mean baseline (reinforce_pp), each seed a thin line and the mean a thick one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, len(demos), figsize=(5.5 * len(demos), 8), squeeze=False, sharex="col")
    colours = {"evpo": "tab:purple", "gae": "tab:green", "reinforce_pp": "tab:orange"}
    for c, demo in enumerate(demos):
        def series(row, curve):
            return [r["curves"][curve] for r in runs.values()
                    if r["demo"] == demo and r["row"] == row and r["mode"] == "sync" and r["steps"] == STEPS[demo]]

        def draw(ax, row, curve, label):
            ys = [y for y in series(row, curve) if y and y[0] is not None]
            for y in ys:
                ax.plot(range(1, len(y) + 1), y, color=colours[row], alpha=0.3, lw=0.8)
            if ys:
                n = min(map(len, ys))
                ax.plot(range(1, n + 1), [statistics.mean(y[i] for y in ys) for i in range(n)], color=colours[row],
                        lw=2, label=f"{label} (mean of {len(ys)})")

        draw(axes[0][c], "evpo", "evpo/ev", "evpo: EV of its critic")
        draw(axes[0][c], "gae", "critic/ev", "gae: EV of its critic")
        axes[0][c].axhline(0, color="k", lw=0.8, ls=":")
        axes[0][c].set_ylabel("explained variance")
        axes[0][c].set_title(f"{demo} demo")
        draw(axes[1][c], "evpo", "evpo/use_critic", "evpo: 1 = critic, 0 = batch mean")
        axes[1][c].set_ylabel("EVPO's choice")
        axes[1][c].set_ylim(-0.05, 1.05)
        for row, label in (("evpo", "evpo"), ("gae", "gae (always the critic)"),
                           ("reinforce_pp", "reinforce_pp (always the batch mean)")):
            draw(axes[2][c], row, "reward_mean", label)
        axes[2][c].set_ylabel("training reward")
        axes[2][c].set_xlabel("step")
        for ax in axes[:, c]:
            ax.legend(fontsize=7, loc="best")
            ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--demo", choices=["default", "agent", "both"], default="both")
    p.add_argument("--only", nargs="+", choices=list(ROWS), help="these rows only")
    p.add_argument("--async", dest="async_", action="store_true", help="also the async rows, seed 0")
    p.add_argument("--table", action="store_true", help="no runs: the table and plot from the cache")
    a = p.parse_args()
    demos = ["default", "agent"] if a.demo == "both" else [a.demo]
    runs = json.loads(CACHE.read_text()) if CACHE.exists() else {}
    # seed by seed (every row of seed 0 on both demos first, then the async rows), so an interrupted run
    # has every row at fewer seeds rather than some rows at all seeds
    plan = []
    for s in range(a.seeds):
        for d in demos:
            plan += [(d, row, s, "sync") for row in (a.only or SEED_ROWS)]
            if s == 0 and d == "default":  # the losses at the defaults, and the async runs
                plan += [("default", row, 0, "sync") for row in ONCE_ROWS if not a.only or row in a.only]
                plan += [("default", row, 0, "async") for row in ASYNC_ROWS
                         if a.async_ and (not a.only or row in a.only)]
    with tempfile.TemporaryDirectory() as tmp:
        for demo, row, seed, mode in ([] if a.table else plan):
            k = key(demo, row, seed, STEPS[demo], mode)
            if k in runs:
                continue
            runs[k] = run_one(demo, row, seed, STEPS[demo], mode, Path(tmp))
            r = runs[k]
            print(f"{k}: {r['eval_accuracy_before']:.1%} → {r['eval_accuracy_after']:.1%} (greedy "
                  f"{r['eval_greedy_accuracy_before']:.1%} → {r['eval_greedy_accuracy_after']:.1%}), "
                  f"{r['seconds']} s", flush=True)
            CACHE.write_text(json.dumps(runs, indent=1))
    header, rows = table(runs, demos, a.seeds)
    aheader, arows = async_table(runs)
    oheader, orows = once_table(runs)
    m = machine_info()
    note = (f"Machine: {m['cpu']}, {m['cores']} cores (shared with other work while this ran), torch {m['torch']}, "
            f"{m['date']}. Default demo {STEPS['default']} steps, agent demo {STEPS['agent']} steps, run.threads=1.")
    text = markdown_table(header, rows) + "".join(f"\n\n{markdown_table(h, r)}" for h, r in
                                                  ((oheader, orows), (aheader, arows)) if r) + f"\n\n{note}\n"
    (RESULTS / "algorithms.md").write_text(text)
    (RESULTS / "algorithms.json").write_text(json.dumps({"machine": m, "steps": STEPS, "rows": ROWS,
                                                         "table": {"header": header, "rows": rows},
                                                         "once": {"header": oheader, "rows": orows},
                                                         "async": {"header": aheader, "rows": arows}}, indent=1))
    if any(r["row"] == "evpo" for r in runs.values()):
        plot_evpo(runs, [d for d in demos if any(r["demo"] == d and r["row"] == "evpo" for r in runs.values())],
                  RESULTS / "evpo.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
