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
import io
import json
import random
import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse


class TrackerError(RuntimeError):
    """A tracker of run.report_to cannot start (package missing, server unreachable)."""


@dataclass
class TrackerContext:
    """What a tracker is opened with."""

    run_dir: Path
    run_name: str
    project: str
    config: dict  # the resolved config, nested (section -> field -> value)
    resume_step: int | None  # the checkpoint's step when resuming, else None
    saved: dict = field(default_factory=dict)  # what this tracker recorded last time (trackers.json)

    @property
    def params(self) -> dict[str, object]:
        """The config flattened to ``section.field`` (the form of MLflow params, TensorBoard hparams)."""
        return {f"{sec}.{k}": v for sec, body in self.config.items() for k, v in body.items()}


class Tracker:
    """One tracker. ``open`` starts or resumes its run; ``log`` takes flat scalars at a step."""

    name = ""
    package = ""  # the module imported; `pip install 'relayrl[<name>]'` installs it
    outputs: tuple[str, ...] = ()  # what it writes under the run directory (removed on a fresh start)

    @classmethod
    def check(cls, run_dir: Path) -> None:
        """Raise TrackerError if it cannot start here (its library missing, its server unreachable)."""
        _import(cls.name, cls.package)

    def __init__(self, ctx: TrackerContext):
        self.ctx = ctx

    def identity(self) -> dict:
        """What resuming needs to continue this run (saved in trackers.json)."""
        return {}

    def where(self) -> str:
        """One line for the user: where the run is and how to look at it."""
        return ""

    def log(self, scalars: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def images(self, paths: dict[str, Path], step: int) -> None:
        raise NotImplementedError

    def summary(self, scalars: dict[str, float], step: int) -> None:
        """The run's final numbers (summary.json's); by default logged as ``final/<key>`` at the last step."""
        self.log({f"final/{k}": v for k, v in scalars.items()}, step)

    def close(self, ok: bool) -> None:
        raise NotImplementedError


def _import(name: str, module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise TrackerError(f"run.report_to has {name}, but its library cannot be imported ({e}): "
                           f"pip install 'relayrl[{name}]'") from None


def check_reachable(name: str, url: str, why: str) -> None:
    """A TCP connection to ``url``'s host within 5 s, else TrackerError naming ``why`` (the setting)."""
    u = urlparse(url if "://" in url else f"https://{url}")
    port = u.port or (443 if u.scheme in ("https", "") else 80)
    try:
        socket.create_connection((u.hostname or "", port), timeout=5).close()
    except OSError as e:
        raise TrackerError(f"run.report_to has {name}, and {why}, but {u.hostname}:{port} cannot be reached "
                           f"({e.strerror or e}). Start the server, or unset it to log offline") from None


@contextlib.contextmanager
def rng_kept():
    """Python's global random state as it was: a tracker that draws from it (SwanLab picks a run's
    colour so) must not change what a user's code seeded in this process goes on to draw."""
    state = random.getstate()
    try:
        yield
    finally:
        random.setstate(state)


@contextlib.contextmanager
def quietly():
    """The trackers' libraries print banners while they start and stop; relayrl prints its own line."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def scalars(record: dict, prefix: str = "") -> dict[str, float]:
    """A metrics record as flat numbers: ``step`` left out, lists (``staleness_hist``) as
    ``key/0``, ``key/1``, ..., nested dicts as ``key/sub``; strings and None left out."""
    out: dict[str, float] = {}
    for k, v in record.items():
        key = f"{prefix}{k}"
        if k == "step" and not prefix:
            continue
        if isinstance(v, bool):
            out[key] = float(v)
        elif isinstance(v, (int, float)):
            out[key] = float(v)
        elif isinstance(v, (list, tuple)):
            out.update(scalars({str(i): x for i, x in enumerate(v)}, f"{key}/"))
        elif isinstance(v, dict):
            out.update(scalars(v, f"{key}/"))
    return out


class Trackers:
    """The trackers of ``run.report_to`` (besides jsonl, which ``MetricsLog`` writes), as one."""

    FILE = "trackers.json"

    def __init__(self, trackers: list[Tracker], run_dir: Path, warn):
        self.trackers, self.run_dir, self.warn = trackers, run_dir, warn

    @staticmethod
    def check(names: list[str], run_dir: Path) -> None:
        """Before anything is written: every tracker's library imports and its server (if any) answers."""
        from relayrl.tracking.backends import BACKENDS

        for n in names:
            if n != "jsonl":
                BACKENDS[n].check(run_dir)

    @classmethod
    def open(cls, names: list[str], ctx: TrackerContext, log) -> "Trackers":
        """Start (or, with ``ctx.resume_step``, continue) each tracker's run. A fresh start first
        removes what an earlier attempt of this run wrote (it died before its first checkpoint)."""
        from relayrl.tracking.backends import BACKENDS

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

    def finish(self, summary: dict, pictures: dict[str, Path], step: int) -> None:
        """The summary's numbers and the pictures, then each run is closed as finished."""
        numbers = {k: v for k, v in scalars(summary).items() if "/" not in k}
        present = {k: p for k, p in pictures.items() if p.exists()}
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
