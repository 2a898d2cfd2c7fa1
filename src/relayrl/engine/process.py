"""Any engine, run in a child process (``rollout.engine_process=true``).

Generation and training then use separate cores and separate interpreters: on a small machine
a generation *thread* competes with the trainer for the GIL (decoding a small model is mostly
Python), and overlapped modes lose much of what they overlap. In its own process the engine is
what it will be on a cluster, a separate worker the trainer talks to.

Protocol: requests, aborts, pause/resume and weight loads go down one command queue and are
applied in order; completions come back on one queue, acknowledgements on another. Weights
travel through tensors in shared memory, allocated once: ``load_weights`` copies the policy into
them, and the child copies them into its model under its engine's own pause, then acknowledges,
so when ``load_weights`` returns, every later token is sampled by the new version. The buffers
are in the engine's dtype (``rollout.dtype``), not the trainer's: with a bfloat16 engine beside
a float32 trainer the cast happens in the copy into them (which the parent makes anyway, at about
a float32 copy's cost), so the shared memory is half the size, the child reads half the bytes,
and its own copy into the model is a plain one. With ``model.lora`` the buffers hold the adapter's
tensors only (a few MB, kept in the dtype they come in: the child merges them in float32 into the
base weights it loaded itself, ``engine.adapter``). The child
exits when told to, or when its parent is gone (a ``kill -9`` of the run leaves no orphan).
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import threading
import time
from typing import Iterable

import torch
import torch.multiprocessing as mp

from relayrl.engine.base import Engine, EngineError, check_new
from relayrl.engine.spec import EngineSpec, build_local_engine
from relayrl.engine.speculative import add_counts
from relayrl.records import Completion, GenRequest


def _serve(spec: EngineSpec, parent: int, shared: dict, cmd, out, ack) -> None:
    """The child: build the engine, forward completions, apply commands in order."""
    from relayrl.workers import die_with_parent

    # Ctrl-C reaches the terminal's whole process group, slurm's SIGTERM and SIGUSR1 every process of the job:
    # the trainer's to handle (it closes us); dying of them here would turn a stop into an engine failure
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent(parent)  # a parent killed while this child loads the model takes it along
    try:
        if spec.threads:
            torch.set_num_threads(spec.threads)
        torch.manual_seed(spec.seed)
        import transformers

        transformers.utils.logging.disable_progress_bar()  # the parent draws the progress; errors still show
        transformers.utils.logging.set_verbosity_error()

        engine = build_local_engine(spec)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises
        ack.put(("error", f"engine process failed to start: {e!r}"))
        return
    ack.put(("ready", None))
    stop = threading.Event()

    def forward() -> None:
        while not stop.is_set():
            try:
                done = engine.get(timeout=0.05)
            except BaseException as e:  # noqa: BLE001
                out.put(("error", repr(e)))
                return
            spec = engine.take_spec() if hasattr(engine, "take_spec") else {}
            if done or spec:
                out.put(("done", (done, spec)))

    fwd = threading.Thread(target=forward, daemon=True)
    fwd.start()
    paused = contextlib.ExitStack()
    try:
        while True:
            try:
                op, arg = cmd.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != parent:
                    return  # the parent died
                continue
            if op == "submit":
                engine.submit(arg)
            elif op == "abort":
                engine.abort(arg)
            elif op == "load":
                engine.load_weights(shared, arg)
                ack.put(("loaded", arg))
            elif op == "remember":
                ack.put(("remembered", engine.remember(arg)))
            elif op == "pause":
                paused.enter_context(engine.pause())
                ack.put(("paused", None))
            elif op == "resume":
                paused.close()
            elif op == "close":
                return
    finally:
        paused.close()
        stop.set()
        fwd.join(timeout=5)
        engine.close()


class ProcessEngine(Engine):
    def __init__(self, spec: EngineSpec, state_dict: dict[str, torch.Tensor], start_timeout: float = 300.0):
        ctx = mp.get_context("spawn")
        self._cmd, self._out, self._ack = ctx.Queue(), ctx.Queue(), ctx.Queue()
        # the shared weight buffers, allocated once; every later update is an in-place copy
        from relayrl.models import DTYPES

        dtype = DTYPES[spec.engine_dtype]  # (floating tensors only: an integer buffer keeps its dtype)
        if spec.lora is not None:  # the adapter's tensors only, kept as they come: merged in float32 (engine.adapter)
            dtype = None
        self._shared = {k: v.detach().to(dtype if dtype and v.is_floating_point() else v.dtype, copy=True)
                        .share_memory_() for k, v in state_dict.items()}
        self._proc = ctx.Process(target=_serve, args=(spec, os.getpid(), self._shared, self._cmd, self._out, self._ack),
                                 name="relayrl-engine", daemon=True)
        self._proc.start()
        self._lora = spec.lora is not None
        self._version = spec.version
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        self._spec_counts: dict[str, int] = {}  # (speculative decoding in the child: take_spec)
        self._expect("ready", start_timeout)

    def _check_alive(self) -> None:
        if not self._proc.is_alive():
            code = self._proc.exitcode
            how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
            raise EngineError(f"the engine process died ({how}); the last checkpoint is intact: fix the cause and "
                              "continue with --resume")

    def _expect(self, what: str, timeout: float = 120.0):
        """The next acknowledgement, checking twice a second that the child is still alive."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                kind, arg = self._ack.get(timeout=0.5)
                break
            except queue.Empty:
                self._check_alive()
                if time.monotonic() > deadline:
                    raise EngineError(f"engine process: no '{what}' within {timeout:.0f}s") from None
        if kind == "error":
            raise EngineError(arg)
        if kind != what:
            raise EngineError(f"engine process: expected '{what}', got '{kind}'")
        return arg

    @property
    def version(self) -> int:
        return self._version

    def submit(self, requests: list[GenRequest]) -> None:
        with self._lock:
            check_new(requests, self._pending)
            for r in requests:
                self._pending.add(r.request_id)
        self._cmd.put(("submit", list(requests)))

    def get(self, timeout: float | None = None) -> list[Completion]:
        items: list[Completion] = []
        wait = 0.2 if timeout is None else timeout
        while True:
            try:
                kind, arg = self._out.get(timeout=wait) if not items else self._out.get_nowait()
            except queue.Empty:
                if not items:  # a dead child is found on every empty poll, with or without a timeout
                    self._check_alive()
                if items or timeout is not None or not self.num_pending():
                    break
                continue
            if kind == "error":
                raise EngineError(f"engine process failed: {arg}")
            items += arg[0]
            with self._lock:
                add_counts(self._spec_counts, arg[1])
        with self._lock:
            for c in items:
                if c.finish_reason is not None:  # (a streamed piece: the request goes on)
                    self._pending.discard(c.request_id)
        return items

    def abort(self, request_ids: Iterable[str]) -> None:
        with self._lock:
            ids = [i for i in request_ids if i in self._pending]
        if ids:
            self._cmd.put(("abort", ids))

    @contextlib.contextmanager
    def pause(self):
        self._cmd.put(("pause", None))
        self._expect("paused")
        try:
            yield
        finally:
            self._cmd.put(("resume", None))

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        # (the buffers are the tensors the process was started with; an adapter comes whole every time)
        if not state_dict.keys() <= self._shared.keys() or (self._lora and state_dict.keys() != self._shared.keys()):
            other = sorted(set(state_dict) ^ set(self._shared))
            raise EngineError(f"engine process: the weights are not those it was started with ({len(other)} names "
                              f"differ, e.g. {other[:2]})")
        with torch.no_grad():
            for k, v in state_dict.items():
                self._shared[k].copy_(v)
        self._cmd.put(("load", version))
        self._expect("loaded")
        self._version = version

    def remember(self, responses: list[tuple[list[int], list[int]]]) -> int:
        self._cmd.put(("remember", responses))
        return self._expect("remembered")

    def take_spec(self) -> dict[str, int]:
        """The child engine's speculative-decoding counts received since the last call."""
        with self._lock:
            counts, self._spec_counts = self._spec_counts, {}
        return counts

    def num_pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def close(self) -> None:
        if self._proc.is_alive():
            self._cmd.put(("close", None))
            self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()  # (it ignores SIGTERM, which is the trainer's)
