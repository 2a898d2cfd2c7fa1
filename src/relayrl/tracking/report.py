"""``RunReport``: every step's metrics to ``metrics.jsonl`` and to the trackers of ``run.report_to``,
``curves.png`` redrawn while the run goes (every ``REDRAW_S`` seconds: drawing takes about a second
of CPU) and at the end, and the pictures and summary sent to the trackers when the run finishes. The
loop sees one object with ``write`` and ``close``."""

from __future__ import annotations

import time
from pathlib import Path

from relayrl.tracking.metrics import MetricsLog
from relayrl.tracking.pictures import save_curves
from relayrl.tracking.rollouts import TABLE_COLUMNS, table_rows
from relayrl.tracking.trackers import TrackerContext, Trackers


class RunReport:
    REDRAW_S = 120.0

    def __init__(self, run, run_dir: Path, config: dict, state, log):
        """Opened once the run directory is ready and the held-out evaluation before training is done
        (``state.eval_before``: the trackers get it at step 0). ``state.step`` > 0: resuming from that
        checkpoint, so metrics.jsonl drops the lines past it and the trackers continue their runs.
        ``run``: the run section; ``config``: the resolved configuration the trackers record."""
        self.run_dir, self.log = run_dir, log
        resume = state.step or None
        self.trackers = Trackers.open(run.report_to, TrackerContext(
            self.run_dir, run.name, run.project, config, resume), log)
        self.jsonl = MetricsLog(self.run_dir / "metrics.jsonl", resume_step=state.step)
        self.eval_before, self.drawn = state.eval_before, time.monotonic()
        if resume is None and state.eval_before:
            self.trackers.log({"step": 0, **{f"eval/{k}": v for k, v in state.eval_before.items()}})

    def write(self, record: dict) -> None:
        self.jsonl.write(record)
        self.trackers.log(record)
        if time.monotonic() - self.drawn > self.REDRAW_S:
            self.curves()

    def table(self, step: int, records: list[dict]) -> None:
        """A step's rollout records as a table, to the trackers that have tables."""
        self.trackers.table("rollouts", TABLE_COLUMNS, table_rows(records), step)

    def curves(self) -> Path:
        self.drawn = time.monotonic()
        return save_curves(self.run_dir, self.eval_before)

    def finish(self, summary: dict, timeline: Path) -> None:
        """The run is done: curves.png (with the accuracy after training), then the trackers get the
        pictures and the summary's numbers at the last step, and their runs are closed as finished."""
        curves = self.curves()
        self.log(f"learning curves: {curves}")
        self.trackers.finish(summary, {"curves": curves, "timeline": timeline}, summary["steps"])

    def close(self) -> None:
        """(After ``finish``, or on the way out of a failed run: the trackers' runs closed as failed.)"""
        self.jsonl.close()
        self.trackers.close(ok=False)
