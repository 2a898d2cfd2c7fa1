"""Verifiable rewards: a registry of verifiers, run isolated in a worker pool.

A reward function has the signature ``fn(completion: str, answer: str | None, metadata: dict)
-> float``: a real number (int, float, numpy's; True and False count as 1.0 and 0.0, since
``return pred == answer`` is how many verifiers are written). Built-ins: ``math`` and ``exact``;
a user's ``module:function`` (importable from the current directory) or
``path/to/file.py:function`` works too. Verifiers run in
``relayrl.workers.WorkerPool`` processes: ``workers`` calls at once, each with its own time
limit, memory limit and process group, optionally under bubblewrap. A call that raises,
returns anything else (a string such as "1.0" too: a verifier that returns text has a bug that
a conversion would hide) or a non-finite number, exceeds its time limit or runs out of memory is a
*failure*, never a reward of 0: its episode is left out of training and counted, and too many
stop the run (``relayrl.failures``).
"""

from __future__ import annotations

import logging
import math
import numbers
import sys
import threading
from dataclasses import dataclass, field
from typing import Callable

from relayrl.extras import require
from relayrl.envs.answers import extract_answer, last_boxed, reference_answer  # noqa: F401 (public here too)
from relayrl.workers import CallFailed, ImportFailed, PoolError, SandboxUnavailable, WorkerPool, load
from relayrl.workers.isolation import private_folders

# math-verify warns once per process that its own timeouts are off: they are, on purpose (a timeout of its own
# scored 0.0); the worker's deadline times every call. Its warning on every run's stderr says nothing to a user.
for _name in ("math_verify.grader", "math_verify.parser"):
    logging.getLogger(_name).setLevel(logging.ERROR)

RewardFn = Callable[[str, "str | None", dict], float]

def math_reward(completion: str, answer: str | None, metadata: dict) -> float:
    """1.0 if the extracted final answer is mathematically equivalent to ``answer`` (math-verify).
    A reference solution in GSM8K's format is compared by its final answer (``reference_answer``)."""
    if answer is None:
        raise ValueError("the 'math' reward needs an answer field")
    answer = reference_answer(str(answer))
    pred = extract_answer(completion)
    if pred is None:
        return 0.0
    if pred.strip() == str(answer).strip():
        return 1.0
    from math_verify import parse, verify

    # math-verify's own timeouts off: when one fired, it returned False (a correct answer scored 0.0, a training
    # signal); the worker's deadline (reward.timeout_s) bounds the call instead, and a call past it is a failure
    gold = parse(f"${answer}$", parsing_timeout=None)
    got = parse(f"${pred}$", parsing_timeout=None)
    return 1.0 if gold and got and verify(gold, got, timeout_seconds=None) else 0.0


def exact_reward(completion: str, answer: str | None, metadata: dict) -> float:
    """1.0 if the completion equals ``answer`` after whitespace normalisation."""
    if answer is None:
        raise ValueError("the 'exact' reward needs an answer field")
    return float(" ".join(completion.split()) == " ".join(str(answer).split()))


def reasoning_gym_reward(completion: str, answer: str | None, metadata: dict) -> float:
    """reasoning-gym's own scorer for rows of ``data.path=reasoning_gym:...`` (``envs.adapters.reasoning_gym``)."""
    from relayrl.rewards.reasoning_gym import score

    return score(completion, answer, metadata)


REWARDS: dict[str, RewardFn] = {"math": math_reward, "exact": exact_reward, "reasoning_gym": reasoning_gym_reward}


def resolve(spec: str) -> RewardFn:
    """A registry name, 'module:function' (importable from the current directory) or
    'path/to/file.py:function'. Imports into *this* process; ``RewardRunner`` does not use
    it, so a user's module never runs in the trainer."""
    if spec in REWARDS:
        return REWARDS[spec]
    _check_name(spec)
    try:
        return load(spec)
    except ImportFailed as e:
        raise ValueError(f"reward function {e}") from None


def _check_name(spec: str) -> None:
    if spec not in REWARDS and spec != "none" and ":" not in spec:
        raise ValueError(f"unknown reward {spec!r}; valid: none, {', '.join(REWARDS)} or 'module:function'")


def _score_one(spec: str | list, completion: str, answer: str | None, metadata: dict) -> float:
    """Runs in a worker: the verifier's value as a finite float (else an exception); with several
    (``[[spec, weight], ...]``) their weighted sum, any one's failure the call's. Workers run calls in their
    main thread, which a user's verifier may need: signal.alarm works there (the worker cancels any alarm
    left pending after each call)."""
    if isinstance(spec, list):
        return sum(weight * _score_one(one, completion, answer, metadata) for one, weight in spec)
    fn = REWARDS[spec] if spec in REWARDS else load(spec)
    return as_reward(fn(completion, answer, metadata))


SIGNATURE = "fn(completion: str, answer: str | None, metadata: dict) -> float, called once per response"


def _signature_problem(spec: str) -> str | None:
    """Runs in a worker, at start: why ``spec``'s function cannot be called as a verifier is (None: it can).
    TRL's reward functions (``fn(completions, **kwargs) -> list[float]``, a batch at a time) are refused here,
    before anything is sampled, with the signature to use."""
    import inspect

    fn = load(spec)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # (a builtin or C function: nothing to check)
        return None
    try:
        sig.bind("completion", "answer", {})
        return None
    except TypeError as e:
        why = str(e)
    trl = any(n in sig.parameters for n in ("completions", "prompts", "completion_ids"))
    return (f"reward.fn={spec!r} takes {fn.__name__}{sig} and cannot be called as {SIGNATURE} ({why})"
            + ("; it looks like TRL's reward function (a batch of completions, a list of floats): score one "
               "completion, e.g. `def score(completion, answer, metadata): return float(...)` — the row's other "
               "fields are in metadata (data.metadata_fields)" if trl else ""))


class NotAReward(ValueError):
    """A verifier returned something other than a finite real number: a failure of its code, like a raise."""


EXPECTED = "a reward must be a finite real number (int or float; True/False count as 1.0/0.0)"


def as_reward(value) -> float:
    """The verifier's return value as a float, or ``NotAReward`` saying what it returned."""
    np = sys.modules.get("numpy")  # (np.isclose(...) returns numpy's bool; a verifier using it imported numpy)
    if isinstance(value, bool) or (np is not None and isinstance(value, np.bool_)):
        return float(value)
    if not isinstance(value, numbers.Real):  # (numpy's numbers are registered as Real; str, None, tensors are not)
        try:
            shown = repr(value)
        except Exception:  # noqa: BLE001 - a repr that raises must not hide what was returned
            shown = "<unprintable>"
        shown = shown if len(shown) <= 80 else shown[:80] + "…"
        raise NotAReward(f"returned {type(value).__name__} {shown}: {EXPECTED}")
    value = float(value)
    if not math.isfinite(value):
        raise NotAReward(f"returned a non-finite reward {value}: {EXPECTED}")
    return value


_SCORE_ONE = "relayrl.rewards.verifiers:_score_one"
_SIGNATURE = "relayrl.rewards.verifiers:_signature_problem"
# (preload, imports, warm-up calls) the server runs once before forking, so workers start
# warm: math-verify's first call (lazy imports, caches) costs far more than the next ones
_WARM = {
    "math": (["relayrl.rewards.verifiers:math_reward"], ["math_verify"],
             [(_SCORE_ONE, ["math", r"\boxed{\frac{1}{2}}", "0.5", {}])]),
    "exact": (["relayrl.rewards.verifiers:exact_reward"], [], []),
    "reasoning_gym": (["relayrl.rewards.verifiers:reasoning_gym_reward"], ["reasoning_gym"], []),
}


@dataclass
class RewardStats:
    failures: int = 0
    timeouts: int = 0
    last_error: str | None = None
    errors: list[str] = field(default_factory=list)


class NoVerifier:
    """``reward.fn=none``: every completion's score is 0 (the reward is a judge's, or there is none: pure
    distillation); no worker pool."""

    spec = "none"

    def __init__(self):
        self.stats = RewardStats()

    def score(self, items: list) -> list[tuple[float, dict | None]]:
        return [(0.0, None) for _ in items]

    def close(self) -> None:
        pass


class RewardRunner:
    """Scores completions in an isolated worker pool (see ``relayrl.workers``).

    ``workers``: calls at once (0: the cores); ``memory_mb``: address space one call may add;
    ``sandbox``: "none" or "bwrap" (no network, read-only filesystem, the working folder and
    the home folder hidden as the ``python`` tool hides them, the verifier's own module kept
    readable; an error if bubblewrap is missing, never a silent fallback). What each mode
    guarantees: ``RewardCfg.sandbox`` (relayrl.config)."""

    def __init__(self, spec: str | list[str], timeout_s: float = 5.0, workers: int = 0, memory_mb: int = 4096,
                 sandbox: str = "none", start_timeout_s: float = 120.0, weights: list[float] | None = None):
        specs = spec if isinstance(spec, list) else [spec]
        for one in specs:
            _check_name(one)  # fail fast, in the parent, on an unknown name
        if "reasoning_gym" in specs:
            require("reasoning_gym", "reasoning-gym", "reward.fn=reasoning_gym")
        self.spec, self.timeout_s, self.memory_mb = spec, timeout_s, memory_mb
        # what a worker is called with: the spec, or with several [[spec, weight], ...] (reward.fn_weights)
        self._call = [[one, w] for one, w in zip(specs, weights or [1.0] * len(specs))] if isinstance(spec, list) \
            else spec
        self.stats = RewardStats()
        self._stats_lock = threading.Lock()
        preload, imports, warmup = [], [], []
        for one in specs:
            p, i, w = _WARM.get(one, ([one], [], []))
            preload, imports, warmup = preload + p, imports + i, warmup + w
        try:
            self._pool = WorkerPool([_SCORE_ONE, _SIGNATURE, *preload], workers=workers, timeout_s=timeout_s,
                                    memory_mb=memory_mb, sandbox=sandbox, imports=imports, warmup=warmup,
                                    hide_paths=private_folders() if sandbox == "bwrap" else (),
                                    start_timeout_s=start_timeout_s)
        except SandboxUnavailable as e:
            raise RuntimeError(f"reward.sandbox={sandbox} but {e}") from None
        except ImportFailed as e:
            raise ValueError(f"reward function {e}") from None
        except PoolError as e:  # the verifier's module ended the process (os._exit) or never finished importing
            raise ValueError(f"reward.fn={spec!r:.200}: its workers did not start: {e}") from None
        users = [[one] for one in specs if one not in REWARDS]  # callable as verifiers? (asked of a worker: a
        for problem in self._pool.map(_SIGNATURE, users, return_exceptions=True):  # user's module never runs here)
            if isinstance(problem, str):
                self._pool.close()
                raise ValueError(problem)

    def score(self, items: list[tuple[str, str | None, dict]]) -> list[tuple[float, dict | None]]:
        """(reward, None) per item, in order; a call that failed gives (nan, its failure: ``kind``
        reward or reward_timeout, ``source`` the verifier, ``error`` what happened)."""
        args = [[self._call, completion, answer, metadata] for completion, answer, metadata in items]
        out = []
        for result, (_, _, metadata) in zip(self._pool.map(_SCORE_ONE, args, return_exceptions=True), items):
            if isinstance(result, Exception):
                out.append((math.nan, self._count(result, metadata)))
                continue
            try:  # (checked again here: what comes back is JSON that a worker running user code wrote)
                out.append((as_reward(result), None))
            except NotAReward as e:
                out.append((math.nan, self._count(e)))
        return out

    def _count(self, err: Exception, metadata: dict | None = None) -> dict:
        timeout = isinstance(err, CallFailed) and err.kind == "timeout"
        oom = isinstance(err, CallFailed) and err.kind == "oom"
        text = f"killed: out of memory (reward.memory_mb={self.memory_mb})" if oom else str(err)
        if text.startswith("KeyError") and metadata is not None and "metadata" in text:
            text += (f"; metadata holds the row's fields named in data.metadata_fields, here "
                     f"{sorted(metadata) or 'none'}")
        text = text.removeprefix(f"{NotAReward.__name__}: ")  # ("returned str 'x': ..." says it: not a raise)
        if timeout:
            text = f"{text} (reward.timeout_s={self.timeout_s:g})"
        with self._stats_lock:
            if timeout:
                self.stats.timeouts += 1
            else:
                self.stats.failures += 1
            self.stats.last_error = text
            if len(self.stats.errors) < 20:
                self.stats.errors.append(text)
        shown = ",".join(self.spec) if isinstance(self.spec, list) else self.spec
        return {"kind": "reward_timeout" if timeout else "reward", "source": f"reward.fn={shown}", "error": text}

    def close(self) -> None:
        self._pool.close()
