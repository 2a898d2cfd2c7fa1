"""The interface every tracker of ``run.report_to`` implements (``Tracker``), what it is opened with
(``TrackerContext``), and the helpers the backends share. ``backends`` implements it per tracker;
``trackers.Trackers`` fans a run's records out to them.
"""

from __future__ import annotations

import contextlib
import io
import random
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
        import_library(cls.name, cls.package)

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

    def table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        """A table at a step (the rollout records, ``run.save_rollouts``); a tracker without tables skips it."""

    def summary(self, scalars: dict[str, float], step: int) -> None:
        """The run's final numbers (summary.json's); by default logged as ``final/<key>`` at the last step."""
        self.log({f"final/{k}": v for k, v in scalars.items()}, step)

    def close(self, ok: bool) -> None:
        raise NotImplementedError


def import_library(name: str, module: str):
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
