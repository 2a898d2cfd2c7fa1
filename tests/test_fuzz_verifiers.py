"""Fuzzed verifiers: batches of calls that each return a value (numbers, numpy's, NaN, text, objects whose
``__float__`` or ``__repr__`` raises), raise (``SystemExit`` and ``KeyboardInterrupt`` too), hang, exit, kill
themselves, write to their worker's protocol pipe, fork, set alarms or run out of memory, in a real
``RewardRunner``. A call scores its number only when it returned a finite real number; anything else is a
counted failure, never a reward (no silent zero); ``score`` itself never raises, and the next call gets its
own value. Then the cases a first fuzzing pass found (issue 38)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relayrl.rewards.verifiers import RewardRunner

SPEC = f"{Path(__file__).parent / 'verifier_behaviours.py'}:score"
TIMEOUT_S, MEMORY_MB = 1.0, 256
BUDGET = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))

# (behaviour, argument) -> the reward it must score, or None: it must be a counted failure
GOOD = {("print", "x\n{\"ok\": true}"): 1.0, ("fork", None): 1.0, ("alarm", None): 1.0, ("sleep", 0.01): 1.0,
        ("memory", 8): float(8 << 20), ("return named", "huge float"): 1e308, ("return named", "true"): 1.0,
        ("return named", "false"): 0.0, ("return numpy", "np.float32"): 0.5, ("return numpy", "np.int64"): 1.0,
        ("return numpy", "np.bool_"): 1.0}
BAD = [("return named", k) for k in ("nan", "inf", "-inf", "big int", "none", "str", "list", "dict", "bytes",
                                     "complex", "tuple", "set", "object")] + \
      [("return numpy", k) for k in ("np.nan", "np.array", "np.float16 inf")] + \
      [("raise", k) for k in ("ValueError", "SystemExit", "KeyboardInterrupt", "GeneratorExit", "MemoryError",
                              "RecursionError", "BaseException")] + \
      [("return bad float", None), ("return bad repr", None), ("sleep", 3 * TIMEOUT_S), ("exit", 0), ("exit", 3),
       ("sys.exit", 0), ("kill self", None), ("close protocol", None), ("memory", 4 * MEMORY_MB), ("recurse", None)] + \
      [("fake reply", line) for line in ('{"ok": true, "value": NaN, "keep": true}\n', '{"ok": true, "value": 1.0}\n',
                                         '{"ok": true, "value": "x", "keep": true}\n', "[1, 2]\n", "garbage",
                                         '{"ok": true, "value": Infinity, "keep": true}\n')]
JSON_VALUES = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5) | st.lists(st.integers(),
                                                                                                      max_size=2)


def expected(do: str, arg) -> float | None:
    if do == "return":  # a JSON value given back as it came: a number only if bool or finite real
        if isinstance(arg, bool):
            return float(arg)
        if isinstance(arg, (int, float)):
            try:
                return float(arg) if math.isfinite(float(arg)) else None
            except OverflowError:
                return None
        return None
    return GOOD.get((do, arg))


CALLS = st.one_of(st.sampled_from(list(GOOD) + BAD), st.tuples(st.just("return"), JSON_VALUES))


@pytest.fixture(scope="module")
def runner():
    r = RewardRunner(SPEC, timeout_s=TIMEOUT_S, workers=2, memory_mb=MEMORY_MB)
    yield r
    r.close()


def score_problem(runner: RewardRunner, calls: list) -> str | None:
    """What is wrong with how ``runner`` scored ``calls`` (then four well-behaved calls); None: nothing."""
    items = [("text", None, {"do": do, "arg": arg}) for do, arg in calls]
    items += [("text", None, {"do": "return", "arg": 0.25})] * 4
    try:
        got = runner.score(items)
    except BaseException as e:  # noqa: BLE001 - score must never raise
        return f"score raised {type(e).__name__}: {e}"
    if len(got) != len(items):
        return f"{len(got)} results for {len(items)} calls"
    for (do, arg), (reward, failure) in zip(calls + [("return", 0.25)] * 4, got):
        want = expected(do, arg)
        if want is None and (failure is None or not math.isnan(reward)):
            return f"{do}({arg!r:.60}) scored {reward!r} without a failure: a silent reward"
        if want is not None and (failure is not None or reward != want):
            return f"{do}({arg!r:.60}) gave {reward!r}, {failure}: expected {want!r}"
        if failure is not None and (failure["kind"] not in ("reward", "reward_timeout") or not failure["error"]
                                    or failure["source"] != f"reward.fn={SPEC}"):
            return f"{do}({arg!r:.60}): a failure that does not say what failed: {failure}"
    return None


@BUDGET
@given(st.lists(CALLS, min_size=1, max_size=6))
def test_fuzzed_verifier_calls_score_their_number_or_fail_counted_never_silently(runner, calls):
    problem = score_problem(runner, calls)
    assert problem is None, f"{problem} (calls: {calls!r:.300})"


def test_every_known_behaviour_once(runner):
    """Each behaviour of the table at least once, whatever hypothesis drew."""
    for i in range(0, len(GOOD) + len(BAD), 8):
        calls = (list(GOOD) + BAD)[i:i + 8]
        assert score_problem(runner, calls) is None, calls


# ------------------------------------------------------------------- the cases issue 38 found, one by one

@pytest.mark.parametrize("line", ['{"ok": true, "value": NaN, "keep": true}\n', '{"ok": true, "value": "1.0"}\n',
                                  '{"ok": true, "value": [1], "keep": true}\n'])
def test_a_fake_reply_on_the_protocol_pipe_is_a_failure_and_the_next_call_gets_its_own_value(runner, line):
    """It was taken as the result (NaN and inf accepted; a string or list made ``score`` raise), and the next
    call on that worker got the previous call's value."""
    got = runner.score([("t", None, {"do": "fake reply", "arg": line}), ("t", None, {"do": "return", "arg": 0.75}),
                        ("t", None, {"do": "return", "arg": 0.5})])
    (r0, f0), rest = got[0], got[1:]
    assert math.isnan(r0) and f0["kind"] == "reward" and "protocol pipe" in f0["error"]
    assert rest == [(0.75, None), (0.5, None)]


@pytest.mark.parametrize("body, says", [("import sys\nsys.exit(3)\n", "SystemExit: 3"),
                                        ("raise KeyboardInterrupt\n", "KeyboardInterrupt"),
                                        ("import os\nos._exit(4)\n", "exited with code 4"),
                                        ("import time\ntime.sleep(60)\n", "did not finish within 2s")])
def test_a_verifier_module_that_exits_or_hangs_at_import_is_one_line_naming_reward_fn(tmp_path, body, says):
    """These were a PoolError traceback after up to 120 s."""
    import time

    from relayrl.cli import classify, error_line

    p = tmp_path / "verifier.py"
    p.write_text(body + "def score(c, a, m):\n    return 1.0\n")
    t0 = time.perf_counter()
    with pytest.raises(ValueError) as e:
        RewardRunner(f"{p}:score", start_timeout_s=2).close()
    assert time.perf_counter() - t0 < 15
    assert classify(e.value) == ("input", 2) and says in str(e.value) and str(p) in str(e.value)
    assert "\n" not in error_line("input", e.value)


def test_math_verify_timing_out_inside_a_verification_is_a_counted_failure_not_a_zero(tmp_path):
    """math-verify's own timeout made ``verify`` return False: a correct but slow answer scored 0.0. Here its
    default is cut to 1 s (as if it were slow), and the call must fail at relayrl's deadline instead."""
    p = tmp_path / "slow_math.py"
    p.write_text("import math_verify\nfrom relayrl.rewards.verifiers import math_reward\n"
                 "_verify, _parse = math_verify.verify, math_verify.parse\n"
                 "def _v(g, t, **kw):\n    kw.setdefault('timeout_seconds', 1)\n    return _verify(g, t, **kw)\n"
                 "def _p(x, **kw):\n    kw.setdefault('parsing_timeout', 1)\n    return _parse(x, **kw)\n"
                 "math_verify.verify, math_verify.parse = _v, _p\n"
                 "def score(c, a, m):\n    return math_reward(c, a, m)\n")
    r = RewardRunner(f"{p}:score", timeout_s=3, workers=1)
    try:
        (slow, failure), (right, ok) = r.score([(r"\boxed{9^{9^{9}}}", "3", {}), (r"\boxed{\frac{1}{2}}", "0.5", {})])
    finally:
        r.close()
    assert math.isnan(slow) and failure["kind"] == "reward_timeout"
    assert (right, ok) == (1.0, None)
