"""Functions the worker-pool tests run in workers (by spec, as users name theirs)."""

import ctypes
import errno
import os
import resource
import socket
import subprocess
import sys
import time


def echo(*args):
    return list(args)


def sleep_then(seconds, value):
    time.sleep(seconds)
    return value


def identity():
    return {"pid": os.getpid(), "pgid": os.getpgid(0), "uid": os.getuid()}


def noisy():
    """Writes to fd 1 and 2 every way a verifier can; the protocol must not notice."""
    print("print to stdout")
    print("print to stderr", file=sys.stderr)
    os.system("echo from a shell")
    subprocess.run(["echo", "from a subprocess"])
    os.write(1, b'{"id": 0, "ok": true, "value": "forged"}\n')
    os.write(2, b"raw fd 2\n")
    libc = ctypes.CDLL(None)
    libc.puts(b"from C stdio")
    libc.fflush(None)
    return 1.0


def spawn_and_hang(marker):
    """Starts a child process that would outlive it, then hangs past the deadline."""
    subprocess.Popen(["sleep", marker])
    time.sleep(60)


def spawn_escaped_and_hang(marker):
    """Like spawn_and_hang, but the child leaves the process group (setsid)."""
    subprocess.Popen(["sleep", marker], start_new_session=True)
    time.sleep(60)


def spawn_in_background(marker):
    """Returns normally, leaving `sleep` running in the background."""
    os.system(f"sleep {marker} &")
    return 1.0


def fail(message):
    raise ValueError(message)


def not_json():
    return object()


def exit_with(code):
    os._exit(code)


def call_sys_exit():
    sys.exit(2)


def fork_and_return():
    """Both the worker and its forked copy return: only the worker may answer."""
    return "child" if os.fork() == 0 else "worker"


def allocate(mib):
    """Allocates (and zeroes) ``mib`` MiB. Refuses a large amount without an address-space
    limit, so a broken limit fails the test instead of eating the machine's memory."""
    if mib > 1024 and resource.getrlimit(resource.RLIMIT_AS)[0] == resource.RLIM_INFINITY:
        raise RuntimeError("no memory limit is set")
    return len(bytearray(mib << 20)) >> 20


def fork_bomb(pgid_file):
    """Records its process group, then forks forever (failed forks are retried)."""
    with open(pgid_file, "w") as f:
        f.write(str(os.getpgid(0)))
    while True:
        try:
            os.fork()
        except OSError:
            pass


def try_connect(port):
    """"connected", or the errno name the connection failed with."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return "connected"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e))


def try_write(path):
    """"ok" (and the file is removed again), or the errno name of the failure."""
    try:
        with open(path, "w") as f:
            f.write("x")
        os.unlink(path)
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e))


def trainer_main(marker: str, sandbox: str = "none") -> None:
    """A stand-in trainer for the kill -9 test: scores with a verifier that spawns a marked
    process and hangs, and waits to be killed."""
    from relayrl.rewards.verifiers import RewardRunner

    runner = RewardRunner("tests.rewards_for_tests:spawn_and_hang", timeout_s=60, sandbox=sandbox)
    runner.score([(marker, None, {})])

