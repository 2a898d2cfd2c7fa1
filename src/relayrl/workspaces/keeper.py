"""The process that keeps one workspace, inside its sandbox (``relayrl.workspaces.sandbox`` starts it under
bubblewrap). Standard library only, run as ``python -I -S keeper.py SETTINGS``: it must start in
milliseconds and import nothing of the trainer's.

At start it mounts the workspace: an overlay whose lower layer is the task's repository at its commit
(read-only, shared by every workspace of the task) and whose upper layer lies on the sandbox's private,
size-capped /tmp, at ``settings["path"]`` — or, where the kernel refuses the overlay, a copy of the lower
layer there (``mode`` says which). It answers one line of JSON, ``{"ready": true, "mode": ...}`` or
``{"ready": false, "error": ...}``, then serves requests, one JSON line each on stdin, one reply each on
stdout, until stdin closes:

    {"argv": [...], "stdin": "..." | null, "timeout": 10.0, "keep": 10000}
 -> {"exit_code": 0 | null, "output": "...", "cut": 0, "timed_out": false, "error": null}

Each command runs in the workspace folder in a new session, as uid 65534 when the keeper is root (every
capability gone; bwrap's no_new_privs keeps a setuid program from getting them back), with limits on its
address space, CPU time, processes and file size, and a minimal environment. stdout and stderr are one
stream (as on a terminal) of which the first and the last ``keep`` bytes are kept, ``cut`` counting the
characters between. When the command ends or its deadline passes, every other process of the sandbox
(what the command left running, a fork bomb) is stopped and killed. The sandbox's pid namespace and
``--die-with-parent`` end everything, the mounts included, when the keeper or the trainer dies: nothing
of a workspace outlives its sandbox.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import time

_CONTINUATION = bytes(range(0x80, 0xC0))  # UTF-8 continuation bytes: not the start of a character
_libc = ctypes.CDLL(None, use_errno=True)


def _mount(settings: dict) -> str:
    """The workspace at ``path``: an overlay, else a copy; the mode."""
    lower, path, scratch = settings["lower"], settings["path"], settings["scratch"]
    upper, work = os.path.join(scratch, "upper"), os.path.join(scratch, "work")
    for d in (upper, work, path):
        os.makedirs(d, exist_ok=True)
    opts = f"lowerdir={lower},upperdir={upper},workdir={work}".encode()
    if not settings.get("copy") and _libc.mount(b"overlay", path.encode(), b"overlay", 0, opts) == 0:
        mode = "overlay"
    else:
        why = os.strerror(ctypes.get_errno()) if not settings.get("copy") else "asked"
        os.rmdir(path)
        shutil.copytree(lower, path, symlinks=True)
        mode = f"copy ({why})"
    uid = settings["uid"]
    if uid is not None:
        os.chown(path, uid, uid)
        home = os.path.join(scratch, "home")
        os.makedirs(home, exist_ok=True)
        os.chown(home, uid, uid)
        if mode != "overlay":  # (a copy is the keeper's: hand it over)
            for root, dirs, files in os.walk(path):
                for name in dirs + files:
                    os.lchown(os.path.join(root, name), uid, uid)
    return mode


def _child(settings: dict, timeout: float):
    """What a command's process does before exec."""
    uid, nproc = settings["uid"], settings["nproc"]

    def setup():
        cpu = int(timeout) + 2
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_FSIZE, (settings["file_mb"] << 20,) * 2)
        if nproc is not None:
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)  # from root: every capability goes with it
        resource.setrlimit(resource.RLIMIT_AS, (settings["memory_mb"] << 20,) * 2)  # last: nothing allocated after

    return setup


class Kept:
    """The first and the last ``n`` bytes of a stream, and how many characters between them were dropped (also the
    python tool's: ``relayrl.envs.python_exec``)."""

    def __init__(self, n: int):
        self.n, self.head, self.tail, self.cut = n, bytearray(), bytearray(), 0

    def add(self, data: bytes) -> None:
        room = self.n - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        self.tail += data
        extra = len(self.tail) - self.n
        if extra > 0:
            self.cut += len(bytes(self.tail[:extra]).translate(None, _CONTINUATION))
            del self.tail[:extra]

    def text(self) -> str:
        if not self.cut:
            return bytes(self.head + self.tail).decode("utf-8", "replace")
        return (self.head.decode("utf-8", "replace") + f"\n[... {self.cut} characters cut ...]\n"
                + self.tail.decode("utf-8", "replace"))


def _kill_the_rest() -> None:
    """Every process of the sandbox but its init (1) and this keeper: stopped first, so a fork bomb cannot
    outrun the kill, then killed."""
    me = os.getpid()
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for name in os.listdir("/proc"):
            if name.isdigit() and int(name) not in (1, me):
                try:
                    os.kill(int(name), sig)
                except OSError:
                    pass


def _run(settings: dict, req: dict) -> dict:
    timeout, kept = float(req.get("timeout", 10.0)), Kept(int(req.get("keep", 10000)))
    env = {"PATH": settings["bin_path"], "HOME": os.path.join(settings["scratch"], "home"), "TMPDIR": "/tmp",
           "LANG": "C.UTF-8", "TERM": "dumb", "PAGER": "cat", "GIT_PAGER": "cat", "PYTHONDONTWRITEBYTECODE": "1",
           "OMP_NUM_THREADS": "1", "GIT_CONFIG_NOSYSTEM": "1"}
    try:
        proc = subprocess.Popen(req["argv"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                cwd=settings["path"], env=env, start_new_session=True,
                                preexec_fn=_child(settings, timeout))
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        return {"exit_code": None, "output": "", "cut": 0, "timed_out": False, "error": f"{type(e).__name__}: {e}"}
    data = (req.get("stdin") or "").encode()
    try:
        if data:
            proc.stdin.write(data)
        proc.stdin.close()
    except OSError:  # (it did not read its input)
        pass
    deadline, fd, timed_out = time.monotonic() + timeout, proc.stdout.fileno(), False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        ready, _, _ = select.select([fd], [], [], min(left, 0.1))
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:  # its output closed: it is ending (coreutils close their output before they exit)
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    timed_out = True
                break
            kept.add(chunk)
        elif proc.poll() is not None:
            break  # it ended; what it left running in the background holds the pipe open: not waited for
    _kill_the_rest()
    code = proc.wait()
    proc.stdout.close()
    return {"exit_code": None if timed_out else code, "output": kept.text(), "cut": kept.cut,
            "timed_out": timed_out, "error": None}


def main() -> None:
    settings = json.loads(sys.argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the trainer's
    out = sys.stdout
    try:
        mode = _mount(settings)
    except OSError as e:
        out.write(json.dumps({"ready": False, "error": f"{type(e).__name__}: {e}"}) + "\n")
        out.flush()
        return
    out.write(json.dumps({"ready": True, "mode": mode}) + "\n")
    out.flush()
    for line in sys.stdin:
        try:
            reply = _run(settings, json.loads(line))
        except Exception as e:  # noqa: BLE001 - the trainer reads it
            reply = {"exit_code": None, "output": "", "cut": 0, "timed_out": False, "error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
