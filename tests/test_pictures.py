"""Learning-curve pictures: curves.png of one run, ``relayrl plot`` comparing several; the lines
drawn are the numbers in metrics.jsonl and summary.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.cli import main
from relayrl.tracking.pictures import _smooth, curves_figure, read_run, save_curves


def write_run(d: Path, rewards: list[float], evals: dict[int, float], before=0.2, after=0.6, slow=1.0) -> Path:
    """A run folder as a run leaves it: metrics.jsonl (eval/* at the ``evals`` steps) and summary.json."""
    d.mkdir(parents=True)
    lines = []
    for i, r in enumerate(rewards, 1):
        m = {"step": i, "samples": 64 * i, "reward_mean": r, "response_len_mean": 30 + i, "response_len_max": 90 + i,
             "staleness_mean": 0.5, "staleness_max": 1, "staleness_hist": [1, 1], "engine_idle_frac": 0.1,
             "trainer_idle_frac": 0.7, "tokens_per_s": 1000.0 / slow, "wall_seconds": 1.5 * i * slow}
        if i in evals:
            m.update({"eval/accuracy": evals[i], "eval/accuracy_greedy": evals[i] + 0.1})
        lines.append(json.dumps(m))
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    e = lambda a: {"accuracy": a, "accuracy_greedy": a + 0.1, "temperature": 1.0}  # noqa: E731
    (d / "summary.json").write_text(json.dumps({"steps": len(rewards), "eval_before": e(before), "eval_after": e(after),
                                                "eval_accuracy_before": before, "eval_accuracy_after": after}))
    return d


def test_the_curves_are_the_numbers_of_the_run(tmp_path):
    rewards = [0.1 * (i % 7) + 0.01 * i for i in range(40)]
    d = write_run(tmp_path / "a", rewards, {10: 0.3, 20: 0.45})
    fig = curves_figure([read_run(d)])
    reward, acc, length, stale, idle, speed = fig.axes
    raw, smooth = reward.get_lines()
    assert list(raw.get_ydata()) == rewards and list(raw.get_xdata()) == list(range(1, 41))
    assert list(smooth.get_ydata()) == _smooth(rewards, 2)  # a twentieth of the run
    sampled = acc.get_lines()[0]
    assert list(sampled.get_xdata()) == [0, 10, 20] and list(sampled.get_ydata()) == pytest.approx([20, 30, 45])
    star = acc.get_lines()[1]  # after training, a point of its own at the last step
    assert list(star.get_xdata()) == [40] and list(star.get_ydata()) == pytest.approx([60])
    assert list(idle.get_lines()[1].get_ydata()) == pytest.approx([70.0] * 40)  # percent of the step
    for ax in fig.axes:
        assert ax.get_title() and ax.get_ylabel() and ax.get_xlabel() == "training step"
        assert ax.get_legend() is not None and all(t.get_text() for t in ax.get_legend().get_texts())
    assert [t.get_text() for t in reward.get_legend().get_texts()] == ["each step", "moving average over 2 steps"]


def test_save_curves_writes_curves_png(tmp_path):
    d = write_run(tmp_path / "a", [0.1, 0.2, 0.3], {})
    path = save_curves(d)
    from PIL import Image

    assert path == d / "curves.png" and Image.open(path).size == (1600, 900)


def test_relayrl_plot_overlays_runs_in_one_picture(tmp_path, capsys):
    a = write_run(tmp_path / "runs" / "a", [0.1, 0.2, 0.4, 0.5], {2: 0.3})
    b = write_run(tmp_path / "runs" / "b", [0.1, 0.3, 0.5, 0.6], {2: 0.4}, slow=2.0)
    assert main(["plot", str(a), str(b)]) == 0
    out = Path(capsys.readouterr().out.strip())
    assert out == (tmp_path / "runs" / "compare_a_b.png").resolve() and out.stat().st_size > 20_000
    fig = curves_figure([read_run(a), read_run(b)], x="time")
    reward = fig.axes[0]
    assert [t.get_text() for t in reward.get_legend().get_texts()] == ["a", "b"]  # one colour a run
    assert list(reward.get_lines()[1].get_xdata()) == pytest.approx([0.05, 0.1, 0.15, 0.2])  # minutes
    assert fig.axes[0].get_xlabel() == "wall-clock time (minutes)"
    assert main(["plot", str(a), str(b), "-o", str(tmp_path / "cmp.svg"), "--x", "time"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cmp.svg")
    assert (tmp_path / "cmp.svg").read_text().lstrip().startswith("<?xml")
    assert main(["plot", str(a)]) == 0 and capsys.readouterr().out.strip() == str(a / "curves.png")


@pytest.mark.parametrize("args, needle", [
    (["nowhere"], "nowhere: not a run folder (no such folder)"),
    (["{tmp}"], "no metrics.jsonl in it"),
    (["{run}", "-o", "{tmp}/x.txt"], "must end in .png, .pdf or .svg"),
])
def test_plot_errors_are_one_line(tmp_path, capsys, args, needle):
    run = write_run(tmp_path / "r", [0.1], {})
    argv = ["plot", *(a.format(tmp=tmp_path, run=run) for a in args)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("relayrl: plot error: ") and needle in err and len(err.splitlines()) == 1
