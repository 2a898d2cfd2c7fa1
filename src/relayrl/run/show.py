"""``relayrl show RUN``: a run's rollout records (``run.save_rollouts``, ``tracking/rollouts.py``) in
the terminal. The list, by step, filtered and sorted (``--step``, ``--failures``, ``--status``,
``--min-reward``/``--max-reward``, ``--sort reward|length``, ``--limit``); ``--episode ID`` (its id, or
its ``#`` in the list) opens one: its prompt, its turns (what the policy wrote, what the environment
answered: tool calls and results), reward, finish reason, and its tokens coloured by the policy
version that sampled them (decoded with the run's tokenizer: its newest checkpoint's, else its
config's model; without one, the version runs). ``--step N`` opens that step's file only.

Everything shown came from a model, a tool, an environment or a dataset: it passes through ``safe``
first, so no escape sequence in it reaches the terminal (a window title, the clipboard: OSC 0, OSC 52).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from rich.console import Console, Group
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from relayrl.tracking.rollouts import expand_runs, read_step, recorded_steps, step_file

PALETTE = ["cyan", "magenta", "green", "yellow", "bright_blue", "red", "bright_cyan", "bright_magenta",
           "bright_green", "orange3"]
STATUS_STYLE = {"trained": "green", "failed": "red", "filtered": "yellow"}
# what a terminal acts on rather than shows: C0 and C1 controls (ESC starts colours, titles, clipboard writes;
# CR overwrites a line), DEL, and the bidirectional overrides and isolates that reorder what is shown
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029]")


class ShowError(ValueError):
    """A run folder that is not there, or has no rollout records."""


def safe(text, markup: bool = True) -> str:
    """``text`` with every character a terminal would act on written as its escape (``\\x1b``); newlines and
    tabs kept; with ``markup``, rich's markup escaped too (for a string printed as markup)."""
    s = _UNSAFE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), str(text))
    return escape(s) if markup else s


def load_records(run: str | Path, step: int | None = None) -> tuple[Path, list[dict]]:
    """The run folder and its records in order (step, then as written), each with its ``#`` (its index among
    those loaded): every step's, or ``step``'s alone (its file only is opened)."""
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
    for p in [step_file(run_dir, step)] if step is not None else steps.values():
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


def reward_of(r: dict) -> float | None:
    """The record's reward; None for a failed episode's (null, or NaN in records written before it was null)."""
    x = r.get("reward")
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def select(records: list[dict], step: int | None = None, failures: bool = False, status: str | None = None,
           min_reward: float | None = None, max_reward: float | None = None, sort: str | None = None,
           limit: int | None = None) -> list[dict]:
    """The records that pass the filters (an episode without a reward passes no reward bound), sorted highest
    first (those without a reward last; stable: the run's order among equals), at most ``limit``."""
    out = [r for r in records if (step is None or r["step"] == step) and (not failures or r.get("failure"))
           and (status is None or r["status"] == status)
           and (min_reward is None or (reward_of(r) is not None and reward_of(r) >= min_reward))
           and (max_reward is None or (reward_of(r) is not None and reward_of(r) <= max_reward))]
    if sort == "reward":
        out.sort(key=lambda r: (reward_of(r) is not None, reward_of(r) or 0.0), reverse=True)
    elif sort:
        out.sort(key=lambda r: r[sort], reverse=True)
    return out[:limit] if limit else out


def one_line(s: str | None, n: int = 80) -> str:
    s = " ".join(safe(s or "", markup=False).split())
    return s if len(s) <= n else s[: n - 1] + "…"


def versions_text(runs: list[list[int]]) -> str:
    return " ".join(f"v{v}×{n}" for v, n in runs) or "-"


def _reward(r: dict, fmt: str) -> str:
    x = reward_of(r)
    return "-" if x is None else format(x, fmt)


def _prompt(r: dict) -> str:
    """The prompt's last message (what the episode answers)."""
    return (r.get("prompt") or [{}])[-1].get("content", "")


def list_view(console: Console, records: list[dict], shown: list[dict], run_dir: Path, step: int | None,
              sort: str | None = None) -> None:
    steps = sorted({r["step"] for r in records})
    if not shown:
        console.print(f"no episode of {len(records)} ({_span(steps)}) passes these filters", highlight=False)
        return
    order = f"by {sort}, highest first" if sort else "in the run's order"
    t = Table(title=f"{safe(run_dir)}: rollouts, {order}", title_justify="left", header_style="bold", expand=False)
    rows = [[str(r["#"]), str(r["step"]), safe(r["id"]), f"[{STATUS_STYLE.get(r['status'], '')}]{r['status']}",
             _reward(r, ".3g"), safe(r["finish_reason"] or "-"), str(r["length"]), str(r["staleness"]),
             versions_text(r["versions"]), str(r.get("info", {}).get("turns", 1)),
             escape(one_line(_prompt(r), 30)), escape(one_line(r.get("answer") or "-", 12)),
             (f"[red]{escape(one_line(r['failure'].get('kind', 'failed'), 14))}[/red] " if r.get("failure") else "")
             + escape(one_line(r["response"], 60))] for r in shown]
    columns = [("#", "right"), ("step", "right"), ("id", "left"), ("status", "left"), ("reward", "right"),
               ("finish", "left"), ("len", "right"), ("stale", "right"), ("versions", "left"), ("turns", "right"),
               ("prompt", "left"), ("answer", "left")]
    if all(row[9] == "1" for row in rows):  # single-turn episodes: no turns column
        columns, rows = columns[:9] + columns[10:], [row[:9] + row[10:] for row in rows]
    used = 1  # every column but the response as wide as its widest cell: the response takes what is left
    for i, (col, justify) in enumerate(columns):
        width = max([len(col)] + [Text.from_markup(row[i]).cell_len for row in rows])
        t.add_column(col, justify=justify, no_wrap=True, min_width=width)
        used += width + 3
    t.add_column("response", no_wrap=True, overflow="ellipsis", width=min(60, max(12, console.width - used - 3)))
    for row in rows:
        t.add_row(*row)
    console.print(t)
    again = f"relayrl show {run_dir}" + (f" --step {step}" if step is not None else "")
    console.print(f"{len(shown)} of {len(records)} episodes ({_span(steps)}); open one: {safe(again, False)} "
                  "--episode ID|#", highlight=False, markup=False)


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


def token_texts(tok, ids: list[int]) -> list[str]:
    """Each token's text, from its bytes where the tokenizer is byte-level (``tokens.byte_pieces``): a character
    split over tokens shows on its last one, bytes that are no UTF-8 as ``\\xe2`` (decoding each token alone
    gives U+FFFD for both)."""
    from relayrl.tracking.tokens import byte_pieces

    raw = byte_pieces(tok, ids)
    if raw is None:
        return [safe(p, markup=False) for p in tok.batch_decode([[i] for i in ids])]
    out, pending = [], b""  # (pending: the start of a character the tokens so far left open)
    for b in raw:
        if pending and not (b[:1] and 0x80 <= b[0] < 0xC0):  # never finished: its bytes where they were written
            out[-1] += pending.decode("utf-8", "backslashreplace")
            pending = b""
        text, pending = _split(pending + b)
        out.append(text)
    if pending:
        out[-1] += pending.decode("utf-8", "backslashreplace")
    return [safe(p, markup=False) for p in out]


def _split(data: bytes) -> tuple[str, bytes]:
    """``data``'s text (bytes that are no UTF-8 as ``\\xe2``), and the start of a character left open at its end."""
    try:
        return data.decode("utf-8"), b""
    except UnicodeDecodeError as e:
        if e.reason == "unexpected end of data":  # (only ever at the end)
            return data[:e.start].decode("utf-8"), data[e.start:]
        return data.decode("utf-8", "backslashreplace"), b""


def token_view(rec: dict, tok, color: bool = True) -> Group:
    """The response's tokens, each coloured by the policy version that sampled it, and the legend; without
    colour (a pipe, a file) each run of a version starts with its name, [v4]."""
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
    for k, (piece, v) in enumerate(zip(token_texts(tok, ids), versions)):
        if not color and (k == 0 or versions[k - 1] != v):
            text.append(f"[v{v}]", style="bold")
        text.append(piece, style=style[v])
    return Group(legend, text)


def episode_view(console: Console, run_dir: Path, rec: dict) -> None:
    console.rule(f"[bold]episode {safe(rec['id'])}[/bold] (#{rec['#']}, step {rec['step']})")
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold")
    facts.add_column()
    behind = rec["staleness"]
    rows = [("status", f"[{STATUS_STYLE.get(rec['status'], '')}]{rec['status']}"), ("reward", _reward(rec, ".4g")),
            ("finish reason", safe(rec["finish_reason"] or "-")), ("length", f"{rec['length']} tokens"),
            ("staleness", f"{behind} version{'' if behind == 1 else 's'} behind the one trained"),
            ("versions", versions_text(rec["versions"])), ("answer", safe(rec.get("answer")))]
    if rec.get("failure"):
        rows.append(("failure", f"[red]{safe(rec['failure'])}"))
    info = dict(rec.get("info") or {})
    record = info.pop("record", None)  # (a workspace task's: the diff that was tested, the tests' statuses)
    if info:
        rows.append(("info", safe(", ".join(f"{k}={v}" for k, v in info.items()))))
    for k, v in rows:
        facts.add_row(k, v)
    console.print(facts)
    for m in rec["prompt"]:
        console.print(Panel(safe(m.get("content", "")), title=f"prompt: {safe(m.get('role', '?'))}",
                            title_align="left", border_style="blue"))
    tok = run_tokenizer(run_dir)
    for k, turn in enumerate(rec.get("turns") or [{"assistant": _response(rec, tok)}]):
        console.print(Panel(safe(turn["assistant"]), title=f"turn {k}: policy" if rec.get("turns") else "response",
                            title_align="left", border_style="green"))
        if turn.get("env"):
            console.print(Panel(safe(turn["env"]), title=f"turn {k}: environment (tool results, observations)",
                                title_align="left", border_style="yellow"))
    if record:
        _workspace_view(console, record)
    console.print(Panel(token_view(rec, tok, console.color_system is not None), title="tokens by policy version",
                        title_align="left", border_style="magenta"))


def _workspace_view(console: Console, record: dict) -> None:
    """A workspace episode's verdict: each test's status, the diff the tests ran on, what was dropped from it."""
    verdict = "resolved" if record.get("resolved") else "not resolved"
    lines = [f"{status:8} {test}" for test, status in sorted(record.get("statuses", {}).items())]
    lines += [f"dropped from the diff (tests and their configuration): {', '.join(record['dropped'])}"] \
        if record.get("dropped") else []
    lines += [f"note: {record['note']}"] if record.get("note") else []
    console.print(Panel(safe("\n".join(lines) or "(no test ran)"), title=f"tests: {verdict}, reward {record.get('reward')}",
                        title_align="left", border_style="cyan"))
    console.print(Panel(safe(record.get("patch") or "(no change)"), title="the diff the tests ran on",
                        title_align="left", border_style="cyan"))


def _response(rec: dict, tok) -> str:
    """The response as recorded; where it holds U+FFFD and its tokens are byte-level, from its bytes (those
    that are no UTF-8 shown as ``\\xe2``)."""
    from relayrl.tracking.tokens import byte_pieces

    raw = byte_pieces(tok, rec.get("response_ids") or []) if tok is not None and "\ufffd" in rec["response"] else None
    return rec["response"] if raw is None else b"".join(raw).decode("utf-8", "backslashreplace").strip()


def find(records: list[dict], episode: str) -> dict:
    for r in records:
        if r["id"] == episode:
            return r
    if episode.isdigit() and int(episode) < len(records):
        return records[int(episode)]
    raise ShowError(f"no episode {safe(episode, False)!r}: give an id (e.g. {safe(records[0]['id'], False)}) or a # "
                    f"from 0 to {len(records) - 1}")


def show(run: str, episode: str | None = None, step: int | None = None, failures: bool = False,
         status: str | None = None, min_reward: float | None = None, max_reward: float | None = None,
         sort: str | None = None, limit: int | None = 50, console: Console | None = None) -> None:
    console = console or Console()
    run_dir, records = load_records(run, step)
    if episode is not None:
        episode_view(console, run_dir, find(records, episode))
        return
    shown = select(records, step, failures, status, min_reward, max_reward, sort, limit)
    list_view(console, records, shown, run_dir, step, sort)
