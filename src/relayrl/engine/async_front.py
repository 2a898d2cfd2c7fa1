"""An asyncio front over any ``Engine``: ``await engine.generate(request)``.

Episodes (an agent's turns, a tool call between them) are coroutines; many run at once on one
event loop, each awaiting its own generations while the engine batches whatever is in flight.
One dispatcher thread drains the engine's completions (``get``) and resolves each request's
future on the loop (a driven engine's decoding thread does that itself: ``pump``). ``stream``
yields a request's tokens as they are sampled. Cancelling an awaiting coroutine (an episode's
deadline, a rollout being held for a checkpoint) aborts its request in the engine: the engine
stops it at the next token. Shaped like vLLM's ``AsyncLLM`` (generate as a stream / abort /
weight updates), so the two can stand in for each other behind the rollout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import AsyncIterator, Callable, Iterable

from relayrl.engine.base import Engine, EngineError
from relayrl.records import Completion, FinishReason, GenRequest


class AsyncEngine:
    """``order``: puts the requests of one submission in the order the engine should serve them
    (the rollout's scheduling policy); None keeps arrival order."""

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop,
                 order: Callable[[list[GenRequest]], list[GenRequest]] | None = None):
        self.engine, self.loop, self.order = engine, loop, order
        self._futures: dict[str, asyncio.Future | asyncio.Queue] = {}  # request id -> where it goes
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._error: EngineError | None = None  # why the engine stopped, for later callers too
        self._pending: list[GenRequest] = []  # submitted together at the end of this loop iteration
        self._cut: set[str] = set()  # pending requests aborted before they reached the engine
        # a driven engine decodes on the thread that waits for it, which delivers completions too
        # (``pump``); any other is drained by a dispatcher thread
        self._thread = None
        if not getattr(engine, "driven", False):
            self._thread = threading.Thread(target=self._dispatch, name="relayrl-async-engine", daemon=True)
            self._thread.start()

    @property
    def version(self) -> int:
        return self.engine.version

    async def generate(self, request: GenRequest) -> Completion:
        """The completion of ``request`` (finished, or aborted with the tokens so far)."""
        fut = self.loop.create_future()
        self._send(request, fut)
        try:
            return await fut
        except asyncio.CancelledError:
            self._forget(request)
            raise

    async def stream(self, request: GenRequest) -> AsyncIterator[Completion]:
        """``request``'s tokens as they are sampled: pieces with the new tokens (``finish_reason``
        None), the last one with the finish reason. An engine that does not stream gives the last
        piece only. Leaving the loop early aborts the request."""
        request = dataclasses.replace(request, stream=True)
        pieces: asyncio.Queue = asyncio.Queue()
        self._send(request, pieces)
        sent, finished = 0, False
        try:
            while True:
                c = await pieces.get()
                if isinstance(c, BaseException):
                    raise c
                if c.finish_reason is None:
                    sent += len(c.token_ids)
                    yield c
                    continue
                finished = True
                yield Completion(c.request_id, c.token_ids[sent:], c.logprobs[sent:], c.versions[sent:],
                                 c.finish_reason, c.routes)
                return
        finally:
            if not finished:
                self._forget(request)

    def _send(self, request: GenRequest, sink) -> None:
        with self._lock:
            if self._closed.is_set():
                raise self._error or EngineError("the async engine front is closed")
            self._futures[request.request_id] = sink
            if not self._pending:
                self.loop.call_soon(self._flush)
            self._pending.append(request)

    def _forget(self, request: GenRequest) -> None:
        """A waiter has gone: stop its request (its completion is then dropped)."""
        with self._lock:
            if request in self._pending:
                self._pending.remove(request)
            else:
                self.engine.abort([request.request_id])
            self._futures.pop(request.request_id, None)

    def _flush(self) -> None:
        """One ``submit`` for every request made in this loop iteration: the engine sees them as one
        batch (prefilled together), as it would from a synchronous caller, not one at a time."""
        with self._lock:
            requests, self._pending = self._pending, []
            send = [r for r in requests if r.request_id not in self._cut]
            cut = [(f, Completion(r.request_id, [], [], [], FinishReason.ABORTED)) for r in requests
                   if r.request_id in self._cut and (f := self._futures.pop(r.request_id, None)) is not None]
            self._cut.clear()
        try:
            if send:
                self.engine.submit(self.order(send) if self.order else send)
        except BaseException as e:  # noqa: BLE001 - a submit that raises would leave its episodes waiting forever
            self._fail_all(e)
        _resolve_all(cut)

    def abort(self, request_ids: Iterable[str]) -> None:
        """Stop these requests at the next token; their ``generate`` returns the tokens so far (none,
        for a request not yet handed to the engine). Safe from any thread."""
        ids = set(request_ids)
        with self._lock:
            unsent = {r.request_id for r in self._pending} & ids
            self._cut |= unsent
            if ids - unsent:
                self.engine.abort(list(ids - unsent))

    def pause(self):
        """Context manager: generation stopped at a token boundary while inside (around a weight
        update: abort what must not continue under the new weights, then load them)."""
        return self.engine.pause()

    async def load_weights(self, state_dict: dict, version: int) -> None:
        """Swap weights without blocking the loop (the engine pauses at a token boundary)."""
        await asyncio.to_thread(self.engine.load_weights, state_dict, version)

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def pump(self) -> None:
        """Deliver what has finished (a driven engine: called between tokens by the thread decoding)."""
        if not self._closed.is_set():
            self._drain(timeout=0)

    def _dispatch(self) -> None:
        while not self._closed.is_set() and self._drain(timeout=0.05):
            pass

    def _drain(self, timeout: float) -> bool:
        """Deliver what the engine has finished (waiting up to ``timeout``); False once it failed."""
        try:
            done = self.engine.get(timeout=timeout)
        except BaseException as e:  # noqa: BLE001 - every waiting episode learns why
            self._fail_all(e)
            return False
        self._deliver(done)
        return True

    def _deliver(self, done: list[Completion]) -> None:
        with self._lock:
            ready = [(f, c) for c in done if (f := self._futures.get(c.request_id)) is not None]
            for c in done:
                if c.finish_reason is not None:
                    self._futures.pop(c.request_id, None)
        if ready:  # one wake-up of the loop for everything that finished together
            self.loop.call_soon_threadsafe(_resolve_all, ready)

    def _fail_all(self, error: BaseException) -> None:
        err = error if isinstance(error, EngineError) else EngineError(f"engine failed: {error!r}")
        with self._lock:
            futures, self._futures = list(self._futures.values()), {}
            self._error = err
            self._closed.set()
        for fut in futures:
            self.loop.call_soon_threadsafe(_reject, fut, err)


def _resolve_all(ready: list[tuple[asyncio.Future | asyncio.Queue, Completion]]) -> None:
    for sink, c in ready:
        if isinstance(sink, asyncio.Queue):
            sink.put_nowait(c)
        elif not sink.done():  # a cancelled waiter has gone
            sink.set_result(c)


def _reject(sink: asyncio.Future | asyncio.Queue, err: BaseException) -> None:
    if isinstance(sink, asyncio.Queue):
        sink.put_nowait(err)
    elif not sink.done():
        sink.set_exception(err)
