"""Stops that schedulers send. SIGTERM (slurm at the end of a job's time or on `scancel`, Kubernetes on
eviction, `kill`) and SIGUSR1 (slurm's pre-emption warning, `#SBATCH --signal=USR1@90`) ask the run to stop:
it finishes the step it is in, saves a checkpoint of it, and ends with ``StopRequested`` — the command prints
the resume command and exits with 128 + the signal's number (143, 138), as a shell reports a process the
signal ended. Before the first step (loading, the evaluation before training), or a second signal while
the step finishes, stops at once, as Ctrl-C does (``SignalInterrupt``, a KeyboardInterrupt: the last
complete checkpoint stays; checkpoints are written whole or not at all).
"""

from __future__ import annotations

import contextlib
import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequested(Exception):
    """The run stopped at a signal's request, its last step saved."""

    def __init__(self, signum: int, step: int):
        self.signum, self.step, self.name = signum, step, signal.Signals(signum).name
        super().__init__(f"stopped by {self.name} after step {step}, its checkpoint saved")


class SignalInterrupt(KeyboardInterrupt):
    """A stop signal that could not wait for a step to end."""

    def __init__(self, signum: int):
        self.signum, self.name = signum, signal.Signals(signum).name
        super().__init__(self.name)


class StopSignals:
    """``with StopSignals() as stop:`` — once ``stop.armed`` (the loop's first step has begun),
    ``stop.signum`` is the first stop signal received (None before); the handlers before it are restored on
    leaving. Off the main thread (a notebook's worker, a test's
    thread) Python cannot take signals: nothing is installed."""

    def __init__(self):
        self.signum: int | None = None
        self.armed = False
        self._before: dict[int, object] = {}

    def _on_signal(self, signum, frame) -> None:
        if not self.armed or self.signum is not None:
            raise SignalInterrupt(signum)  # nothing to finish yet, or the second: stop now
        self.signum = signum

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                with contextlib.suppress(ValueError, OSError):
                    self._before[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._before.items():
            signal.signal(sig, handler)
