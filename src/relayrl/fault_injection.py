"""Fault injection for crash tests: ``RELAYRL_KILL_AT=phase:n`` makes the process SIGKILL itself
the n-th time it reaches ``fault_point(phase)`` (phases: generate, train, checkpoint, eval).

Used by ``benchmarks/kill_torture.py`` to kill a run at a chosen moment, which an external
``kill -9`` at a random time cannot aim at. Costs one dictionary lookup when unset.
"""

from __future__ import annotations

import os
import signal

_target: tuple[str, int] | None = None
_counts: dict[str, int] = {}
_spec = os.environ.get("RELAYRL_KILL_AT")
if _spec:
    phase, _, n = _spec.partition(":")
    _target = (phase, int(n or 1))


def fault_point(phase: str) -> None:
    if _target is None or _target[0] != phase:
        return
    _counts[phase] = _counts.get(phase, 0) + 1
    if _counts[phase] == _target[1]:
        os.kill(os.getpid(), signal.SIGKILL)
