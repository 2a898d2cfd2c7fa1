"""Experiment trackers (``run.report_to``) behind one small interface.

Each tracker is its project's own library (``tracking/backends.py``), never hand-written files or
HTTP. The run opens them once (``Trackers.open``), sends them each step's metrics as they are
written to ``metrics.jsonl`` (``log``), the pictures and the summary at the end (``finish``).

- **At start**, ``check`` imports every library and, where a tracker is set to go online, checks
  its server answers: a missing package or server is one line (``TrackerError``, exit status 2)
  before anything is written. Once the run is going, a tracker that fails is turned off with a
  warning; the run goes on (``metrics.jsonl`` has every step).
- **Resume**: what each tracker needs to continue the same run (W&B run id, MLflow run id, ...)
  is kept in ``<run dir>/trackers.json``; a fresh start removes the folders of an attempt that
  died before its first checkpoint, so each step is logged once where the tracker allows it.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

from relayrl.tracking.backends import BACKENDS
from relayrl.tracking.base import Tracker, TrackerContext, TrackerError, rng_kept, scalars  # noqa: F401 (public here)


class Trackers:
    """The trackers of ``run.report_to`` (besides jsonl, which ``MetricsLog`` writes), as one."""

    FILE = "trackers.json"

    def __init__(self, trackers: list[Tracker], run_dir: Path, warn):
        self.trackers, self.run_dir, self.warn = trackers, run_dir, warn

    @staticmethod
    def check(names: list[str], run_dir: Path) -> None:
        """Before anything is written: every tracker's library imports and its server (if any) answers."""
        for n in names:
            if n != "jsonl":
                BACKENDS[n].check(run_dir)

    @classmethod
    def open(cls, names: list[str], ctx: TrackerContext, log) -> "Trackers":
        """Start (or, with ``ctx.resume_step``, continue) each tracker's run. A fresh start first
        removes what an earlier attempt of this run wrote (it died before its first checkpoint)."""
        path = ctx.run_dir / cls.FILE
        if ctx.resume_step is None:
            path.unlink(missing_ok=True)
            for b in BACKENDS.values():
                for out in b.outputs:
                    p = ctx.run_dir / out
                    shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        saved = json.loads(path.read_text()) if path.exists() else {}
        opened: list[Tracker] = []
        try:
            for n in names:
                if n == "jsonl":
                    continue
                one = TrackerContext(**{**ctx.__dict__, "saved": saved.get(n, {})})
                try:
                    with rng_kept():
                        t = BACKENDS[n](one)
                except TrackerError:
                    raise
                except Exception as e:
                    raise TrackerError(f"run.report_to has {n}, but it could not start a run: "
                                       f"{type(e).__name__}: {e}") from e
                opened.append(t)
                saved[n] = t.identity()
                log(f"{n}: {t.where()}")
        except BaseException:
            for t in opened:
                t.close(ok=False)
            raise
        if opened:
            path.write_text(json.dumps(saved, indent=1))
        return cls(opened, ctx.run_dir, log)

    def _each(self, what: str, call) -> None:
        for t in list(self.trackers):
            try:
                with rng_kept():
                    call(t)
            except Exception as e:  # a tracker never stops the run once it is going
                self.trackers.remove(t)
                self.warn(f"[yellow]{t.name} failed ({what}): {type(e).__name__}: {e} — it is turned off for the "
                          f"rest of the run (metrics.jsonl has every step)")
                with contextlib.suppress(Exception):
                    t.close(ok=False)

    def log(self, record: dict) -> None:
        values, step = scalars(record), int(record["step"])
        self._each(f"step {step}", lambda t: t.log(values, step))

    def table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        self._each(f"the {name} table at step {step}", lambda t: t.table(name, columns, rows, step))

    def finish(self, summary: dict, pictures: dict[str, Path], step: int) -> None:
        """The summary's numbers and the pictures, then each run is closed as finished."""
        numbers = {k: v for k, v in scalars(summary).items() if "/" not in k}
        present = {k: p for k, p in pictures.items() if p is not None and p.exists()}
        self._each("the pictures", lambda t: t.images(present, step))
        self._each("the summary", lambda t: t.summary(numbers, step))
        self.close(ok=True)

    def close(self, ok: bool = False) -> None:
        trackers, self.trackers = self.trackers, []
        for t in trackers:
            try:
                t.close(ok)
            except Exception as e:
                self.warn(f"[yellow]{t.name} failed to close: {type(e).__name__}: {e}")
