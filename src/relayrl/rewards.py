"""Verifiable rewards: a registry of verifiers run in a separate process with a time limit.

A reward function has the signature ``fn(completion: str, answer: str | None, metadata: dict)
-> float``. Built-ins: ``math`` and ``exact``; any importable ``module:function`` works too.
A function that raises, returns a non-number, or exceeds the time limit gives that sample
reward 0; the failure is counted and reported, and the run goes on. Functions run in a child
process so a hung one can be killed (a thread cannot be).
"""

from __future__ import annotations

import importlib
import math
import multiprocessing as mp
import re
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


def _worker(conn, spec: str) -> None:
    fn = resolve(spec)
    if fn is math_reward:
        import math_verify  # noqa: F401  (import before the first timed call)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            return
        completion, answer, metadata = msg
        try:
            value = float(fn(completion, answer, metadata))
            conn.send((True, value) if math.isfinite(value) else (False, f"non-finite reward {value}"))
        except Exception as e:  # a user's verifier failing must not kill the run
            conn.send((False, f"{type(e).__name__}: {e}"))


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
        self._ctx = mp.get_context("spawn")
        self._proc = None
        self._start()

    def _start(self) -> None:
        self._conn, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_worker, args=(child, self.spec), daemon=True)
        self._proc.start()
        child.close()
        if not self._conn.poll(120) or self._conn.recv() != "ready":
            raise RuntimeError(f"reward worker for {self.spec!r} failed to start")

    def _restart(self) -> None:
        self._proc.kill()
        self._proc.join()
        self._start()

    def score(self, items: list[tuple[str, str | None, dict]]) -> list[tuple[float, bool]]:
        """(reward, failed) per item; failures and timeouts score 0.0."""
        out = []
        for item in items:
            limit = self.timeout_s
            self._conn.send(item)
            if self._conn.poll(limit):
                ok, value = self._conn.recv()
                if ok:
                    out.append((value, False))
                    continue
                self.stats.failures += 1
                self._note(value)
            else:
                self.stats.timeouts += 1
                self._note(f"timed out after {limit:.1f}s")
                self._restart()
            out.append((0.0, True))
        return out

    def _note(self, err: str) -> None:
        self.stats.last_error = err
        if len(self.stats.errors) < 20:
            self.stats.errors.append(err)

    def close(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            try:
                self._conn.send(None)
                self._proc.join(timeout=2)
            except (BrokenPipeError, OSError):
                pass
            if self._proc.is_alive():
                self._proc.kill()
        self._proc = None
