"""Learning curves: ``curves.png`` of one run, and one picture comparing several (``relayrl plot``).

Both read what a run writes, ``metrics.jsonl`` (one line per step) and ``summary.json`` (held-out
accuracy before and after training), so a picture can be drawn of a run that is still going, or
of runs made long ago. Six panels: reward, held-out accuracy, response length, staleness, engine
and trainer idle time, throughput (a supervised run's: loss, held-out accuracy, epoch, learning rate,
gradient norm, throughput); over training steps, or over wall-clock time (``x="time"``:
how the modes compare, since an overlapped run does more steps per minute).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


class PlotError(ValueError):
    """A run folder without the files a picture is drawn from."""


@dataclass
class RunData:
    name: str
    records: list[dict]  # metrics.jsonl, in step order
    summary: dict = field(default_factory=dict)  # summary.json (empty while the run goes)
    eval_before: dict | None = None  # held-out evaluation before training (summary.json's, or the live run's)

    def series(self, key: str, x: str) -> tuple[list[float], list[float]]:
        """(x values, values) over the steps that have ``key``."""
        pts = [(_x(r, x), r[key]) for r in self.records if isinstance(r.get(key), (int, float))]
        return [p[0] for p in pts], [p[1] for p in pts]

    def accuracy(self, key: str, x: str) -> tuple[list[float], list[float], tuple[float, float] | None]:
        """Held-out accuracy in %: before training (at 0) and at each evaluation during it; and the
        evaluation after it (summary.json), a point of its own: when the last step was evaluated
        during training too, the two are separate samples of the same policy."""
        xs, ys = self.series(f"eval/{key}", x)
        before, after = self.eval_before or self.summary.get("eval_before"), self.summary.get("eval_after")
        if before and key in before:
            xs, ys = [0.0, *xs], [before[key], *ys]
        last = (_x(self.records[-1], x), 100 * after[key]) if after and key in after and self.records else None
        return xs, [100 * y for y in ys], last


def _x(record: dict, x: str) -> float:
    return record["step"] if x == "step" else record.get("wall_seconds", 0.0) / 60


def read_run(run_dir: str | Path) -> RunData:
    """A run folder's metrics.jsonl and summary.json (PlotError naming what is missing)."""
    d = Path(run_dir)
    path = d / "metrics.jsonl"
    if not path.is_file():
        what = "no such folder" if not d.is_dir() else "no metrics.jsonl in it"
        raise PlotError(f"{d}: not a run folder ({what}); a run folder is <run.output_dir>/<run.name>, e.g. runs/demo")
    records = []
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue  # (a line a kill cut short)
        if isinstance(r, dict) and "step" in r:
            records.append(r)
    summary = {}
    if (d / "summary.json").is_file():
        summary = json.loads((d / "summary.json").read_text())
    return RunData(d.name, sorted(records, key=lambda r: r["step"]), summary)


def _smooth(ys: list[float], n: int) -> list[float]:
    """Trailing moving average over ``n`` points (as many as there are at the start)."""
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y - (ys[i - n] if i >= n else 0.0)
        out.append(acc / min(i + 1, n))
    return out


# (title, y label, [(metric key, line label, line style)]), in panel order
PANELS = [
    ("Response length", "tokens", [("response_len_mean", "mean", "-"), ("response_len_max", "longest", ":")]),
    ("Staleness of the trained groups", "policy versions behind", [("staleness_mean", "mean", "-"),
                                                                  ("staleness_max", "most", ":")]),
    ("Idle time", "% of the step's wall time", [("engine_idle_frac", "engine (generation)", "-"),
                                                ("trainer_idle_frac", "trainer", "--")]),
    ("Generation throughput", "generated tokens / s", [("tokens_per_s", "tokens/s over the step", "-")]),
]


# a supervised run's (relayrl sft: no rollout) in place of PANELS
SFT_PANELS = [
    ("Epoch", "passes over the data", [("epoch", "epoch", "-")]),
    ("Learning rate", "lr", [("lr", "lr", "-")]),
    ("Gradient norm", "before clipping", [("grad_norm", "norm", "-")]),
    ("Training throughput", "tokens / s (every token of the rows)", [("tokens_per_s", "tokens/s over the step", "-")]),
]


def supervised(runs: list[RunData]) -> bool:
    """Runs of ``relayrl sft``: their metrics have a loss and no reward."""
    return all(not any("reward_mean" in r for r in run.records) and any("loss" in r for r in run.records)
               for run in runs)


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "h")


def _marker(i: int, n: int) -> tuple[str, float]:
    """Run ``i`` of ``n``'s accuracy marker and its size. Runs from one base model share their
    accuracy before training, one point at step 0: each run has its own shape, and each is drawn
    smaller than the one before (on top of it), so every run's marker shows around the next one."""
    return ("o", 5.0) if n == 1 else (MARKERS[i % len(MARKERS)], 10.0 - 5.0 * i / (n - 1))


def curves_figure(runs: list[RunData], x: str = "step", title: str = ""):
    """The figure (matplotlib's object API: no global state, safe beside a running program)."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(16, 9), dpi=100, layout="constrained")
    axes = fig.subplots(2, 3).flatten()
    colors = [f"C{i % 10}" for i in range(len(runs))]
    one = len(runs) == 1
    xlabel = "training step" if x == "step" else "wall-clock time (minutes)"

    sft = supervised(runs)
    ax = axes[0]  # reward (sft: loss): every step faint, a moving average over a twentieth of the run bold
    n = max(1, max(len(r.records) for r in runs) // 20)
    for run, c in zip(runs, colors):
        xs, ys = run.series("loss" if sft else "reward_mean", x)
        if n > 1:
            ax.plot(xs, ys, color=c, alpha=0.3, lw=1, label="each step" if one else None)
        ax.plot(xs, _smooth(ys, n), color=c, lw=2.2,
                label=run.name if not one else f"moving average over {n} steps" if n > 1 else "each step")
    ax.set(title="Training loss" if sft else "Training reward",
           ylabel="negative log-likelihood per supervised token" if sft else "mean reward of the sampled responses")
    if not one and n > 1:
        ax.legend(handles=[*ax.get_legend_handles_labels()[0],
                           Line2D([], [], color="gray", alpha=0.4, lw=1, label="each step"),
                           Line2D([], [], color="gray", lw=2.2, label=f"moving average over {n} steps")], fontsize=9)

    ax = axes[1]
    shown = False
    for i, (run, c) in enumerate(zip(runs, colors)):
        marker, ms = _marker(i, len(runs))
        star = 14.0 if one else 1.4 * ms  # (runs ending alike: nested stars, the same way)
        for k, (key, label, ls) in enumerate((("accuracy", "sampled", "-"), ("accuracy_greedy", "greedy", "--"))):
            xs, ys, last = run.accuracy(key, x)
            color = f"C{k}" if one else c
            if xs:
                ax.plot(xs, ys, color=color, ls=ls, marker=marker, ms=ms, lw=1.8,
                        label=label if one else (run.name if key == "accuracy" else None))
            if last:
                ax.plot(*last, color=color, marker="*", ms=star, ls="none",
                        label="after training" if one and k == 0 else None)
            shown = shown or bool(xs or last)
    ax.set(title="Held-out accuracy: reward ≥ 1 (0: before training)", ylabel="accuracy (%)")
    if shown:
        ax.set_ylim(-2, 102)
        if not one:
            ax.legend(handles=[*ax.get_legend_handles_labels()[0],
                               Line2D([], [], color="gray", ls="-", label="sampled"),  # (the marker is the run's)
                               Line2D([], [], color="gray", ls="--", label="greedy"),
                               Line2D([], [], color="gray", ls="none", marker="*", ms=12, label="after training")],
                      fontsize=9)
    else:
        ax.text(0.5, 0.5, "not evaluated\n(no data.eval_path)", ha="center", va="center", transform=ax.transAxes,
                color="gray", fontsize=12)

    for ax, (ptitle, ylabel, lines) in zip(axes[2:], SFT_PANELS if sft else PANELS):
        scale = 100 if "%" in ylabel else 1
        for run, c in zip(runs, colors):
            for key, label, ls in lines:
                xs, ys = run.series(key, x)
                ax.plot(xs, [scale * y for y in ys], color=c if not one else None, ls=ls, lw=1.6,
                        label=label if one else (run.name if ls == "-" else None))
        ax.set(title=ptitle, ylabel=ylabel)
        if scale == 100:
            ax.set_ylim(-2, 102)
        if "Staleness" in ptitle:
            ax.set_ylim(bottom=-0.1, top=max(1.0, ax.get_ylim()[1]))
        if not one and len(lines) > 1:
            ax.legend(handles=[*ax.get_legend_handles_labels()[0],
                               *(Line2D([], [], color="gray", ls=ls, label=label) for _, label, ls in lines)],
                      fontsize=9)

    for ax in axes:
        ax.set_xlabel(xlabel)
        if x == "step":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.get_legend() is None and ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=9)
    fig.suptitle(title or ("relayrl learning curves: " + " vs ".join(r.name for r in runs)), fontsize=15)
    return fig


def _subtitle(run: RunData) -> str:
    s = run.summary
    parts = [f"{run.records[-1]['step']} steps" if run.records else "no steps yet"]
    if run.records:
        parts.append(f"{run.records[-1].get('samples', 0):,} samples")
        parts.append(f"{run.records[-1].get('wall_seconds', 0) / 60:.1f} min")
    before, after = s.get("eval_accuracy_before"), s.get("eval_accuracy_after")
    if before is not None and after is not None:
        parts.append(f"held-out accuracy {before:.1%} → {after:.1%}")
    return ", ".join(parts)


def save_curves(run_dir: str | Path, eval_before: dict | None = None, x: str = "step") -> Path:
    """``<run dir>/curves.png`` of one run (``eval_before``: the live run's, before summary.json exists)."""
    run = read_run(run_dir)
    run.eval_before = eval_before
    path = Path(run_dir) / "curves.png"
    _save(curves_figure([run], x, f"relayrl learning curves: {run.name} ({_subtitle(run)})"), path)
    return path


def default_output(run_dirs: list[str | Path]) -> Path:
    """One run: its ``curves.png``; several: ``compare_<a>_<b>....png`` in the first run's parent folder."""
    if len(run_dirs) == 1:
        return Path(run_dirs[0]) / "curves.png"
    stem = "compare_" + "_".join(Path(d).resolve().name for d in run_dirs)
    return Path(run_dirs[0]).resolve().parent / (stem[:120] + ".png")


def compare(run_dirs: list[str | Path], out: str | Path | None = None, x: str = "step") -> Path:
    """One picture of the runs overlaid (``relayrl plot``); returns its path (``default_output`` unless ``out``)."""
    out = Path(out) if out is not None else default_output(run_dirs)
    if out.suffix.lower() not in (".png", ".pdf", ".svg"):
        raise PlotError(f"-o {out}: the picture's name must end in .png, .pdf or .svg")
    runs = [read_run(d) for d in run_dirs]
    names = [r.name for r in runs]
    if len(set(names)) < len(names):  # runs of the same name in different folders: tell them apart
        for r, d in zip(runs, run_dirs):
            r.name = str(Path(d))
    title = f"relayrl learning curves: {runs[0].name} ({_subtitle(runs[0])})" if len(runs) == 1 else ""
    out.parent.mkdir(parents=True, exist_ok=True)
    _save(curves_figure(runs, x, title), out)
    return out


def _save(fig, path: Path) -> None:
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")  # (a viewer never sees half a picture)
    fig.savefig(tmp)
    tmp.replace(path)
