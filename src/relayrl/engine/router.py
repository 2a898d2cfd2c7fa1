"""Many engines behind one (``rollout.engines=N``): data-parallel rollout.

A new episode goes to the engine with the fewest requests in flight; its later turns go to the
same engine, whose prefix cache holds its context (the key is the episode's part of the request
id, before ``#``). A weight update pauses every engine, loads the weights into each, and only
then lets any of them resume: no token of the new version is sampled while another engine still
samples the old one, so every engine always reports the same version. Completions of all engines
come out of one ``get`` (one forwarding thread per engine).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections import OrderedDict
from typing import Iterable

import torch

from relayrl.engine.base import Engine, EngineError, check_new, take
from relayrl.records import Completion, GenRequest

_AFFINITY_KEYS = 1 << 16  # episodes remembered for their engine (oldest forgotten first)


def episode_key(request_id: str) -> str:
    return request_id.split("#", 1)[0]


class EngineRouter(Engine):
    def __init__(self, engines: list[Engine]):
        if not engines:
            raise ValueError("EngineRouter needs at least one engine")
        if any(getattr(e, "driven", False) for e in engines):
            raise ValueError("EngineRouter: driven engines need the thread that waits for them; use threaded ones")
        self.engines = engines
        self._owner: dict[str, int] = {}  # pending request id -> engine index
        self._load = [0] * len(engines)  # pending requests per engine
        self._affinity: OrderedDict[str, int] = OrderedDict()  # episode -> engine index
        self._lock = threading.Lock()
        self._out: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._forward, args=(i,), name=f"relayrl-router-{i}", daemon=True)
                         for i in range(len(engines))]
        for t in self._threads:
            t.start()

    @property
    def version(self) -> int:
        return min(e.version for e in self.engines)

    def pick(self, request_id: str) -> int:
        """The engine for this request (under the lock): the episode's engine, else the least loaded."""
        key = episode_key(request_id)
        i = self._affinity.get(key)
        if i is None:
            i = min(range(len(self.engines)), key=lambda j: (self._load[j], j))
        self._affinity[key] = i
        self._affinity.move_to_end(key)
        while len(self._affinity) > _AFFINITY_KEYS:
            self._affinity.popitem(last=False)
        return i

    def submit(self, requests: list[GenRequest]) -> None:
        per: list[list[GenRequest]] = [[] for _ in self.engines]
        with self._lock:
            check_new(requests, self._owner)
            for r in requests:
                i = self.pick(r.request_id)
                self._owner[r.request_id] = i
                self._load[i] += 1
                per[i].append(r)
        for e, rs in zip(self.engines, per):
            if rs:
                e.submit(rs)

    def _forward(self, i: int) -> None:
        engine = self.engines[i]
        while not self._stop.is_set():
            try:
                done = engine.get(timeout=0.05)
            except BaseException as e:  # noqa: BLE001 - the next get() raises it, naming the engine
                self._out.put(EngineError(f"engine {i} of {len(self.engines)} failed: {e}"))
                return
            if done:
                self._out.put(done)

    def get(self, timeout: float | None = None) -> list[Completion]:
        items = take(self._out, timeout, self.num_pending)
        with self._lock:
            for c in items:
                if c.finish_reason is not None and (i := self._owner.pop(c.request_id, None)) is not None:
                    self._load[i] -= 1
        return items

    def abort(self, request_ids: Iterable[str]) -> None:
        per: list[list[str]] = [[] for _ in self.engines]
        with self._lock:
            for rid in request_ids:
                if (i := self._owner.get(rid)) is not None:
                    per[i].append(rid)
        for e, ids in zip(self.engines, per):
            if ids:
                e.abort(ids)

    def pause(self):
        return self._on_every_engine("pause")

    def asleep(self):
        return self._on_every_engine("asleep")

    @contextlib.contextmanager
    def _on_every_engine(self, context: str):
        """Every engine's ``context`` (pause, asleep) entered, in order, and left in reverse."""
        with contextlib.ExitStack() as stack:
            for e in self.engines:
                stack.enter_context(getattr(e, context)())
            yield

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        with self.pause():  # all paused, all loaded, then all resume
            for e in self.engines:
                e.load_weights(state_dict, version)

    def num_pending(self) -> int:
        with self._lock:
            return len(self._owner)

    def remember(self, responses: list[tuple[list[int], list[int]]]) -> int:
        """Every engine keeps them all: a prompt's next groups may go to any."""
        return max((e.remember(responses) for e in self.engines), default=0)

    def loads(self) -> list[int]:
        with self._lock:
            return list(self._load)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        errors = []
        for e in self.engines:
            try:
                e.close()
            except Exception as ex:  # noqa: BLE001 - close the others anyway
                errors.append(ex)
        if errors:
            raise errors[0]
