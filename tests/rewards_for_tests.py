"""Reward functions used by the tests (imported by name, as users do: module:function)."""

import os
import resource
import subprocess
import time


def digit_fraction(completion: str, answer, metadata) -> float:
    """Dense, easy reward: the fraction of characters that are digits."""
    s = completion.replace(" ", "")
    return sum(ch.isdigit() for ch in s) / max(len(s), 1) if s else 0.0


def flaky(completion: str, answer, metadata) -> float:
    """Raises on some inputs: the run must survive and count the failures."""
    if len(completion) % 3 == 0:
        raise ValueError("flaky verifier")
    return 0.5


def hang_on(completion: str, answer, metadata) -> float:
    """Hangs on "hang", else scores 1."""
    if completion == "hang":
        time.sleep(60)
    return 1.0


def shell_out(completion: str, answer, metadata) -> float:
    """Writes to fd 1 the ways a verifier might: a shell command, a child process, a raw write."""
    os.system("echo hi")
    subprocess.run(["echo", "from a subprocess"])
    os.write(1, b"[true, 5.0]\n")
    return 1.0


def spawn_and_hang(completion: str, answer, metadata) -> float:
    """Starts `sleep <completion>` (a marker the test looks for), then hangs."""
    subprocess.Popen(["sleep", completion])
    time.sleep(60)
    return 1.0


def allocate_10gb(completion: str, answer, metadata) -> float:
    """10 GB, unless told otherwise; refuses without a memory limit (so a missing limit fails
    the test instead of eating the machine's memory)."""
    if completion != "small" and resource.getrlimit(resource.RLIMIT_AS)[0] == resource.RLIM_INFINITY:
        raise RuntimeError("no memory limit is set")
    return float(len(bytearray(1 << 20 if completion == "small" else 10 << 30)) > 0)


def not_a_number(completion: str, answer, metadata):
    return {"nan": float("nan"), "str": "high", "inf": float("inf")}[completion]


def half(completion: str, answer, metadata) -> float:
    return 0.5


def right(completion: str, answer, metadata) -> float:
    return 1.0
