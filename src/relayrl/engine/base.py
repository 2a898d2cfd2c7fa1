"""The engine interface: submit, collect, abort, pause/resume, load weights, report version.

Every engine (transformers on CPU, vLLM on GPU) implements this, so the pipeline never
knows which one runs. Completions carry per-token log-probs and the policy version that
produced each token; an aborted request still comes back, with finish reason ``ABORTED`` and
exactly the tokens generated so far, so the caller can continue it later.
"""

from __future__ import annotations

import abc
import contextlib
import queue
import time
from typing import Callable, Iterable, Iterator

import torch

from relayrl.records import Completion, GenRequest


class EngineError(RuntimeError):
    pass


class PolicyMismatch(EngineError):
    """The engine's log-probs of the tokens it sampled disagree with the trainer's under the weights of the
    version the tokens say they were sampled with (``run.mismatch_alarm``): the engine is not sampling the
    trained policy (a weight update that did not apply, an adapter left out, other sampling settings)."""


def copy_weights(model, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy ``state_dict`` into ``model`` in place (the engine's own copy of the policy), each tensor cast
    to its parameter's dtype on the way (``load_state_dict`` copies with ``copy_``): a float32 trainer's
    weights into a bfloat16 engine (``rollout.dtype``) need no float32 copy on the engine's side."""
    with torch.no_grad():
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
    if unexpected or [k for k in missing if "rotary" not in k]:
        raise EngineError(f"weight mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")


def check_new(requests: list[GenRequest], *pending) -> None:
    """Raise if a request id is already pending (in any of ``pending``) or repeated in ``requests``;
    checked before anything is queued, so a rejected submit queues nothing."""
    seen: set[str] = set()
    for r in requests:
        if r.request_id in seen or any(r.request_id in p for p in pending):
            raise EngineError(f"request id {r.request_id!r} is already pending")
        seen.add(r.request_id)


def take(out: queue.Queue, timeout: float | None, pending: Callable[[], int],
         check: Callable[[], None] = lambda: None) -> list[Completion]:
    """``get`` over a queue of completions (or lists of them) that another thread fills: wait as
    ``Engine.get`` says (``timeout`` None: until one arrives or ``pending()`` is 0), then take all
    that are there. An exception put on the queue, or raised by ``check``, is raised here."""
    items: list[Completion] = []
    while True:
        try:
            if items:
                got = out.get_nowait()
            elif timeout is None:
                check()
                if not pending():
                    break
                got = out.get(timeout=0.2)
            else:
                got = out.get(timeout=timeout)
        except queue.Empty:
            if items or timeout is not None:
                check()
                break
            continue
        if isinstance(got, BaseException):
            raise got
        items += got if isinstance(got, list) else [got]
    return items


class Engine(abc.ABC):
    @property
    @abc.abstractmethod
    def version(self) -> int:
        """Policy version of the weights currently loaded (number of published updates)."""

    @abc.abstractmethod
    def submit(self, requests: list[GenRequest]) -> None:
        """Queue requests; returns at once."""

    @abc.abstractmethod
    def get(self, timeout: float | None = None) -> list[Completion]:
        """Completions that finished (or were aborted) since the last call. Blocks up to ``timeout``
        seconds for at least one (None: until one arrives, or nothing is pending)."""

    @abc.abstractmethod
    def abort(self, request_ids: Iterable[str]) -> None:
        """Stop these requests at the next token boundary; each still comes out of ``get``."""

    @abc.abstractmethod
    def pause(self) -> contextlib.AbstractContextManager:
        """Context manager: generation is stopped at a token boundary while inside (state kept)."""

    @abc.abstractmethod
    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Swap in new weights (pausing in-flight requests, which continue under ``version``)."""

    @abc.abstractmethod
    def num_pending(self) -> int:
        """Requests submitted whose completion has not been returned by ``get`` yet."""

    @contextlib.contextmanager
    def asleep(self):
        """Context manager around a trainer step that shares the engine's GPU: inside, the engine
        holds as little accelerator memory as it can; nothing may be in flight. Engines that free
        nothing (the default) just wait. The new weights are loaded after it."""
        yield

    def close(self) -> None:
        pass

    def remember(self, responses: list[tuple[list[int], list[int]]]) -> int:
        """Earlier responses, (prompt ids, response ids) oldest first, as drafts (``rollout.speculative``'s history
        and recent, after a resume); returns how many were kept. An engine without such drafts keeps none."""
        return 0

    def generate(self, requests: list[GenRequest], on_complete: Callable[[Completion], None] | None = None
                 ) -> list[Completion]:
        """Submit and wait for all; results in request order. ``on_complete`` is called with each
        completion as it arrives and may call ``abort`` (e.g. once a step has enough groups).
        One consumer of ``get`` at a time: completions of other requests are dropped here, so the
        pipeline holds its rollout (``held``) before evaluating on the same engine."""
        self.submit(requests)
        want = {r.request_id for r in requests}
        got: dict[str, Completion] = {}
        while len(got) < len(want):
            for c in self.get(timeout=None):
                if c.request_id in want:
                    got[c.request_id] = c
                    if on_complete is not None:
                        on_complete(c)
        return [got[r.request_id] for r in requests]

    def drain(self, timeout: float = 30.0) -> Iterator[Completion]:
        """Everything still pending (after an abort, say), until none is left."""
        deadline = time.monotonic() + timeout
        while self.num_pending() > 0:
            if time.monotonic() > deadline:
                raise EngineError(f"engine did not return {self.num_pending()} requests within {timeout}s")
            yield from self.get(timeout=0.5)
