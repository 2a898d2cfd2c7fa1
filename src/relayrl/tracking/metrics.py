"""Metrics file, phase timers and the progress bar."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class Timers:
    """``with timers("generate"):`` accumulates wall seconds per phase; ``pop()`` returns and resets."""

    def __init__(self):
        self.t: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.t[name] = self.t.get(name, 0.0) + time.perf_counter() - t0

    def pop(self) -> dict[str, float]:
        out, self.t = {f"time/{k}": round(v, 4) for k, v in self.t.items()}, {}
        return out


class MetricsLog:
    """Appends one JSON object per step to ``metrics.jsonl``; on resume, drops lines past the
    checkpoint (and a last line a kill cut in half), so every step is logged exactly once."""

    def __init__(self, path: Path, resume_step: int | None = None):
        self.path = path
        if resume_step is not None and path.exists():
            kept = [ln for ln in path.read_text().splitlines() if _step_of(ln) is not None
                    and _step_of(ln) <= resume_step]
            path.write_text("".join(ln + "\n" for ln in kept))
        self.f = path.open("a")

    def write(self, record: dict) -> None:
        self.f.write(json.dumps(record) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


class ProgressBar:
    """A live bar on a terminal (``run.progress``); anywhere else — nohup, slurm, a pipe, ``| tee``, or
    ``run.progress=false`` — a plain line every ``every_s`` seconds (0: none), so a long run is never silent
    in its log. Tokens/s and the ETA are over the steps this process ran (a step that generated nothing,
    the last of an async run, does not show 0 tok/s)."""

    def __init__(self, total: int, start: int, enabled: bool, console: Console, every_s: float = 30.0):
        self.bar = enabled and console.is_terminal
        self.console, self.total, self.done, self.every_s = console, total, start, every_s
        self.first, self.t0 = start, time.monotonic()
        self.last_line, self.tokens = self.t0, 0
        self.progress = Progress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=console,
            disable=not self.bar,
        )
        self.task = self.progress.add_task("train", total=total, completed=start, info="")

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        self.progress.__exit__(*exc)

    def update(self, m: dict) -> None:
        self.done += 1
        self.tokens += m.get("generated_tokens", m.get("tokens", 0))
        now = time.monotonic()
        rate = self.tokens / max(now - self.t0, 1e-9)
        if "reward_mean" in m:
            info = (f"reward {m['reward_mean']:.3f}  len {m['response_len_mean']:.0f}/{m['response_len_max']}"
                    f"  {rate:.0f} tok/s")
        else:  # (relayrl sft)
            info = f"loss {m['loss']:.3f}  epoch {m['epoch']:.2f}  {rate:.0f} tok/s"
        if self.bar:
            self.progress.update(self.task, advance=1, info=info)
        elif self.every_s and now - self.last_line >= self.every_s:
            self.last_line = now
            eta = (now - self.t0) / (self.done - self.first) * (self.total - self.done)
            self.console.print(f"step {self.done}/{self.total}  {info}  elapsed {_clock(now - self.t0)}  "
                               f"eta {_clock(eta)}", highlight=False, markup=False)


def _clock(seconds: float) -> str:
    """0:42, 12:05, 1:02:03."""
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m}:{s:02d}"
