"""Isolation helpers for the server and its workers: prctl, a worker's fds, resource limits,
the privilege drop as root, killing what a call leaves behind, and the bubblewrap command
line with its trial run. See ``relayrl.workers`` for the guarantees they make up."""

from __future__ import annotations

import ctypes
import errno
import math
import os
import resource
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import threading

from relayrl.workers.common import SandboxUnavailable

NOBODY = 65534  # the uid/gid workers switch to when the pool runs as root
FILE_SIZE_LIMIT = 64 << 20
_REQ_FD, _RES_FD = 3, 4  # the worker's private protocol pipes (close-on-exec)

# prctl / capability constants (linux/prctl.h, linux/capability.h)
_PR_SET_PDEATHSIG, _PR_SET_KEEPCAPS, _PR_SET_CHILD_SUBREAPER = 1, 8, 36
_PR_SET_NO_NEW_PRIVS, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_RAISE = 38, 47, 2
_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH = 1, 2
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
# what the bwrap'd server keeps as root: switch workers' uid/gid, kill them, read files
_SERVER_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_KILL", "CAP_DAC_READ_SEARCH")

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


# ---------------------------------------------------------------- a worker's fds and limits


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


# ---------------------------------------------------------------- dropping root


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _capset(caps: int) -> bool:
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    data[0].effective = data[0].permitted = data[0].inheritable = caps
    return _libc.capset(ctypes.byref(header), data) == 0


def _drop_root(uid: int, nproc: int, writable: bool = True) -> None:
    """Root ignores RLIMIT_NPROC (the kernel exempts uid 0 whatever its capabilities); uid ``uid``
    does not: that is the fork-bomb guard. What the call may touch stays the user's:

    - reading: CAP_DAC_READ_SEARCH (so a Python under a 0700 /root still loads);
    - ``writable`` (no sandbox): CAP_DAC_OVERRIDE too, so a verifier or tool writes where the user
      (root) can — the working directory, the run directory — and so do programs it runs (both
      capabilities are ambient: kept across exec). Files it creates belong to ``uid`` (keeping the
      filesystem uid 0 instead would make them root's, but the kernel then clears the ambient
      capabilities at every exec, so ``subprocess.run(["sh", ...])`` could no longer write: measured).
      Neither capability exempts from RLIMIT_NPROC (only CAP_SYS_RESOURCE and CAP_SYS_ADMIN do, and
      both are dropped).
    - under bwrap the filesystem is read-only whatever the capabilities (a read-only mount).

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
    keep = 1 << _CAP_DAC_READ_SEARCH | (1 << _CAP_DAC_OVERRIDE if writable else 0)
    if _capset(keep):
        for cap in (_CAP_DAC_READ_SEARCH, _CAP_DAC_OVERRIDE):  # ambient: programs the call execs keep them
            if keep >> cap & 1:  # (fails quietly before Linux 4.3)
                _libc.prctl(ctypes.c_int(_PR_CAP_AMBIENT), ctypes.c_ulong(_PR_CAP_AMBIENT_RAISE),
                            ctypes.c_ulong(cap), ctypes.c_ulong(0), ctypes.c_ulong(0))
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)  # setuid binaries cannot give root back


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


# ---------------------------------------------------------------- what a call leaves behind


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


# ---------------------------------------------------------------- bubblewrap


def _bwrap_prefix(binds: list[str], hide: list[str] = (), keep: list[str] = (),
                  tmp_size_mb: int | None = None) -> list[str]:
    """The bwrap command line. ``binds``: folders under /tmp to show (read-only). ``hide``:
    folders covered by an empty read-only tmpfs; ``keep``: folders shown again (read-only)
    where they lie under a hidden one. The most specific path wins, so a hidden folder inside
    a kept one stays hidden. ``tmp_size_mb``: size limit of the private /tmp (default: the
    kernel's, half the RAM)."""
    if shutil.which("bwrap") is None:
        raise SandboxUnavailable("bubblewrap is not installed: apt-get install bubblewrap")
    tmp_size = ["--size", str(int(tmp_size_mb) << 20)] if tmp_size_mb else []
    cmd = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--perms", "1777", *tmp_size,
           "--tmpfs", "/tmp", "--unshare-net", "--unshare-pid", "--unshare-ipc", "--new-session", "--die-with-parent"]
    for folder in binds:
        parts = folder.split("/")
        for i in range(3, len(parts)):  # folders between /tmp and it: 0755, not bwrap's 0700
            cmd += ["--perms", "0755", "--dir", "/".join(parts[:i])]
        cmd += ["--ro-bind", folder, folder]
    mounts = _hide_and_keep(hide, keep)
    for path, hidden, parents in mounts:
        for folder in parents:  # made 0755: bwrap would make them 0700, closed to a dropped uid
            cmd += ["--perms", "0755", "--dir", folder]
        cmd += ["--tmpfs", path] if hidden else ["--ro-bind", path, path]
    for path, hidden, _ in mounts:
        if hidden:
            cmd += ["--remount-ro", path]  # after the kept folders' mount points were made in it
    if os.geteuid() == 0:  # bwrap run by root keeps every capability unless told otherwise
        cmd += ["--cap-drop", "ALL"] + [a for cap in _SERVER_CAPS for a in ("--cap-add", cap)]
    return cmd + ["--"]


def _hide_and_keep(hide: list[str], keep: list[str]) -> list[tuple[str, bool, list[str]]]:
    """(path, hidden, folders to make in the tmpfs above it) mounts, shallow first so that a
    deeper one covers a shallower one; an entry whose nearest enclosing entry is of the same
    kind is left out (it changes nothing), and so is a kept folder that no hidden one
    encloses. At equal paths, keeping wins."""
    entries = {**{k: False for k in keep}, **{h: True for h in hide if h not in keep}}
    mounts = []
    for path, hidden in entries.items():
        around = [p for p in entries if p != path and _inside(path, p)]
        enclosing = max(around, key=_depth) if around else None
        if (entries[enclosing] if enclosing else False) != hidden:  # nothing around: shown
            parts = path.split("/")
            between = ["/".join(parts[:i]) for i in range(_depth(enclosing or "/") + 2, len(parts))]
            mounts.append((path, hidden, between if enclosing and entries[enclosing] else []))
    return sorted(mounts, key=lambda m: _depth(m[0]))


def _depth(path: str) -> int:
    return len([part for part in path.split("/") if part])


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _python_paths() -> list[str]:
    """The folders of this Python installation (prefixes, stdlib, site-packages, the
    interpreter's folder): what a sandbox that hides folders must keep showing."""
    paths = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.realpath(sys.executable)), *sysconfig.get_paths().values(),
             *site.getsitepackages()}
    if site.ENABLE_USER_SITE:
        paths.add(site.getusersitepackages())
    return sorted({os.path.realpath(p) for p in paths if p and os.path.isdir(p)})


def private_folders() -> list[str]:
    """What a sandbox for model-written code hides by default: the folder the trainer runs in
    (the project, its runs and checkpoints) and the home folder (tokens: ~/.cache/huggingface,
    ~/.ssh, ~/.netrc), where they are folders other than / and /tmp (a sandbox's /tmp is its own already:
    hiding it would leave it read-only, so a run started from /tmp could start no sandbox)."""
    return [p for p in (os.getcwd(), os.path.expanduser("~"))
            if os.path.isdir(p) and os.path.realpath(p) not in ("/", "/tmp")]


def _check_bwrap(prefix: list[str]) -> None:
    """A trial run: bwrap may be installed yet unable to sandbox (no user namespaces, seccomp)."""
    try:
        r = subprocess.run(prefix + ["true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SandboxUnavailable(f"bubblewrap cannot start a sandbox here: {e}") from None
    if r.returncode != 0:
        raise SandboxUnavailable(f"bubblewrap cannot start a sandbox here (exit code {r.returncode}): "
                                 f"{r.stderr.strip()[:500]}")
