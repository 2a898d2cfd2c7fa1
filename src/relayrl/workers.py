"""An isolated worker pool for user code (reward verifiers now, agent tools later).

``WorkerPool`` runs functions named by a spec (``"module:function"``, importable from the
current directory, or ``"path/to/file.py:function"``) in other processes, with a deadline,
resource limits and, optionally, a bubblewrap sandbox::

    pool = WorkerPool(preload=["my_reward:score"], workers=4, timeout_s=2.0)
    fut = pool.submit("my_reward:score", ["text", "42", {}])   # a concurrent.futures.Future
    value = fut.result()                  # or, in asyncio: await asyncio.wrap_future(fut)
    values = pool.map("my_reward:score", [[...], [...]], return_exceptions=True)
    pool.close()

A call that raises, exceeds its deadline, runs out of memory or dies fails its future with
``CallFailed`` (``.kind``: ``error`` | ``timeout`` | ``oom`` | ``crashed``); the pool goes on.
Futures cannot be cancelled (the deadline bounds every call).

Design
------
One *server* process per pool, started with ``subprocess.Popen([sys.executable, "-c", ...])``
rather than multiprocessing (which would re-import the trainer's ``__main__``), inside
bubblewrap when ``sandbox="bwrap"``. The server imports the preloaded functions once and runs
the optional warm-up calls, so everything it forks starts warm. It keeps ``workers`` *worker*
processes forked from itself, each the leader of its own process group, and runs calls on them
from a poll loop that also enforces every call's deadline. The trainer talks to the server
over two pipes of JSON lines tagged by call id; a reader thread resolves the futures. JSON,
never pickle, in every direction that carries data made by user code: unpickling a worker's
output in the trainer would hand the trainer to that code.

Why a worker runs several calls, one after another, instead of one fork per call (measured
on 2 cores with math_verify imported): a fork costs ~3.5 ms here and a fresh child's first
math_verify call ~20 ms (cold caches, copy-on-write faults) against ~0.6 ms warm; fork per
call scored 64 completions in 1.3 s, a warm worker pair in 18-33 ms (64 no-op calls: ~6 ms,
~0.1 ms a call). So a worker is reused until a call of it times out, crashes, runs out of
memory, or leaves a process or thread behind, or after ``calls_per_worker`` calls; then its
whole process group is killed and a fresh worker forked. Up to ``prefetch`` calls are queued
in a worker so that it goes on without a round trip through the server (each pipe write that
wakes another process costs ~0.1 ms on busy cores, as much as a warm call); only the first is
running and its deadline starts when it does; if the worker is killed, the calls queued
behind the failed one are moved to another worker (a call queued behind a slow one waits for
it, so latency-sensitive callers use ``prefetch=1``).

Isolation, per worker (and so per call):

- Deadline: wall clock, enforced by the server: at expiry the worker's process group is
  SIGKILLed. ``workers`` calls run at once, so N hanging calls cost ~ceil(N/workers) deadlines.
- Processes a call leaves behind are killed: a worker is a child subreaper, so whatever a call
  starts stays its descendant even when orphaned; if a child process (or a thread) is left
  after a call that returned, the worker's group is killed. A process that left the group
  (setsid) is orphaned to the server, a subreaper too, which kills it by pid.
- Limits (setrlimit): address space = what the worker already maps + ``memory_mb`` (RLIMIT_AS
  counts virtual memory, so the imports do not eat the budget); CPU time = the call's timeout
  rounded up + 1 s (a backstop; the wall deadline is what is enforced); file size 64 MiB; no
  core dumps.
- Output: fd 0 is /dev/null and fd 1/2 go to /dev/null or ``log_path``, so ``print``,
  ``os.system`` or a C library writing to fd 1 cannot touch the protocol, which uses its own
  close-on-exec pipes. Every other inherited fd is closed.
- Fork bombs: as root, RLIMIT_NPROC is not enforced, so a worker switches to uid/gid 65534
  (keeping only CAP_DAC_READ_SEARCH, so it can still read, e.g., a Python installed under a
  0700 /root; writes need a world-writable place such as /tmp) with RLIMIT_NPROC set and
  no_new_privs. Not root: the kernel already enforces the user's own process limit.
- Parent death: the server gets SIGTERM when the trainer thread that spawned it dies
  (PR_SET_PDEATHSIG; the pool spawns from one long-lived thread so that is the pool's life)
  and kills every worker group; EOF on its request pipe does the same. Workers get SIGKILL
  when the server dies. Under bwrap, ``--die-with-parent`` and the pid namespace add that
  nothing of the sandbox outlives bwrap.
- ``sandbox="bwrap"``: the server and workers run under bubblewrap: no network
  (``--unshare-net``), the host filesystem read-only, a private writable /tmp, own /dev,
  /proc, pid and IPC namespaces, a new session; as root only the capabilities the server
  needs to set workers up are kept. Asked for and unavailable is an error, never a fallback.

Limits of the guarantees: ``sandbox="none"`` is resource control, not a security boundary
(the code can read what the trainer can, and as root outside bwrap write world-writable
places and signal what uid 65534 owns). Calls of one worker share a process, so module state
one call leaves is seen by the next call of that worker. The RLIMIT_NPROC budget is shared
by every process of uid 65534 on the machine. Under ``none``, a grandchild process of an
in-flight call can outlive a server that is SIGKILLed itself (not the trainer: that path
cleans up); bwrap's pid namespace closes that.
"""

from __future__ import annotations

import ctypes
import errno
import importlib
import importlib.util
import itertools
import json
import math
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable

NOBODY = 65534  # the uid/gid workers switch to when the pool runs as root
FILE_SIZE_LIMIT = 64 << 20
MAX_REPLY_BYTES = 16 << 20  # a worker's reply larger than this is a protocol violation
SWEEP_FOR_S = 2.0  # after a kill, look for re-parented leftovers this long
_REQ_FD, _RES_FD = 3, 4  # the worker's private protocol pipes (close-on-exec)
_KINDS = ("error", "timeout", "oom", "crashed")

# prctl / capability constants (linux/prctl.h, linux/capability.h)
_PR_SET_PDEATHSIG, _PR_SET_KEEPCAPS, _PR_SET_CHILD_SUBREAPER = 1, 8, 36
_PR_SET_NO_NEW_PRIVS, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_RAISE = 38, 47, 2
_CAP_DAC_READ_SEARCH = 2
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
# what the bwrap'd server keeps as root: switch workers' uid/gid, kill them, read files
_SERVER_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_KILL", "CAP_DAC_READ_SEARCH")


class CallFailed(Exception):
    """A call that returned no value. ``kind``: error | timeout | oom | crashed."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class PoolError(RuntimeError):
    """The pool itself failed: its server could not start or died, or the pool is closed."""


class ImportFailed(ValueError):
    """A preloaded function spec cannot be imported (raised by the constructor)."""


class SandboxUnavailable(RuntimeError):
    """``sandbox="bwrap"`` was asked for but bubblewrap is missing or cannot run here."""


# ---------------------------------------------------------------- loading functions by spec

_loaded: dict[str, Callable] = {}


def load(spec: str, cwd: str | None = None) -> Callable:
    """The function named by ``"module:function"`` (importable from ``cwd``, like ``python -c``)
    or ``"path/to/file.py:function"`` (relative to ``cwd``, or absolute). Cached per process, so
    what the server loads before forking is free in its workers."""
    fn = _loaded.get(spec)
    if fn is None:
        fn = _loaded[spec] = _import(spec, os.path.abspath(cwd or os.getcwd()))
    return fn


def _import(spec: str, cwd: str) -> Callable:
    target, sep, name = spec.rpartition(":")
    if not (sep and target and name):
        raise ImportFailed(f"{spec!r} is not 'module:function' or 'path/to/file.py:function'")
    try:
        if target.endswith(".py") or "/" in target:
            module = _import_file(os.path.join(cwd, os.path.expanduser(target)))
        else:
            if cwd not in sys.path:
                sys.path.insert(0, cwd)
            module = importlib.import_module(target)
        fn = getattr(module, name)
    except Exception as e:  # any failure of the user's module is reported the same way
        raise ImportFailed(f"{spec!r} cannot be imported: {_describe(e)}") from None
    if not callable(fn):
        raise ImportFailed(f"{spec!r} is not callable")
    return fn


def _import_file(path: str):
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no file {path}")
    folder, stem = os.path.split(os.path.splitext(path)[0])
    if folder not in sys.path:
        sys.path.insert(0, folder)  # so the file can import its neighbours
    # a private module name: a user's math.py must not replace the stdlib's math
    name = f"relayrl_user_{stem}_{abs(hash(path)):x}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickle look the module up by name
    spec.loader.exec_module(module)
    return module


def _describe(e: BaseException) -> str:
    try:
        text = str(e)
    except Exception:
        text = "<unprintable>"
    return f"{type(e).__name__}: {text}"[:2000] if text else type(e).__name__


# ---------------------------------------------------------------- the trainer's side


class _Server:
    """One running server process, as the trainer sees it."""

    def __init__(self, proc: subprocess.Popen, requests, replies):
        self.proc, self._requests, self._replies = proc, requests, replies
        self._pending: dict[int, Future] = {}
        self._plock = threading.Lock()  # never held during I/O (no deadlock with the reader)
        self._wlock = threading.Lock()
        self.dead = False
        self.closing = False
        self.reader = threading.Thread(target=self._read_replies, name="worker-pool-reader", daemon=True)
        self.reader.start()

    def register(self, futures: dict[int, Future]) -> bool:
        with self._plock:
            if self.dead:
                return False
            self._pending.update(futures)
            return True

    def send(self, line: bytes) -> None:
        with self._wlock:
            try:
                self._requests.write(line)
                self._requests.flush()
            except OSError:
                pass  # the server died: the reader fails this call at EOF

    def _read_replies(self) -> None:
        try:
            for line in self._replies:
                msg = json.loads(line)
                with self._plock:
                    fut = self._pending.pop(msg["id"], None)
                if fut is None:
                    continue
                if msg["ok"]:
                    fut.set_result(msg["value"])
                else:
                    fut.set_exception(CallFailed(msg["kind"], msg["error"]))
        finally:
            self._on_eof()

    def _on_eof(self) -> None:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        with self._plock:
            self.dead = True
            pending, self._pending = self._pending, {}
        if self.closing:
            err = PoolError("the worker pool was closed")
        else:
            err = PoolError(f"the worker pool's server died (exit code {code}); "
                            "its calls failed and it restarts on the next call")
        for fut in pending.values():
            fut.set_exception(err)

    def stop(self) -> None:
        """EOF on the request pipe: the server kills its workers and exits."""
        self.closing = True
        with self._wlock:
            try:
                self._requests.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.reader.join(timeout=10)
        self._replies.close()


class WorkerPool:
    """Runs functions by spec in isolated worker processes; see the module docstring.

    ``preload``: specs imported by the server at start (an un-importable one raises
    ``ImportFailed`` here); others are imported by a worker on first use. ``imports``: modules
    the server imports too. ``warmup``: ``(spec, args)`` calls the server runs once before
    forking (to fill lazy imports and caches; results and errors ignored). ``workers``: calls
    at once (0: the cores this process may use). ``timeout_s``: default per-call deadline.
    ``memory_mb``: address space a worker may add. ``sandbox``: "none" or "bwrap".
    ``log_path``: where the workers' fd 1/2 go (default /dev/null). ``cwd``: where specs are
    resolved (default: the current directory). ``prefetch``: calls queued in a worker at once
    (1: a call is sent only when the previous one finished; more saves pipe round trips).
    ``calls_per_worker``: a worker is replaced after this many calls. ``procs_per_worker``:
    the RLIMIT_NPROC budget per worker when running as root."""

    def __init__(self, preload: Iterable[str] = (), *, workers: int = 0, timeout_s: float = 5.0,
                 memory_mb: int = 4096, sandbox: str = "none", imports: Iterable[str] = (),
                 warmup: Iterable[tuple[str, list]] = (), log_path: str | None = None, cwd: str | None = None,
                 prefetch: int = 4, calls_per_worker: int = 500, procs_per_worker: int = 64,
                 start_timeout_s: float = 120.0):
        if sandbox not in ("none", "bwrap"):
            raise ValueError(f"sandbox must be 'none' or 'bwrap', not {sandbox!r}")
        self.workers = workers or len(os.sched_getaffinity(0))
        self.timeout_s, self.memory_mb, self.sandbox = float(timeout_s), int(memory_mb), sandbox
        self.cwd = os.path.abspath(cwd or os.getcwd())
        self._preload, self._imports = list(preload), list(imports)
        self._warmup = [[fn, list(args)] for fn, args in warmup]
        self._prefetch, self._calls_per_worker, self._procs_per_worker = prefetch, calls_per_worker, procs_per_worker
        self._start_timeout_s = start_timeout_s
        self._log = open(log_path, "ab") if log_path else None
        self._prefix = _bwrap_prefix(self._binds()) if sandbox == "bwrap" else []
        if self._prefix:
            _check_bwrap(self._prefix)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._closed = False
        # every server is spawned from this one long-lived thread: PR_SET_PDEATHSIG (and bwrap's
        # --die-with-parent) fire when the spawning *thread* exits, not the process
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix="worker-pool-spawner")
        self._server: _Server | None = None
        try:
            self._server = self._spawner.submit(self._spawn).result()
        except BaseException:
            self._spawner.shutdown()
            if self._log:
                self._log.close()
            raise

    # -- public

    def submit(self, fn: str, args: Iterable = (), timeout_s: float | None = None) -> Future:
        """Run ``fn(*args)`` in a worker; the Future gets its JSON result or ``CallFailed``
        (``PoolError`` if the server dies meanwhile). Arguments travel as JSON (what JSON
        cannot represent is sent as its ``str()``). In asyncio code:
        ``await asyncio.wrap_future(pool.submit(...))``."""
        return self._submit_all(fn, [args], timeout_s)[0]

    def map(self, fn: str, arg_lists: Iterable[Iterable], timeout_s: float | None = None,
            return_exceptions: bool = False) -> list:
        """``fn(*args)`` for each, run in parallel, results in order. A failed call raises its
        exception, or with ``return_exceptions`` stands in the list in place of its result."""
        out = []
        for fut in self._submit_all(fn, arg_lists, timeout_s):
            try:
                out.append(fut.result())
            except (CallFailed, PoolError) as e:
                if not return_exceptions:
                    raise
                out.append(e)
        return out

    def _submit_all(self, fn: str, arg_lists: Iterable[Iterable], timeout_s: float | None) -> list[Future]:
        """One write for all the calls: each pipe write that wakes the server costs ~0.1 ms."""
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        if not (timeout > 0 and math.isfinite(timeout)):
            raise ValueError(f"timeout_s must be a positive number, not {timeout_s!r}")
        calls = [(next(self._ids), list(args)) for args in arg_lists]
        data = "".join(json.dumps({"id": i, "fn": fn, "args": args, "timeout": timeout}, default=str) + "\n"
                       for i, args in calls).encode()
        futures = [Future() for _ in calls]
        for fut in futures:
            fut.set_running_or_notify_cancel()  # not cancellable: the deadline bounds every call
        while True:
            server = self._live_server()
            if server.register({i: fut for (i, _), fut in zip(calls, futures)}):
                break
        server.send(data)
        return futures

    @property
    def server_pid(self) -> int | None:
        """Pid of the server process (of bwrap, under bwrap), for diagnostics."""
        server = self._server
        return None if server is None or server.dead else server.proc.pid

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            server, self._server = self._server, None
        if server is not None:
            server.stop()
        self._spawner.shutdown()
        if self._log:
            self._log.close()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the server's life

    def _live_server(self) -> _Server:
        with self._lock:
            if self._closed:
                raise PoolError("the worker pool is closed")
            if self._server is None or self._server.dead:
                self._server = self._spawner.submit(self._spawn).result()
            return self._server

    def _binds(self) -> list[str]:
        """Folders bwrap must show although they lie under the private /tmp: the cwd and the
        folders of file specs (read-only, like the rest of the host)."""
        folders = {self.cwd} | {os.path.dirname(os.path.join(self.cwd, s.rpartition(":")[0]))
                                for s in self._preload if s.rpartition(":")[0].endswith(".py")}
        return sorted(f for f in folders if f == "/tmp" or f.startswith("/tmp/"))

    def _spawn(self) -> _Server:
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        root = os.geteuid() == 0
        cfg = {
            "fds": [req_r, rep_w], "cwd": self.cwd, "preload": self._preload, "imports": self._imports,
            "warmup": self._warmup, "workers": self.workers, "memory_mb": self.memory_mb,
            "prefetch": max(1, self._prefetch), "calls_per_worker": self._calls_per_worker,
            "parent_pid": None if self._prefix else os.getpid(),  # under bwrap the parent is bwrap
            "drop_uid": NOBODY if root else None,
            # RLIMIT_NPROC counts every task of the uid on the machine: what it runs already + a budget
            "nproc": _count_tasks(NOBODY) + self.workers * self._procs_per_worker if root else None,
        }
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        cmd = self._prefix + [sys.executable, "-c", _BOOT, json.dumps(cfg), package_root]
        try:
            proc = subprocess.Popen(cmd, pass_fds=(req_r, rep_w), stdin=subprocess.DEVNULL,
                                    stdout=self._log or subprocess.DEVNULL, stderr=self._log, cwd=self.cwd)
        finally:
            os.close(req_r)
            os.close(rep_w)
        requests, replies = open(req_w, "wb"), open(rep_r, "rb")
        try:
            ready = _read_ready(proc, replies, self._start_timeout_s)
        except BaseException:
            requests.close()
            replies.close()
            proc.kill()
            proc.wait()
            raise
        if ready["errors"]:
            requests.close()
            replies.close()
            proc.wait()
            raise ImportFailed(next(iter(ready["errors"].values())))
        return _Server(proc, requests, replies)


def _read_ready(proc: subprocess.Popen, replies, timeout: float) -> dict:
    readable, _ = _poll([replies.fileno()], [], timeout)
    line = replies.readline() if readable else b""
    if line:
        return json.loads(line)
    if not readable:
        raise PoolError(f"the worker pool's server did not start within {timeout:.0f}s (slow imports?)")
    raise PoolError(f"the worker pool's server exited with code {proc.wait()} before it was ready "
                    "(its stderr is above)")


def _poll(reads: list[int], writes: list[int], timeout: float | None) -> tuple[set[int], set[int]]:
    """select() for any fd number (select.select fails on fds >= 1024, which a busy trainer
    may well hand us). An fd that hung up or failed counts as readable: the read says how."""
    poller = select.poll()
    for fd in reads:
        poller.register(fd, select.POLLIN)
    for fd in writes:
        poller.register(fd, select.POLLOUT | (select.POLLIN if fd in reads else 0))
    events = poller.poll(None if timeout is None else math.ceil(timeout * 1000))
    readable = {fd for fd, ev in events if ev & (select.POLLIN | select.POLLHUP | select.POLLERR) and fd in reads}
    writable = {fd for fd, ev in events if ev & (select.POLLOUT | select.POLLERR | select.POLLHUP) and fd in writes}
    return readable, writable


def _count_tasks(uid: int) -> int:
    """Tasks (threads) whose real uid is ``uid``: what RLIMIT_NPROC counts."""
    n = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue  # it exited
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            n += int(fields.get("Threads", "1"))
    return n


def _bwrap_prefix(binds: list[str]) -> list[str]:
    if shutil.which("bwrap") is None:
        raise SandboxUnavailable("bubblewrap is not installed: apt-get install bubblewrap")
    cmd = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--perms", "1777", "--tmpfs", "/tmp",
           "--unshare-net", "--unshare-pid", "--unshare-ipc", "--new-session", "--die-with-parent"]
    for folder in binds:
        cmd += ["--ro-bind", folder, folder]
    if os.geteuid() == 0:  # bwrap run by root keeps every capability unless told otherwise
        cmd += ["--cap-drop", "ALL"] + [a for cap in _SERVER_CAPS for a in ("--cap-add", cap)]
    return cmd + ["--"]


def _check_bwrap(prefix: list[str]) -> None:
    """A trial run: bwrap may be installed yet unable to sandbox (no user namespaces, seccomp)."""
    try:
        r = subprocess.run(prefix + ["true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SandboxUnavailable(f"bubblewrap cannot start a sandbox here: {e}") from None
    if r.returncode != 0:
        raise SandboxUnavailable(f"bubblewrap cannot start a sandbox here (exit code {r.returncode}): "
                                 f"{r.stderr.strip()[:500]}")


# ---------------------------------------------------------------- the server process

_BOOT = ("import sys; sys.path.append(sys.argv[2]); "
         "from relayrl.workers import _serve; _serve(sys.argv[1])")

_libc = ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, arg: int = 0) -> None:
    if _libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0),
                   ctypes.c_ulong(0)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}): {os.strerror(err)}")


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """The kernel sends ``sig`` to this process when the thread that started it exits; and if the
    parent is already gone (it died before this call), exit now."""
    _prctl(_PR_SET_PDEATHSIG, int(sig))
    if os.getppid() != parent_pid:
        os._exit(0)


class _Shutdown(BaseException):
    """SIGTERM (the trainer died, or someone asked): leave the loop through its cleanup."""


def _on_sigterm(signum, frame):
    raise _Shutdown


def _serve(cfg_json: str) -> None:
    cfg = json.loads(cfg_json)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it closes us
    signal.signal(signal.SIGTERM, _on_sigterm)
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)  # SIGTERM, not SIGKILL: we clean up our workers first
    if cfg["parent_pid"] is not None and os.getppid() != cfg["parent_pid"]:
        return  # the trainer died before the line above
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)  # what a call orphans comes to us, to be killed
    try:
        errors = _preload(cfg)
        _write_all(cfg["fds"][1], json.dumps({"ready": True, "errors": errors}).encode() + b"\n")
        if not errors:
            _Loop(cfg).run()
    except (_Shutdown, BrokenPipeError):
        pass  # told to stop, or the trainer is gone: nothing to report to


def _preload(cfg: dict) -> dict[str, str]:
    errors = {}
    for name in cfg["imports"]:
        try:
            importlib.import_module(name)
        except Exception as e:
            errors[name] = f"{name!r} cannot be imported: {_describe(e)}"
    for spec in cfg["preload"]:
        try:
            load(spec, cfg["cwd"])
        except ImportFailed as e:
            errors[spec] = str(e)
    for spec, args in [] if errors else cfg["warmup"]:
        try:
            load(spec, cfg["cwd"])(*args)
        except Exception:
            pass  # warming only; the real calls report their own errors
    return errors


class _Worker:
    """A forked worker as the server sees it (its pid is also its process group)."""

    def __init__(self, pid: int, to_child: int, from_child: int):
        self.pid, self.to_child, self.from_child = pid, to_child, from_child
        self.out = bytearray()  # request bytes not yet written (non-blocking pipe)
        self.buf = bytearray()  # reply bytes read so far
        self.calls: deque[dict] = deque()  # sent, in order; the first one is running
        self.deadline = math.inf  # of the running call
        self.done = 0
        self.eof = False


class _Loop:
    """The server's poll loop: requests in, calls to workers, deadlines, replies out.

    A worker is sent up to ``prefetch`` calls at once, so it goes from one call to the next
    without waiting for the server, and each pipe write carries several calls (on 2 busy
    cores a pipe write that wakes another process costs ~0.1 ms, the price of a whole warm
    verifier call). Only the first is running; its deadline starts when it does. When a
    worker is killed, the calls queued behind the one that failed go to another worker."""

    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.requests, self.replies = cfg["fds"]
        self.inbuf = bytearray()
        self.queue: deque[dict] = deque()
        self.outbox: list[bytes] = []  # replies to the trainer, written once per loop turn
        self.slots: list[_Worker | None] = [None] * cfg["workers"]
        self.sweep_until = 0.0
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)  # SIGCHLD wakes poll
        signal.signal(signal.SIGCHLD, lambda *_: None)

    def run(self) -> None:
        try:
            for i in range(len(self.slots)):
                self.slots[i] = self._fork()  # warm workers before the first call
            while self._step():
                pass
        finally:
            self._shutdown()

    def _step(self) -> bool:
        self._dispatch()
        if self.outbox:
            _write_all(self.replies, b"".join(self.outbox))
            self.outbox.clear()
        live = [w for w in self.slots if w is not None]
        reads = [self.requests, self.wake_r] + [w.from_child for w in live if not w.eof]
        writes = [w.to_child for w in live if w.out]
        readable, writable = _poll(reads, writes, self._wait_s(live))
        if self.wake_r in readable:
            _drain(self.wake_r)
        self._reap()
        for w in live:
            if w.from_child in readable and w in self.slots:
                self._read_worker(w)
            if w.to_child in writable and w in self.slots:
                self._flush(w)
        self._expire()
        if time.monotonic() < self.sweep_until:
            self._sweep()
        return self.requests not in readable or self._read_requests()

    def _wait_s(self, live: list[_Worker]) -> float | None:
        deadline = min([w.deadline for w in live] + [math.inf])
        if time.monotonic() < self.sweep_until:
            deadline = min(deadline, time.monotonic() + 0.05)
        return None if deadline == math.inf else max(0.0, deadline - time.monotonic())

    # -- requests and replies

    def _read_requests(self) -> bool:
        data = os.read(self.requests, 1 << 20)
        if not data:
            return False  # EOF: the pool closed, or the trainer died
        self.inbuf += data
        *lines, rest = self.inbuf.split(b"\n")
        self.inbuf = bytearray(rest)
        self.queue.extend(json.loads(line) for line in lines)
        return True

    def _reply(self, call: dict, msg: dict) -> None:
        self.outbox.append(json.dumps({"id": call["id"], **msg}).encode() + b"\n")

    # -- workers

    def _dispatch(self) -> None:
        """Queued calls to the least loaded workers, one at a time, up to ``prefetch`` each
        (so a batch spreads over every worker instead of filling the first one)."""
        if not self.queue:
            return
        for i, w in enumerate(self.slots):
            if w is None:
                self.slots[i] = self._fork()
        while self.queue:
            w = min(self.slots, key=lambda w: len(w.calls))
            if len(w.calls) >= self.cfg["prefetch"]:
                break
            self._send(w, self.queue.popleft())
        for w in self.slots:
            self._flush(w)

    def _fork(self) -> _Worker:
        to_r, to_w = os.pipe()
        from_r, from_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker: never returns into the server's code
            try:
                os.close(to_w)
                os.close(from_r)
                _worker_main(self.cfg, to_r, from_w)
            finally:
                os._exit(70)
        try:
            os.setpgid(pid, pid)  # also done by the worker; whichever runs first wins the race
        except OSError:
            pass
        os.close(to_r)
        os.close(from_w)
        os.set_blocking(to_w, False)
        os.set_blocking(from_r, False)
        return _Worker(pid, to_w, from_r)

    def _send(self, w: _Worker, call: dict) -> None:
        if not w.calls:
            w.deadline = time.monotonic() + call["timeout"]
        w.calls.append(call)
        w.out += json.dumps({"fn": call["fn"], "args": call["args"], "timeout": call["timeout"]}).encode() + b"\n"

    def _flush(self, w: _Worker) -> None:
        if not w.out:
            return
        try:
            del w.out[:os.write(w.to_child, w.out)]
        except BlockingIOError:
            pass  # the rest goes when poll says the pipe has room
        except OSError:
            w.out.clear()  # the worker is gone; reaping it fails its call

    def _read_worker(self, w: _Worker) -> bool:
        """Read what the worker wrote and act on complete replies; False if nothing came."""
        try:
            data = os.read(w.from_child, 1 << 20)
        except BlockingIOError:
            return False
        if not data:
            w.eof = True
            return False
        w.buf += data
        while b"\n" in w.buf and w in self.slots:
            line, _, rest = bytes(w.buf).partition(b"\n")
            w.buf = bytearray(rest)
            if not w.calls:
                self._retire(w)  # output nobody asked for: a forked copy of the worker, or tampering
                return True
            self._finish(w, line)
        if len(w.buf) > MAX_REPLY_BYTES and w in self.slots:
            self._retire(w, ("crashed", f"reply larger than {MAX_REPLY_BYTES >> 20} MiB"))
        return True

    def _finish(self, w: _Worker, line: bytes) -> None:
        call = w.calls.popleft()
        w.done += 1
        w.deadline = time.monotonic() + w.calls[0]["timeout"] if w.calls else math.inf
        msg, keep = _parse_reply(line)
        if msg.get("kind") == "oom":
            msg["error"] = f"killed: out of memory (memory_mb={self.cfg['memory_mb']})"
        if not keep or w.done >= self.cfg["calls_per_worker"]:
            self._retire(w)  # it left something behind, or has served long enough
        self._reply(call, msg)

    def _expire(self) -> None:
        for w in list(self.slots):
            if w is not None and time.monotonic() >= w.deadline:
                self._read_worker(w)  # a reply that came in just now still counts
                if w in self.slots and time.monotonic() >= w.deadline:
                    self._retire(w, ("timeout", f"timed out after {w.calls[0]['timeout']:g}s"))

    def _retire(self, w: _Worker, failure: tuple[str, str] | None = None) -> None:
        """Kill the worker's whole process group. Its running call fails with ``failure``
        (kind, error); the calls queued behind it, never started, go back to the queue."""
        _killpg(w.pid)
        os.close(w.to_child)
        os.close(w.from_child)
        self.slots[self.slots.index(w)] = None
        self.sweep_until = time.monotonic() + SWEEP_FOR_S
        if w.calls and failure is not None:
            kind, error = failure
            self._reply(w.calls.popleft(), {"ok": False, "kind": kind, "error": error})
        self.queue.extendleft(reversed(w.calls))

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            w = next((w for w in self.slots if w is not None and w.pid == pid), None)
            if w is not None:
                self._exited(w, status)

    def _exited(self, w: _Worker, status: int) -> None:
        while w in self.slots and w.calls and self._read_worker(w):
            pass  # it may have replied just before exiting
        if w in self.slots:
            self._retire(w, _death(status))

    def _sweep(self) -> None:
        """After a kill: processes that left their group (setsid) and were orphaned come to us
        (child subreaper); kill them by pid, never by a group we did not make (it could be
        the trainer's). What stays in a worker's group dies with the group."""
        workers = {w.pid for w in self.slots if w is not None}
        for pid in _children() - workers:
            state, pgid = _state_and_group(pid)
            if state not in (None, "Z") and pgid not in workers:
                _kill(pid)

    def _shutdown(self) -> None:
        for w in self.slots:
            if w is not None:
                _killpg(w.pid)
        end = time.monotonic() + SWEEP_FOR_S
        while time.monotonic() < end:
            kids = [pid for pid in _children() if _state_and_group(pid)[0] not in (None, "Z")]
            if not kids:
                break
            for pid in kids:
                _kill(pid)
            self._reap()
            time.sleep(0.01)


def _parse_reply(line: bytes) -> tuple[dict, bool]:
    """A worker's reply, checked: it comes from the process that ran user code."""
    try:
        msg = json.loads(line)
        keep = msg.get("keep") is True
        if msg.get("ok") is True and "value" in msg:
            return {"ok": True, "value": msg["value"]}, keep
        kind = msg["kind"] if msg.get("kind") in _KINDS else "error"
        return {"ok": False, "kind": kind, "error": str(msg.get("error"))[:2000]}, keep
    except (ValueError, AttributeError, TypeError, KeyError):
        return {"ok": False, "kind": "crashed", "error": "malformed reply from the worker"}, False


def _death(status: int) -> tuple[str, str]:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU:
            return "timeout", "exceeded its CPU time limit"
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        return "crashed", f"the worker process was killed by {name}"
    return "crashed", f"the worker process exited with code {os.waitstatus_to_exitcode(status)}"


def _children() -> set[int]:
    try:
        with open(f"/proc/self/task/{os.getpid()}/children") as f:
            return {int(p) for p in f.read().split()}
    except OSError:
        return set()


def _state_and_group(pid: int) -> tuple[str | None, int]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()  # after "(comm)", which may hold spaces
    except OSError:
        return None, -1
    return fields[0], int(fields[2])


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass  # already gone


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


# ---------------------------------------------------------------- a worker process


def _worker_main(cfg: dict, req_fd: int, res_fd: int) -> None:
    """Set up the isolation, then run calls one at a time until told to stop."""
    os.setpgid(0, 0)
    server = os.getppid()
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    _install_fds(req_fd, res_fd)
    setup_error = None
    try:
        _limit_resources(cfg["memory_mb"])
        if cfg["drop_uid"] is not None:
            _drop_root(cfg["drop_uid"], cfg["nproc"])
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # after the uid switch, which clears it
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)  # what a call orphans stays ours: _left_behind sees it
    except Exception as e:
        setup_error = f"worker setup failed: {_describe(e)}"
    if os.getppid() != server:
        os._exit(0)  # the server died while we started
    me = os.getpid()
    requests = open(_REQ_FD, "rb")
    for line in requests:
        if setup_error:
            reply, keep = {"ok": False, "kind": "crashed", "error": setup_error}, False
        else:
            reply, keep = _run_call(json.loads(line))
        if os.getpid() != me:
            os._exit(0)  # a copy the user's code forked must not speak the protocol
        _write_all(_RES_FD, _encode_reply(reply, keep))
        if not keep:
            break
    os._exit(0)


def _install_fds(req_fd: int, res_fd: int) -> None:
    """fd 0: /dev/null; fd 1/2: the server's stdout (/dev/null or the log); the protocol on
    close-on-exec fds 3/4 (so os.system & co never see them); everything else closed."""
    null = os.open(os.devnull, os.O_RDWR)
    high = [os.dup(fd) for fd in (null, 1, req_fd, res_fd)]  # out of the way of the targets
    null, out, req, res = high
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.dup2(req, _REQ_FD, inheritable=False)
    os.dup2(res, _RES_FD, inheritable=False)
    os.closerange(_RES_FD + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])


def _limit_resources(memory_mb: int) -> None:
    mapped = _vm_size_bytes()
    resource.setrlimit(resource.RLIMIT_AS, (mapped + (memory_mb << 20),) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT,) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _vm_size_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _limit_cpu(timeout: float) -> None:
    """CPU time for this call: what the worker used so far + the timeout rounded up + 1 s."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = math.ceil(usage.ru_utime + usage.ru_stime + timeout) + 1
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _drop_root(uid: int, nproc: int) -> None:
    """Root ignores RLIMIT_NPROC; uid ``uid`` does not. Keep CAP_DAC_READ_SEARCH (also across
    exec, as an ambient capability) so reading, e.g. a Python under a 0700 /root, still works.
    Where the switch is refused (root of a user namespace without that uid) we stay as we are:
    there the kernel enforces RLIMIT_NPROC anyway, as the uid is not the host's root."""
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    _prctl(_PR_SET_KEEPCAPS, 1)
    try:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EINVAL):
            raise
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    data[0].effective = data[0].permitted = data[0].inheritable = 1 << _CAP_DAC_READ_SEARCH
    if _libc.capset(ctypes.byref(header), data) == 0:
        # ambient: programs the call execs keep it too (fails quietly before Linux 4.3)
        _libc.prctl(ctypes.c_int(_PR_CAP_AMBIENT), ctypes.c_ulong(_PR_CAP_AMBIENT_RAISE),
                    ctypes.c_ulong(_CAP_DAC_READ_SEARCH), ctypes.c_ulong(0), ctypes.c_ulong(0))
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)  # setuid binaries cannot give root back


def _run_call(req: dict) -> tuple[dict, bool]:
    """Run one call; (reply, keep the worker). Any failure of user code becomes a reply."""
    _limit_cpu(req["timeout"])
    try:
        reply, keep = {"ok": True, "value": load(req["fn"])(*req["args"])}, True
    except MemoryError:
        reply, keep = {"ok": False, "kind": "oom", "error": "out of memory"}, False
    except BaseException as e:  # SystemExit and KeyboardInterrupt too: user code must not end us
        reply, keep = {"ok": False, "kind": "error", "error": _describe(e)}, True
    signal.setitimer(signal.ITIMER_REAL, 0)  # an alarm left pending would kill the next call
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    return reply, keep and not _left_behind()


def _encode_reply(reply: dict, keep: bool) -> bytes:
    try:
        data = json.dumps({**reply, "keep": keep})
    except (TypeError, ValueError, RecursionError) as e:
        data = json.dumps({"ok": False, "kind": "error", "error": f"the result is not JSON: {_describe(e)}",
                           "keep": keep})
    return data.encode() + b"\n"


def _left_behind() -> bool:
    """Did the call leave a thread or a process behind? The worker is a child subreaper, so
    anything the call started and orphaned is its child too, zombie or not."""
    if threading.active_count() > 1:
        return True
    try:
        with open(f"/proc/self/task/{os.getpid()}/children") as f:
            return bool(f.read().strip())
    except OSError:
        return True
