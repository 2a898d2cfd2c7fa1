"""The server process (its poll loop: requests in, calls to workers, deadlines, replies
out) and the worker processes it forks (each runs calls one at a time). Started by
``relayrl.workers.pool`` as ``python -c``; see ``relayrl.workers`` for the design."""

from __future__ import annotations

import importlib
import json
import math
import os
import secrets
import signal
import sys
import time
from collections import deque

from relayrl.workers.common import ImportFailed, _describe, _poll, load, where
from relayrl.workers.isolation import (_PR_SET_CHILD_SUBREAPER, _PR_SET_PDEATHSIG, _REQ_FD, _RES_FD, _children,
                                       _drop_root, _install_fds, _kill, _killpg, _left_behind, _limit_cpu,
                                       _limit_resources, _prctl, _state_and_group)

MAX_REPLY_BYTES = 16 << 20  # a worker's reply larger than this is a protocol violation
SWEEP_FOR_S = 2.0  # after a kill, look for re-parented leftovers this long
_KINDS = ("error", "timeout", "oom", "crashed")


class _Shutdown(BaseException):
    """SIGTERM (the trainer died, or someone asked): leave the loop through its cleanup."""


def _on_sigterm(parent_pid: int | None):
    def handler(signum, frame):
        if parent_pid is not None and os.getppid() == parent_pid:
            return  # the trainer lives: a scheduler's SIGTERM to every process of the job is the trainer's to handle
        raise _Shutdown
    return handler


def _serve(settings_json: str) -> None:
    settings = json.loads(settings_json)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it closes us
    signal.signal(signal.SIGTERM, _on_sigterm(settings["parent_pid"]))
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)  # SIGTERM, not SIGKILL: we clean up our workers first
    if settings["parent_pid"] is not None and os.getppid() != settings["parent_pid"]:
        return  # the trainer died before the line above
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)  # what a call orphans comes to us, to be killed
    try:
        errors = _preload(settings)
        _write_all(settings["fds"][1], json.dumps({"ready": True, "errors": errors}).encode() + b"\n")
        if not errors:
            _Loop(settings).run()
    except (_Shutdown, BrokenPipeError):
        pass  # told to stop, or the trainer is gone: nothing to report to


def _preload(settings: dict) -> dict[str, str]:
    errors = {}
    for name in settings["imports"]:
        try:
            importlib.import_module(name)
        except Exception as e:
            errors[name] = f"{name!r} cannot be imported: {_describe(e)}"
    for spec in settings["preload"]:
        try:
            load(spec, settings["cwd"])
        except ImportFailed as e:
            errors[spec] = str(e)
    for spec, args in [] if errors else settings["warmup"]:
        try:
            load(spec, settings["cwd"])(*args)
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

    def __init__(self, settings: dict):
        self.settings = settings
        self.requests, self.replies = settings["fds"]
        self.inbuf = bytearray()
        self.queue: deque[dict] = deque()
        self.outbox: list[bytes] = []  # replies to the trainer, written once per loop turn
        self.slots: list[_Worker | None] = [None] * settings["workers"]
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
            if len(w.calls) >= self.settings["prefetch"]:
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
                _worker_main(self.settings, to_r, from_w)
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
        # the worker echoes a fresh nonce in its reply: a line the call's own code wrote to the protocol pipe
        # (fd 4 is open in the worker) does not, so it cannot pass for the result, nor shift the next call's
        call["nonce"] = secrets.token_hex(8)
        w.out += json.dumps({"fn": call["fn"], "args": call["args"], "timeout": call["timeout"],
                             "nonce": call["nonce"]}).encode() + b"\n"

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
        msg, keep = _parse_reply(line, call["nonce"])
        if msg.get("kind") == "oom":
            msg["error"] = f"killed: out of memory (memory_mb={self.settings['memory_mb']})"
        if not keep or w.done >= self.settings["calls_per_worker"]:
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


def _parse_reply(line: bytes, nonce: str) -> tuple[dict, bool]:
    """A worker's reply, checked: it comes from the process that ran user code. One that does not carry its
    call's nonce was written by that code (the worker is retired: its real reply would answer the next call)."""
    try:
        msg = json.loads(line)
        if msg.get("nonce") != nonce:
            return {"ok": False, "kind": "crashed", "error": "a reply that does not answer its call: the call wrote "
                    "to its worker's protocol pipe"}, False
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


def _worker_main(settings: dict, req_fd: int, res_fd: int) -> None:
    """Set up the isolation, then run calls one at a time until told to stop."""
    os.setpgid(0, 0)
    server = os.getppid()
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    _install_fds(req_fd, res_fd)
    setup_error = None
    try:
        _limit_resources(settings["memory_mb"])
        if settings["drop_uid"] is not None:
            _drop_root(settings["drop_uid"], settings["nproc"], writable=settings["writable"])
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # after the uid switch, which clears it
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)  # what a call orphans stays ours: _left_behind sees it
    except Exception as e:
        setup_error = f"worker setup failed: {_describe(e)}"
    if os.getppid() != server:
        os._exit(0)  # the server died while we started
    me = os.getpid()
    requests = open(_REQ_FD, "rb")
    for line in requests:
        req = json.loads(line)
        if setup_error:
            reply, keep = {"ok": False, "kind": "crashed", "error": setup_error}, False
        else:
            reply, keep = _run_call(req)
        if os.getpid() != me:
            os._exit(0)  # a copy the user's code forked must not speak the protocol
        _write_all(_RES_FD, _encode_reply({**reply, "nonce": req.get("nonce")}, keep))
        if not keep:
            break
    os._exit(0)


def _run_call(req: dict) -> tuple[dict, bool]:
    """Run one call; (reply, keep the worker). Any failure of user code becomes a reply."""
    _limit_cpu(req["timeout"])
    try:
        reply, keep = {"ok": True, "value": load(req["fn"])(*req["args"])}, True
    except MemoryError:
        reply, keep = {"ok": False, "kind": "oom", "error": "out of memory"}, False
    except BaseException as e:  # SystemExit and KeyboardInterrupt too: user code must not end us
        reply, keep = {"ok": False, "kind": "error", "error": _describe(e) + where(e)}, True
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
                           "keep": keep, "nonce": reply.get("nonce")})
    return data.encode() + b"\n"
