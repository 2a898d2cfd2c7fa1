"""A verifier that does what its row's metadata asks (``metadata["do"]``): return a value, raise, hang, exit,
write to its worker's protocol pipe, leave a process behind... The fuzz tests (``tests/test_fuzz_verifiers.py``)
and ``benchmarks/fuzz.py`` run it in a real ``RewardRunner``. Loaded by file path: no package needed."""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np  # (here: the server imports this module before it forks, so no call pays numpy's import)

# what a verifier may return, by name (JSON cannot carry them from the test to the worker)
VALUES = {
    "nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "big int": 10 ** 400, "huge float": 1e308,
    "none": None, "str": "1.0", "list": [1.0], "dict": {"reward": 1}, "bytes": b"1", "complex": 1j,
    "true": True, "false": False, "tuple": (1,), "set": {1}, "object": object(),
}


class BadFloat(float):
    def __float__(self):
        raise RuntimeError("no float for you")


class BadRepr:
    def __repr__(self):
        raise RuntimeError("no repr for you")


def _numpy(kind: str):
    return {"np.float32": np.float32(0.5), "np.int64": np.int64(1), "np.bool_": np.bool_(True),
            "np.nan": np.float64("nan"), "np.array": np.array([1.0]), "np.float16 inf": np.float16(7e4)}[kind]


def score(completion: str, answer, metadata: dict):
    do, arg = metadata["do"], metadata.get("arg")
    if do == "return":
        return arg
    if do == "return named":
        return VALUES[arg]
    if do == "return numpy":
        return _numpy(arg)
    if do == "return bad float":
        return BadFloat(1.0)
    if do == "return bad repr":
        return BadRepr()
    if do == "raise":
        raise {"ValueError": ValueError, "SystemExit": SystemExit, "KeyboardInterrupt": KeyboardInterrupt,
               "GeneratorExit": GeneratorExit, "MemoryError": MemoryError, "RecursionError": RecursionError,
               "BaseException": BaseException}[arg]("boom")
    if do == "sleep":
        time.sleep(arg)
        return 1.0
    if do == "exit":
        os._exit(arg)
    if do == "sys.exit":
        sys.exit(arg)
    if do == "kill self":
        os.kill(os.getpid(), signal.SIGKILL)
    if do == "fake reply":  # a line on the worker's protocol pipe (fd 4), then the real return
        os.write(4, arg.encode())
        return 1.0
    if do == "close protocol":
        os.close(4)
        return 1.0
    if do == "print":
        print(arg)
        print(arg, file=sys.stderr)
        return 1.0
    if do == "fork":  # a child left behind: the worker is replaced, the value still counts
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        return 1.0
    if do == "alarm":
        signal.alarm(1)
        return 1.0
    if do == "memory":
        return len(bytearray(arg << 20))
    if do == "recurse":
        def down(n):
            return down(n + 1)
        return down(0)
    raise AssertionError(f"unknown behaviour {do!r}")
