"""Verifiable rewards: a registry of verifiers run in a separate process with a time limit.

A reward function has the signature ``fn(completion: str, answer: str | None, metadata: dict)
-> float``. Built-ins: ``math`` and ``exact``; any importable ``module:function`` works too.
A function that raises, returns a non-number, or exceeds the time limit gives that sample
reward 0; the failure is counted and reported, and the run goes on. Functions run in a child
process so a hung one can be killed (a thread cannot be).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import select
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Callable

RewardFn = Callable[[str, "str | None", dict], float]

_BOXED = re.compile(r"\\boxed\s*\{")
_ANSWER_LINE = re.compile(r"(?:answer\s*(?:is)?\s*[:=]?|####)\s*([^\n]+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, honouring nested braces."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    i, depth = starts[-1], 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_answer(text: str) -> str | None:
    """Final answer: last \\boxed{}, else an 'Answer: ...' / '#### ...' line, else the last number."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    lines = _ANSWER_LINE.findall(text)
    if lines:
        return lines[-1].strip().rstrip(".")
    nums = _NUMBER.findall(text)
    return nums[-1] if nums else None


def math_reward(completion: str, answer: str | None, metadata: dict) -> float:
    """1.0 if the extracted final answer is mathematically equivalent to ``answer`` (math-verify)."""
    if answer is None:
        raise ValueError("the 'math' reward needs an answer field")
    pred = extract_answer(completion)
    if pred is None:
        return 0.0
    if pred.strip() == str(answer).strip():
        return 1.0
    from math_verify import parse, verify

    gold = parse(f"${answer}$")
    got = parse(f"${pred}$")
    return 1.0 if gold and got and verify(gold, got) else 0.0


def exact_reward(completion: str, answer: str | None, metadata: dict) -> float:
    """1.0 if the completion equals ``answer`` after whitespace normalisation."""
    if answer is None:
        raise ValueError("the 'exact' reward needs an answer field")
    return float(" ".join(completion.split()) == " ".join(str(answer).split()))


REWARDS: dict[str, RewardFn] = {"math": math_reward, "exact": exact_reward}


def resolve(spec: str) -> RewardFn:
    """A registry name or 'module:function'."""
    if spec in REWARDS:
        return REWARDS[spec]
    if ":" not in spec:
        raise ValueError(f"unknown reward {spec!r}; valid: {', '.join(REWARDS)} or 'module:function'")
    mod, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward function {spec!r} cannot be imported: {e}") from None
    if not callable(fn):
        raise ValueError(f"reward {spec!r} is not callable")
    return fn


def _worker_main(spec: str) -> None:
    """The child: JSON lines in on stdin, JSON lines out on a private copy of stdout.

    A subprocess rather than multiprocessing: spawn/forkserver would re-import the user's
    ``__main__``, which breaks scripts without a main guard."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout = sys.stderr  # a verifier that prints must not corrupt the protocol
    fn = resolve(spec)
    if fn is math_reward:
        import math_verify  # noqa: F401  (import before the first timed call)
    out.write('"ready"\n')
    for line in sys.stdin:
        completion, answer, metadata = json.loads(line)
        try:
            value = float(fn(completion, answer, metadata))
            msg = [True, value] if math.isfinite(value) else [False, f"non-finite reward {value}"]
        except Exception as e:  # a user's verifier failing must not kill the run
            msg = [False, f"{type(e).__name__}: {e}"]
        out.write(json.dumps(msg) + "\n")


@dataclass
class RewardStats:
    failures: int = 0
    timeouts: int = 0
    last_error: str | None = None
    errors: list[str] = field(default_factory=list)


class RewardRunner:
    """Scores completions in a child process; kills and restarts it when a call exceeds the limit."""

    def __init__(self, spec: str, timeout_s: float = 5.0):
        resolve(spec)  # fail fast, in the parent, on an unknown name
        self.spec, self.timeout_s = spec, timeout_s
        self.stats = RewardStats()
        self._proc: subprocess.Popen | None = None
        self._start()

    def _start(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from relayrl.rewards import _worker_main; _worker_main(sys.argv[1])",
             self.spec],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
        )
        self._ready = False  # the child imports in the background; the first score() waits for it

    def _wait_ready(self) -> None:
        if not self._ready:
            if self._read(120) != "ready":
                raise RuntimeError(f"reward worker for {self.spec!r} failed to start")
            self._ready = True

    def _read(self, timeout: float):
        """One JSON message from the child, or None on timeout or death."""
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self._proc.stdout.readline()
        return json.loads(line) if line else None

    def _restart(self) -> None:
        self._proc.kill()
        self._proc.wait()
        self._start()

    def score(self, items: list[tuple[str, str | None, dict]]) -> list[tuple[float, bool]]:
        """(reward, failed) per item; failures and timeouts score 0.0."""
        out = []
        for item in items:
            self._wait_ready()
            self._proc.stdin.write(json.dumps(item, default=str) + "\n")
            self._proc.stdin.flush()
            msg = self._read(self.timeout_s)
            if msg is not None:
                ok, value = msg
                if ok:
                    out.append((value, False))
                    continue
                self.stats.failures += 1
                self._note(value)
            else:
                self.stats.timeouts += 1
                self._note(f"timed out after {self.timeout_s:.1f}s (or the verifier process died)")
                self._restart()
            out.append((0.0, True))
        return out

    def _note(self, err: str) -> None:
        self.stats.last_error = err
        if len(self.stats.errors) < 20:
            self.stats.errors.append(err)

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=2)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                self._proc.kill()
        self._proc = None
