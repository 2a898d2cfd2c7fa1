"""``relayrl show RUN``: a run's rollout records (``run.save_rollouts``, ``tracking/rollouts.py``) in
the terminal. The list, by step, filtered and sorted (``--step``, ``--failures``, ``--status``,
``--min-reward``/``--max-reward``, ``--sort reward|length``, ``--limit``); ``--episode ID`` (its id, or
its ``#`` in the list) opens one: its prompt, its turns (what the policy wrote, what the environment
answered: tool calls and results), reward, finish reason, and its tokens coloured by the policy
version that sampled them (decoded with the run's tokenizer: its newest checkpoint's, else its
config's model; without one, the version runs)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console, Group
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from relayrl.tracking.rollouts import expand_runs, read_step, recorded_steps

PALETTE = ["cyan", "magenta", "green", "yellow", "bright_blue", "red", "bright_cyan", "bright_magenta",
           "bright_green", "orange3"]
STATUS_STYLE = {"trained": "green", "failed": "red", "filtered": "yellow"}


class ShowError(ValueError):
    """A run folder that is not there, or has no rollout records."""


def load_records(run: str | Path, step: int | None = None) -> tuple[Path, list[dict]]:
    """The run folder and its records in order (step, then as written), each with its ``#`` (index)."""
    run_dir = Path(run)
    if not run_dir.is_dir():
        raise ShowError(f"{run}: no such run folder (give <run.output_dir>/<run.name>, e.g. runs/demo)")
    steps = recorded_steps(run_dir)
    if not steps:
        why = "its config has run.save_rollouts=0, or it is from before rollout records" \
            if (run_dir / "config.yaml").exists() else "it is not a run folder: no config.yaml"
        raise ShowError(f"{run}: no rollout records in {run_dir / 'rollouts'} ({why})")
    if step is not None and step not in steps:
        raise ShowError(f"{run}: step {step} has no records; recorded: {_span(list(steps))}")
    out: list[dict] = []
    for s, p in steps.items():
        try:
            rows = read_step(p)
        except (OSError, EOFError, ValueError) as e:
            raise ShowError(f"{p}: cannot be read ({type(e).__name__}: {e})") from None
        for r in rows:
            r["#"] = len(out)
            out.append(r)
    return run_dir, out


def _span(steps: list[int]) -> str:
    return f"steps {steps[0]}..{steps[-1]} ({len(steps)} files)" if len(steps) > 1 else f"step {steps[0]}"


def select(records: list[dict], step: int | None = None, failures: bool = False, status: str | None = None,
           min_reward: float | None = None, max_reward: float | None = None, sort: str | None = None,
           limit: int | None = None) -> list[dict]:
    out = [r for r in records if (step is None or r["step"] == step) and (not failures or r.get("failure"))
           and (status is None or r["status"] == status)
           and (min_reward is None or r["reward"] >= min_reward) and (max_reward is None or r["reward"] <= max_reward)]
    if sort:
        out.sort(key=lambda r: r[sort], reverse=True)  # highest first (stable: the run's order among equals)
    return out[:limit] if limit else out


def one_line(s: str | None, n: int = 80) -> str:
    s = " ".join(str(s or "").split())
    return s if len(s) <= n else s[: n - 1] + "…"


def versions_text(runs: list[list[int]]) -> str:
    return " ".join(f"v{v}×{n}" for v, n in runs) or "-"


def list_view(console: Console, records: list[dict], shown: list[dict], run_dir: Path) -> None:
    t = Table(title=f"{run_dir}: rollouts", title_justify="left", header_style="bold", expand=False)
    rows = [[str(r["#"]), str(r["step"]), escape(r["id"]), f"[{STATUS_STYLE.get(r['status'], '')}]{r['status']}",
             f"{r['reward']:.3g}", str(r["finish_reason"] or "-"), str(r["length"]), str(r["staleness"]),
             versions_text(r["versions"]), str(r.get("info", {}).get("turns", 1)),
             (f"[red]{escape(one_line(r['failure'].get('kind', 'failed'), 14))}[/red] " if r.get("failure") else "")
             + escape(one_line(r["response"], 60))] for r in shown]
    columns = [("#", "right"), ("step", "right"), ("id", "left"), ("status", "left"), ("reward", "right"),
               ("finish", "left"), ("len", "right"), ("stale", "right"), ("versions", "left"), ("turns", "right")]
    if all(row[9] == "1" for row in rows):  # single-turn episodes: no turns column
        columns, rows = columns[:9], [row[:9] + row[10:] for row in rows]
    used = 1  # every column but the response as wide as its widest cell: the response takes what is left
    for i, (col, justify) in enumerate(columns):
        width = max([len(col)] + [Text.from_markup(row[i]).cell_len for row in rows])
        t.add_column(col, justify=justify, no_wrap=True, min_width=width)
        used += width + 3
    t.add_column("response", no_wrap=True, overflow="ellipsis", width=min(60, max(12, console.width - used - 3)))
    for row in rows:
        t.add_row(*row)
    console.print(t)
    steps = sorted({r["step"] for r in records})
    console.print(f"{len(shown)} of {len(records)} episodes ({_span(steps)}); open one: relayrl show {run_dir} "
                  "--episode ID|#", highlight=False)


def run_tokenizer(run_dir: Path):
    """The run's tokenizer: its newest checkpoint's, else its config's model (None if neither loads)."""
    try:
        from relayrl.models import load_tokenizer
        from relayrl.run.checkpoint import latest_checkpoint

        ckpt = latest_checkpoint(run_dir)
        if ckpt is not None:
            return load_tokenizer(str(ckpt))
        import yaml

        model = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("model", {})
        path = model.get("tokenizer") or model.get("path")
        if not path or path.startswith("builtin:"):  # (not built here just to colour tokens)
            from relayrl.models import resolve_model_path

            path = resolve_model_path(path, log=lambda *_: None) if path else None
        return load_tokenizer(path) if path else None
    except Exception:  # noqa: BLE001 - the view goes on with the version runs
        return None


def token_view(rec: dict, tok) -> Group:
    """The response's tokens, each coloured by the policy version that sampled it, and the legend."""
    runs = rec["versions"]
    versions = expand_runs(runs)
    first = min((v for v, _ in runs), default=0)
    style = {v: PALETTE[(v - first) % len(PALETTE)] for v, _ in runs}
    legend = Text("versions: ")
    for v, n in runs:
        legend.append(f" v{v}×{n} ", style=f"reverse {style[v]}")
        legend.append(" ")
    ids = rec.get("response_ids")
    if tok is None or not ids or len(ids) != len(versions):
        return Group(legend, Text("(no tokenizer for this run: the version runs above)", style="dim"))
    text = Text()
    for piece, v in zip(tok.batch_decode([[i] for i in ids]), versions):
        text.append(piece, style=style[v])
    return Group(legend, text)


def episode_view(console: Console, run_dir: Path, rec: dict) -> None:
    console.rule(f"[bold]episode {escape(rec['id'])}[/bold] (#{rec['#']}, step {rec['step']})")
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold")
    facts.add_column()
    rows = [("status", f"[{STATUS_STYLE.get(rec['status'], '')}]{rec['status']}"), ("reward", f"{rec['reward']:.4g}"),
            ("finish reason", str(rec["finish_reason"] or "-")), ("length", f"{rec['length']} tokens"),
            ("staleness", f"{rec['staleness']} versions behind the one trained"),
            ("versions", versions_text(rec["versions"])), ("answer", escape(str(rec.get("answer"))))]
    if rec.get("failure"):
        rows.append(("failure", f"[red]{escape(str(rec['failure']))}"))
    if rec.get("info"):
        rows.append(("info", escape(", ".join(f"{k}={v}" for k, v in rec["info"].items()))))
    for k, v in rows:
        facts.add_row(k, v)
    console.print(facts)
    for m in rec["prompt"]:
        console.print(Panel(escape(str(m.get("content", ""))), title=f"prompt: {m.get('role', '?')}",
                            title_align="left", border_style="blue"))
    for k, turn in enumerate(rec.get("turns") or [{"assistant": rec["response"]}]):
        console.print(Panel(escape(turn["assistant"]), title=f"turn {k}: policy" if rec.get("turns") else "response",
                            title_align="left", border_style="green"))
        if turn.get("env"):
            console.print(Panel(escape(turn["env"]), title=f"turn {k}: environment (tool results, observations)",
                                title_align="left", border_style="yellow"))
    console.print(Panel(token_view(rec, run_tokenizer(run_dir)), title="tokens by policy version",
                        title_align="left", border_style="magenta"))


def find(records: list[dict], episode: str) -> dict:
    for r in records:
        if r["id"] == episode:
            return r
    if episode.isdigit() and int(episode) < len(records):
        return records[int(episode)]
    raise ShowError(f"no episode {episode!r}: give an id (e.g. {records[0]['id']}) or a # from 0 to "
                    f"{len(records) - 1}")


def show(run: str, episode: str | None = None, step: int | None = None, failures: bool = False,
         status: str | None = None, min_reward: float | None = None, max_reward: float | None = None,
         sort: str | None = None, limit: int | None = 50, console: Console | None = None) -> None:
    console = console or Console()
    run_dir, records = load_records(run, step)
    if episode is not None:
        episode_view(console, run_dir, find(records, episode))
        return
    shown = select(records, step, failures, status, min_reward, max_reward, sort, limit)
    list_view(console, records, shown, run_dir)
