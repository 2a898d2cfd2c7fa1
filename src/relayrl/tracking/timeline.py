"""Busy intervals of the engine and the trainer, and the picture of them (``timeline.png``).

Components record ``(lane, start, end)`` with ``time.perf_counter`` clocks; the run writes the
intervals to ``timeline.json`` and draws one bar per lane, so a user can see where time goes:
in ``sync`` mode the lanes alternate, in ``periodic`` mode they overlap. Runs with an environment have a
third lane, busy while one of its calls is in flight (for workspaces: sandboxes, tools, tests).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path


class Timeline:
    """Memory stays bounded without losing recent intervals: an interval that starts within
    ``join_gap`` of the same lane's last one extends it (the async engine lane arrives in 0.1 s
    pieces), and past ``max_intervals`` the oldest half is coarsened (neighbours less than a
    second apart merged). Recent intervals, which the per-step idle fractions read, stay exact."""

    def __init__(self, max_intervals: int = 20000, join_gap: float = 1e-3):
        self.t0 = time.perf_counter()
        self.intervals: list[tuple[str, float, float]] = []
        self._last: dict[str, int] = {}  # lane -> index of its latest interval
        self._lock = threading.Lock()
        self.max_intervals, self.join_gap = max_intervals, join_gap

    @contextlib.contextmanager
    def busy(self, lane: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.record(lane, start - self.t0, time.perf_counter() - self.t0)

    def record(self, lane: str, start: float, end: float) -> None:
        """An interval measured by the caller (seconds since ``t0``, as ``now`` gives)."""
        with self._lock:
            i = self._last.get(lane)
            if i is not None and 0 <= start - self.intervals[i][2] <= self.join_gap:
                self.intervals[i] = (lane, self.intervals[i][1], max(end, self.intervals[i][2]))
                return
            self._last[lane] = len(self.intervals)
            self.intervals.append((lane, start, end))
            if len(self.intervals) > self.max_intervals:
                self._coarsen()

    def _coarsen(self) -> None:
        half = len(self.intervals) // 2
        old, merged = sorted(self.intervals[:half], key=lambda x: (x[0], x[1])), []
        for lane, s, e in old:
            if merged and merged[-1][0] == lane and s - merged[-1][2] < 1.0:
                merged[-1] = (lane, merged[-1][1], max(e, merged[-1][2]))
            else:
                merged.append((lane, s, e))
        self.intervals = merged + self.intervals[half:]
        self._last = {ln: i for i, (ln, _, _) in enumerate(self.intervals)}

    def busy_seconds(self, lane: str) -> float:
        with self._lock:
            return sum(e - s for ln, s, e in self.intervals if ln == lane)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def busy_between(self, lane: str, a: float, b: float) -> float:
        """Seconds ``lane`` was busy within [a, b] (an interval still open is not counted)."""
        with self._lock:
            return sum(max(0.0, min(e, b) - max(s, a)) for ln, s, e in self.intervals if ln == lane)

    def save(self, run_dir: Path) -> Path:
        """Write ``timeline.json`` and ``timeline.png``; returns the PNG's path."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        with self._lock:
            iv = list(self.intervals)
        (run_dir / "timeline.json").write_text(json.dumps([{"lane": ln, "start": s, "end": e} for ln, s, e in iv]))
        lanes = sorted({ln for ln, _, _ in iv}) or ["engine", "trainer"]
        colors = {"engine": "tab:blue", "trainer": "tab:orange", "environment": "tab:green"}
        fig, ax = plt.subplots(figsize=(12, 0.8 + 0.6 * len(lanes)))
        for y, lane in enumerate(lanes):
            bars = [(s, e - s) for ln, s, e in iv if ln == lane]
            ax.broken_barh(bars, (y - 0.35, 0.7), color=colors.get(lane, "tab:gray"))
        end = max((e for _, _, e in iv), default=1.0)
        ax.set_yticks(range(len(lanes)), [f"{ln} ({self.busy_seconds(ln) / end:.0%} busy)" for ln in lanes])
        ax.set_xlabel("seconds since the loop started")
        ax.set_xlim(0, end)
        ax.set_title(f"relayrl: busy intervals ({run_dir.name})")
        fig.tight_layout()
        path = run_dir / "timeline.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path
