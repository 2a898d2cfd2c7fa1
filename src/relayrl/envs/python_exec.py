"""The worker side of ``python_tool``: runs in a pool worker (under bwrap by default), starts
one fresh interpreter for the model's code, keeps bounded output, enforces the deadline,
kills whatever the code started and cleans the call's folder and the sandbox's /tmp."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import math
import os
import resource
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

from relayrl.workers.isolation import _LINUX_CAPABILITY_VERSION_3, _CapData, _CapHeader
from relayrl.workspaces.keeper import Kept

_DIR_PREFIX = "relayrl-python-"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_libc = ctypes.CDLL(None, use_errno=True)




def _execute(code: str, timeout_s: float, memory_mb: int, keep_bytes: int, sandboxed: bool) -> dict:
    """Run ``code`` in a fresh interpreter (a pool call, in a worker); the result as JSON data."""
    deadline = time.monotonic() + timeout_s
    folder, lock = _call_dir()
    try:
        cmd = [sys.executable, "-I", "-X", "utf8", "-u", "-c", code]
        env = {"PATH": f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin", "HOME": folder,
               "TMPDIR": folder, "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
               "MKL_NUM_THREADS": "1"}
        setup = functools.partial(_child_setup, os.getpid(), memory_mb, timeout_s, sandboxed)
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    cwd=folder, env=env, start_new_session=True, preexec_fn=setup)
        except (OSError, ValueError, subprocess.SubprocessError) as e:
            return {"error": _start_error(e, code)}
        out, err = _Kept(keep_bytes), _Kept(keep_bytes)
        streams = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
        try:
            timed_out = _pump(proc, streams, deadline)
            _killpg(proc.pid)  # the child is still unreaped, so its pid (the group's id) is not reused
            proc.wait()
            _kill_leftovers()
            _drain(streams, time.monotonic() + 0.5)
        finally:
            proc.stdout.close()
            proc.stderr.close()
        return {"stdout": out.result(), "stderr": err.result(), "returncode": proc.returncode,
                "timed_out": timed_out}
    finally:
        _rmtree(folder)
        os.close(lock)
        if sandboxed:
            _sweep_tmp()


def _child_setup(worker: int, memory_mb: int, timeout_s: float, drop_caps: bool) -> None:
    """In the child, before exec (it inherits the worker's uid, namespaces and other limits)."""
    libc = _libc
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != worker:
        os._exit(1)  # the worker died before the line above
    if drop_caps and libc.capset(ctypes.byref(_CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)), (_CapData * 2)()) != 0:
        os._exit(1)  # every set empty (the ambient one follows the permitted one)
    cpu = math.ceil(timeout_s) + 1
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    if hard != resource.RLIM_INFINITY:
        cpu = min(cpu, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20,) * 2)  # last: nothing is allocated after it


def _start_error(e: BaseException, code: str) -> str:
    if isinstance(e, ValueError):
        return "the code contains a NUL character"
    if isinstance(e, OSError) and e.errno == errno.E2BIG:
        return f"the code is too long ({len(code.encode())} bytes; the limit is about 128 KiB)"
    if isinstance(e, OSError) and e.errno == errno.EAGAIN:
        return "the process limit is reached (another call is using it up); try again"
    return f"{type(e).__name__}: {e}"


class _Kept(Kept):
    """``Kept`` (``relayrl.workspaces.keeper``: the first and the last ``n`` bytes of a stream), as the tool's
    result reads it: [head, tail, characters cut]."""

    def result(self) -> list:
        if not self.cut:
            return [bytes(self.head + self.tail).decode("utf-8", "replace"), "", 0]
        return [self.head.decode("utf-8", "replace"), self.tail.decode("utf-8", "replace"), self.cut]


def _pump(proc: subprocess.Popen, streams: dict, deadline: float) -> bool:
    """Read the child's output until it exits (False) or the deadline passes (True)."""
    try:
        exit_fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        exit_fd = None  # before Linux 5.3: look every 20 ms
    poller = select.poll()
    for fd in [*streams, exit_fd]:
        if fd is not None:
            poller.register(fd, select.POLLIN)
    try:
        while True:
            left = deadline - time.monotonic()
            if exit_fd is None and _exited(proc.pid):
                return False
            if left <= 0:
                return True
            wait = left if exit_fd is not None else min(left, 0.02)
            for fd, _ in poller.poll(math.ceil(wait * 1000)):
                if fd == exit_fd:
                    return False
                if not _read(fd, streams[fd]):
                    poller.unregister(fd)
    finally:
        if exit_fd is not None:
            os.close(exit_fd)


def _exited(pid: int) -> bool:
    """Has ``pid`` exited? (without reaping it)"""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _read(fd: int, kept: _Kept) -> bool:
    data = os.read(fd, 1 << 16)
    kept.add(data)
    return bool(data)


def _drain(streams: dict, until: float) -> None:
    """What is left in the pipes, once every writer is dead (bounded, in case one is not)."""
    open_fds = dict(streams)
    for fd in open_fds:
        os.set_blocking(fd, False)
    while open_fds and time.monotonic() < until:
        for fd in list(open_fds):
            try:
                if not _read(fd, open_fds[fd]):
                    del open_fds[fd]
            except BlockingIOError:
                pass
        if open_fds:
            select.select(list(open_fds), [], [], max(0.0, until - time.monotonic()))


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


def _kill_leftovers(for_s: float = 2.0) -> None:
    """SIGKILL and reap every process the call left: all descendants of this worker, wherever
    their group or session (the worker is a child subreaper, so orphans stay in its subtree).
    A fork bomb outruns killing one layer at a time, so first everything is stopped (SIGSTOP
    cannot be caught; a stopped process cannot fork), then killed."""
    end = time.monotonic() + for_s
    me = os.getpid()
    while time.monotonic() < end:  # stop them all
        running = [pid for pid, state in _descendants(me) if state not in "ZXTt"]
        if not running:
            break
        _signal(running, signal.SIGSTOP)
    while True:  # then kill them; the dead are reaped here, their orphaned children come to us
        procs = _descendants(me)
        _signal([pid for pid, state in procs if state not in "ZX"], signal.SIGKILL)
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        if not procs or time.monotonic() > end + for_s:
            return  # what may be left makes the pool replace this worker, and its server sweep
        time.sleep(0.001)


def _descendants(root: int) -> list[tuple[int, str]]:
    """(pid, state) of every descendant of ``root``, from /proc."""
    children: dict[int, list[tuple[int, str]]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()  # after "(comm)", which may hold spaces
            except OSError:
                continue  # it exited
            children.setdefault(int(fields[1]), []).append((int(name), fields[0]))
    found, todo = [], [root]
    while todo:
        for pid, state in children.get(todo.pop(), ()):
            found.append((pid, state))
            todo.append(pid)
    return found


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


# ---------------------------------------------------------------- the call's directory, /tmp


def _call_dir() -> tuple[str, int]:
    """A fresh 0700 folder under /tmp, named after its start time, and a lock on it (held
    while the call runs: the sweep of another worker leaves a locked folder alone)."""
    for _ in range(10):
        folder = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{time.time_ns()}-", dir="/tmp")
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.path.samestat(os.fstat(fd), os.stat(folder)):
                return folder, fd
        except OSError:
            pass  # swept away by another worker between the two lines: take another
        os.close(fd)
    raise OSError("could not make a folder for the call under /tmp")


def _sweep_tmp() -> None:
    """Under bwrap (the sandbox's own /tmp): remove what calls left there, so that no state
    passes through it to later calls. Folders of running calls (locked) stay, and so do other
    entries changed since the oldest running call started (they may be its files)."""
    me, tmp_dev = os.geteuid(), os.stat("/tmp").st_dev
    entries = []
    running_since = math.inf
    try:
        with os.scandir("/tmp") as it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if st.st_uid == me and st.st_dev == tmp_dev:
                    entries.append((entry.path, entry.name, st))
    except OSError:
        return
    locks = []
    try:
        loose = []
        for path, name, st in entries:
            if name.startswith(_DIR_PREFIX) and stat.S_ISDIR(st.st_mode):
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                except OSError:
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    locks.append((fd, path))  # a finished call's: removed below, lock held
                except OSError:
                    os.close(fd)
                    started = name[len(_DIR_PREFIX):].partition("-")[0]
                    if started.isdigit():
                        running_since = min(running_since, int(started))
            else:
                loose.append((path, st))
        for fd, path in locks:
            _rmtree(path)
        for path, st in loose:  # 50 ms: the clock of ctime is coarse
            if running_since == math.inf or st.st_ctime_ns < running_since - 50_000_000:
                _rmtree(path)
    finally:
        for fd, _ in locks:
            os.close(fd)


def _rmtree(path: str) -> None:
    """Remove a file or a folder tree the call wrote, even one it made unreadable."""
    try:
        st = os.lstat(path)
    except OSError:
        return
    if not stat.S_ISDIR(st.st_mode):
        try:
            os.unlink(path)
        except OSError:
            pass
        return
    try:
        os.chmod(path, 0o700)
    except OSError:
        pass
    for root, dirs, _ in os.walk(path):
        for d in dirs:  # before os.walk lists them
            p = os.path.join(root, d)
            try:
                if stat.S_ISDIR(os.lstat(p).st_mode):  # never chmod through a symlink
                    os.chmod(p, 0o700)
            except OSError:
                pass
    shutil.rmtree(path, ignore_errors=True)
