"""The trainer's side of the worker pool: ``WorkerPool``, its futures, the reader thread
that resolves them, and spawning the server process (``relayrl.workers.server``). See
``relayrl.workers`` for the design."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterable

from relayrl.workers.common import CallFailed, ImportFailed, PoolError, _poll, locate
from relayrl.workers.isolation import NOBODY, _bwrap_prefix, _check_bwrap, _count_tasks, _python_paths

# the server's entry point, run as ``python -c _BOOT cfg_json package_root``
_BOOT = ("import sys; sys.path.append(sys.argv[2]); "
         "from relayrl.workers.server import _serve; _serve(sys.argv[1])")


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
    """Runs functions by spec in isolated worker processes; see ``relayrl.workers``.

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
    the RLIMIT_NPROC budget per worker when running as root. ``hide_paths`` (bwrap only):
    folders (existing ones) the sandbox covers with an empty read-only tmpfs, so that code in
    it cannot read them (the project, a run directory, a home); what the pool needs beneath one
    stays visible, read-only: the Python installation and the relayrl package (so functions to
    run must live there or outside the hidden folders, or be preloaded: a preloaded function's
    own file, or its top-level package, stays visible too, but not the rest of the folder it lies
    in). ``tmp_size_mb`` (bwrap only): size limit of the sandbox's private /tmp, which is memory
    (default: the kernel's, half the RAM)."""

    def __init__(self, preload: Iterable[str] = (), *, workers: int = 0, timeout_s: float = 5.0,
                 memory_mb: int = 4096, sandbox: str = "none", imports: Iterable[str] = (),
                 warmup: Iterable[tuple[str, list]] = (), log_path: str | None = None, cwd: str | None = None,
                 prefetch: int = 4, calls_per_worker: int = 500, procs_per_worker: int = 64,
                 start_timeout_s: float = 120.0, hide_paths: Iterable[str] = (), tmp_size_mb: int | None = None):
        if sandbox not in ("none", "bwrap"):
            raise ValueError(f"sandbox must be 'none' or 'bwrap', not {sandbox!r}")
        self.hide_paths = sorted({os.path.realpath(p) for p in hide_paths})
        if (self.hide_paths or tmp_size_mb) and sandbox != "bwrap":
            raise ValueError("hide_paths and tmp_size_mb need sandbox='bwrap'")
        for path in self.hide_paths:
            if not os.path.isdir(path) or path == "/":
                raise ValueError(f"hide_paths: {path!r} is not an existing folder other than /")
        self.workers = workers or len(os.sched_getaffinity(0))
        self.timeout_s, self.memory_mb, self.sandbox = float(timeout_s), int(memory_mb), sandbox
        self.cwd = os.path.abspath(cwd or os.getcwd())
        self._preload, self._imports = list(preload), list(imports)
        self._warmup = [[fn, list(args)] for fn, args in warmup]
        self._prefetch, self._calls_per_worker, self._procs_per_worker = prefetch, calls_per_worker, procs_per_worker
        self._start_timeout_s = start_timeout_s
        self._log = open(log_path, "ab") if log_path else None
        self._prefix = (_bwrap_prefix(self._binds(), self.hide_paths, self._kept(), tmp_size_mb)
                        if sandbox == "bwrap" else [])
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
        """Folders bwrap must show although they lie under the private /tmp: the cwd, the folders
        of file specs, this Python installation and the relayrl package (a virtual environment or
        a checkout under /tmp, as in a fresh CI clone), read-only like the rest of the host."""
        folders = {self.cwd, _package_root(), *_python_paths(), *self._spec_paths()} | {
            os.path.dirname(os.path.join(self.cwd, s.rpartition(":")[0]))
            for s in self._preload if s.rpartition(":")[0].endswith(".py")}
        under = sorted(os.path.realpath(f) for f in folders if f == "/tmp" or f.startswith("/tmp/"))
        return [f for f in under if not any(f.startswith(g + "/") for g in under)]  # outermost only

    def _kept(self) -> list[str]:
        """What must stay visible under a hidden folder: Python, the relayrl package and the
        preloaded functions' own modules (a verifier in the hidden working folder: its file, or
        its package, and nothing else there)."""
        if not self.hide_paths:
            return []
        return _python_paths() + [os.path.realpath(os.path.join(_package_root(), "relayrl"))] + self._spec_paths()

    def _spec_paths(self) -> list[str]:
        return sorted({p for spec in self._preload for p in locate(spec, self.cwd)})

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
            "writable": not self._prefix,  # no sandbox: the call writes where the user can (isolation._drop_root)
            # RLIMIT_NPROC counts every task of the uid on the machine: what it runs already + a budget
            "nproc": _count_tasks(NOBODY) + self.workers * self._procs_per_worker if root else None,
        }
        cmd = self._prefix + [sys.executable, "-c", _BOOT, json.dumps(cfg), _package_root()]
        try:
            proc = subprocess.Popen(cmd, pass_fds=(req_r, rep_w), stdin=subprocess.DEVNULL,
                                    stdout=self._log or subprocess.DEVNULL, stderr=self._log, cwd=self.cwd,
                                    start_new_session=True)  # (a signal to the trainer's group is the trainer's)
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


def _package_root() -> str:
    """The folder holding relayrl/ (this file is relayrl/workers/pool.py)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _read_ready(proc: subprocess.Popen, replies, timeout: float) -> dict:
    readable, _ = _poll([replies.fileno()], [], timeout)
    line = replies.readline() if readable else b""
    if line:
        return json.loads(line)
    if not readable:
        raise PoolError(f"importing and warming up its functions did not finish within {timeout:g}s (an import "
                        "that sleeps or waits?)")
    raise PoolError(f"the process importing its functions exited with code {proc.wait()} before it was ready "
                    "(os._exit at import? anything it wrote went to stderr)")
