"""Engines as Ray actors (``run.backend=ray``), restarted when they die.

``EngineActor`` holds any engine (``hf`` on a thread of its own, or ``vllm``) in a Ray worker
process; ``RayEngine`` is this side's ``Engine`` for one actor. It remembers what the actor
owes it (each pending request, the tokens already streamed back), the weights last published
(one object in Ray's store, shared by all actors) and whether generation is paused. When the
actor dies (a crashed node, an OOM kill, ``ray.kill``), a new one is started from the model
path, loaded with the current weights and version, paused if the rollout is paused, and every
pending request is sent to it again; a request that had streamed tokens continues after them
(``response_so_far``), so nothing already returned is generated twice, and its final completion
still holds all of its tokens. A request aborted before the death comes back aborted. The run
never sees the death, only ``restarts``; after ``max_restarts`` the engine fails for real.

``resources`` (``ray.engine_resources``) places the actor: on a node that offers them, checked against
the cluster's live nodes before it starts (``check_placement``: one line naming what they offer, never a
wait for a node that will not come). An actor whose node left the cluster is restarted on another that
offers them, or the run stops with the departed node's address.

A weight update reaches the actor one of two ways (``rollout.weight_sync``): through the collective
(``engine.weight_sync.Channel``: a gloo group of this process and the actor, formed when the actor starts, the policy
broadcast in buckets of ``rollout.sync_bucket_mb`` under ``rollout.sync_timeout_s``, the actor loading what it
received) or through Ray's object store (``file``: put once, the actor reads it). ``auto``: the collective where it
forms, else the store (measured 3.15x slower on one node, with 4 GiB more at the peak: docs/guides/scale.md). The
weights of the last update are kept (a reference in the store, or this process's dict) for a replacement actor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time
from typing import Iterable

import torch

from relayrl.engine.base import Engine, EngineError, check_new, take
from relayrl.engine.spec import EngineSpec, build_local_engine
from relayrl.records import Completion, FinishReason, GenRequest


class EngineActor:
    """Runs in the Ray worker: the engine named by ``spec`` (``relayrl.engine.spec``)."""

    def __init__(self, spec: EngineSpec):
        if spec.threads:
            torch.set_num_threads(spec.threads)
        torch.manual_seed(spec.seed)
        self.engine = build_local_engine(spec)
        self._paused = contextlib.ExitStack()

    def submit(self, requests: list[GenRequest]) -> None:
        self.engine.submit(requests)

    def get(self, timeout: float) -> list[Completion]:
        return self.engine.get(timeout=timeout)

    def abort(self, ids: list[str]) -> None:
        self.engine.abort(ids)

    def pause(self) -> None:
        self._paused.enter_context(self.engine.pause())

    def resume(self) -> None:
        self._paused.close()

    def load_weights(self, state_dict: dict, version: int) -> None:
        self.engine.load_weights(state_dict, version)

    def num_pending(self) -> int:
        return self.engine.num_pending()

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        import os

        return os.getpid()

    def sync_join(self, host: str, port: int, timeout_s: float) -> None:
        from relayrl.engine.weight_sync import Channel

        self._channel = Channel.join((host, port), 1, 2, timeout_s)

    def sync_load(self, wire: list, version: int) -> None:
        """The buckets of one update, received whole, then loaded as an update from the object store is."""
        from relayrl.engine.weight_sync import Meta

        plan = [[Meta(n, d, tuple(s)) for n, d, s in bucket] for bucket in wire]
        self.engine.load_weights(dict(self._channel.receive(plan)), version)

    def remember(self, responses: list) -> int:
        return self.engine.remember(responses)

    def take_spec(self) -> dict[str, int]:
        return self.engine.take_spec() if hasattr(self.engine, "take_spec") else {}

    def close(self) -> None:
        self._paused.close()
        self.engine.close()


@dataclasses.dataclass
class _Owed:
    """A request the actor has not finished: as first submitted, and what already came back."""

    request: GenRequest
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    earlier: int = 0  # tokens produced by actors that died (the final completion of a retry lacks them)
    aborted: bool = False


class RayEngine(Engine):
    def __init__(self, spec: EngineSpec, name: str, max_restarts: int = 3, start_timeout: float = 900,
                 resources: dict[str, float] | None = None):
        import ray

        self._ray = ray
        self._spec, self.name, self.max_restarts = spec, name, max_restarts
        self._resources = dict(resources or {})
        self.node = ""  # the Ray node id of the actor now running
        self._channel = None  # the collective to the actor now running (formed when it starts)
        self._timeout = start_timeout
        self._version = spec.version
        self._weights = None  # the last published weights: a reference in Ray's store, or (the collective) a dict
        self._owed: dict[str, _Owed] = {}
        self._paused = 0
        self._lock = threading.RLock()
        self._out: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self.restarts = 0
        self.requeued = 0  # requests sent again to a restarted actor
        self._generation = 0  # incremented per actor started; a failure restarts only the one that failed
        # (file: Ray's object store; else the collective, formed now, or the store and why)
        self._store_why = "rollout.weight_sync=file" if spec.rollout.weight_sync == "file" else ""
        self._actor = self._start_actor()
        if not self._store_why:
            try:
                self._form(self._actor)
            except EngineError:
                with contextlib.suppress(Exception):
                    ray.kill(self._actor)
                raise
        self._thread = threading.Thread(target=self._forward, name=f"relayrl-{name}", daemon=True)
        self._thread.start()

    def _start_actor(self):
        """The actor, started and placed (``self.node``). While it waits for a place, the cluster is checked every few
        seconds: a run whose engines lost every node that could hold them stops in one line, it does not wait."""
        ray = self._ray
        deadline = time.monotonic() + self._timeout
        check_placement(self._resources, 1, f"engine actor {self.name}")
        # (a replacement's name is its own: a killed process's actor keeps its name until the cluster sees it dead)
        name = self.name if not self._generation else f"{self.name}-r{self._generation}"
        actor_cls = ray.remote(num_cpus=0, max_concurrency=8, name=name, resources=self._resources or None)(EngineActor)
        actor = None
        try:
            actor = actor_cls.remote(self._spec)
            ref = actor.node.remote()
            while True:
                try:
                    self.node = ray.get(ref, timeout=min(5.0, max(0.1, deadline - time.monotonic())))
                    return actor
                except ray.exceptions.GetTimeoutError:
                    check_placement(self._resources, 1, f"engine actor {self.name}")
                    if time.monotonic() > deadline:
                        raise
        except Exception as e:
            if actor is not None:
                with contextlib.suppress(Exception):
                    ray.kill(actor)
            if isinstance(e, EngineError):
                raise
            raise EngineError(f"engine actor {self.name} failed to start: {_reason(e)}") from None

    # -- the actor, and its replacement ---------------------------------------------------------
    def _call(self, method: str, *args, timeout: float = 600):
        """``actor.method(*args)``; if the actor is dead, restart it (which replays the state) and
        return None."""
        return self._call_gen(method, *args, timeout=timeout)[0]

    def _call_gen(self, method: str, *args, timeout: float = 600):
        """(result, generation of the actor that answered)."""
        with self._lock:
            actor, gen = self._actor, self._generation
        try:
            return self._ray.get(getattr(actor, method).remote(*args), timeout=timeout), gen
        except self._ray.exceptions.RayActorError:
            self._restart(gen)
            return None, gen

    def _restart(self, failed_generation: int) -> None:
        with self._lock:
            if failed_generation != self._generation or self._stop.is_set():
                return  # already replaced (or closing)
            if self.restarts >= self.max_restarts:
                left = node_left(self.node)
                self._out.put(EngineError(f"engine actor {self.name} died {self.restarts + 1} times; giving up"
                                          + (f" (the last time: {left})" if left else "")))
                self._stop.set()  # (no more calls on the dead actor: the run's next get() raises this)
                return
            self.restarts += 1
            self._generation += 1
            gone = self.node
            with contextlib.suppress(Exception):
                self._ray.kill(self._actor)  # (one that only looks dead: a stopped process; its resources freed)
            try:
                self._actor = actor = self._start_actor()
                self._channel = None
                if not self._store_why:
                    self._form(actor)
                if isinstance(self._weights, dict):  # (the last update went through the collective)
                    self._send(actor, self._weights, self._version)
                elif self._weights is not None:
                    self._ray.get(actor.load_weights.remote(self._weights, self._version))
            except (EngineError, self._ray.exceptions.RayActorError) as e:  # (this may be the forward thread: the
                left = node_left(gone)                                       # run's next get() raises it)
                e = e if isinstance(e, EngineError) else f"engine actor {self.name}'s replacement died: {_reason(e)}"
                self._out.put(EngineError(f"{e}; {left}" if left else str(e)))
                self._stop.set()
                return
            if self._paused:
                self._ray.get(actor.pause.remote())
            again, settled = [], []
            for rid, o in list(self._owed.items()):
                o.earlier = len(o.tokens)
                left = o.request.params.max_new_tokens - o.earlier
                if o.aborted or left <= 0:
                    settled.append(self._settle(Completion(
                        rid, [], [], [], FinishReason.ABORTED if o.aborted else FinishReason.LENGTH)))
                    continue
                again.append(dataclasses.replace(
                    o.request, params=dataclasses.replace(o.request.params, max_new_tokens=left),
                    response_so_far=list(o.request.response_so_far) + o.tokens))
            if settled:
                self._out.put(settled)
            if again:
                actor.submit.remote(again)
            self.requeued += len(again)

    def _forward(self) -> None:
        """Collect the actor's completions; what a replaced actor returned late is dropped (its
        requests were sent again, after the tokens already accounted for)."""
        while not self._stop.is_set():
            done, gen = self._call_gen("get", 0.05)
            if not done:
                continue
            with self._lock:
                if gen == self._generation:
                    self._out.put([c for c in map(self._settle, done) if c is not None])

    def _settle(self, c: Completion) -> Completion | None:
        """Record what came back (under the lock); a retried request's final completion gets the
        tokens the dead actor had streamed."""
        o = self._owed.get(c.request_id)
        if o is None:
            return None
        if c.finish_reason is None:
            o.tokens += c.token_ids
            o.logprobs += c.logprobs
            o.versions += c.versions
            return c
        del self._owed[c.request_id]
        if not o.earlier:
            return c
        k = o.earlier
        return Completion(c.request_id, o.tokens[:k] + c.token_ids, o.logprobs[:k] + c.logprobs,
                          o.versions[:k] + c.versions, c.finish_reason)

    # -- interface ---------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    def submit(self, requests: list[GenRequest]) -> None:
        with self._lock:
            check_new(requests, self._owed)
            for r in requests:
                self._owed[r.request_id] = _Owed(r)
        self._call("submit", list(requests))

    def get(self, timeout: float | None = None) -> list[Completion]:
        return take(self._out, timeout, self.num_pending)

    def abort(self, request_ids: Iterable[str]) -> None:
        with self._lock:
            ids = [i for i in request_ids if i in self._owed]
            for i in ids:
                self._owed[i].aborted = True
        if ids:
            self._call("abort", ids)

    @contextlib.contextmanager
    def pause(self):
        with self._lock:
            self._paused += 1
        self._call("pause")
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1
            self._call("resume")

    def _form(self, actor) -> None:
        """The collective with a new actor (rollout.weight_sync collective or auto): ``auto`` keeps Ray's object store,
        the reason in ``sync_note``, where it cannot be formed; ``collective`` raises an EngineError naming the cause."""
        from relayrl.engine.weight_sync import Channel, SyncError

        ray, r = self._ray, self._spec.rollout
        if self._store_why:
            return
        try:
            store = Channel.store(2, r.sync_timeout_s, host=ray.util.get_node_ip_address())
            joined = actor.sync_join.remote(store.host, store.port, r.sync_timeout_s)
            self._channel = Channel.host(store, 2, r.sync_timeout_s)
            ray.get(joined, timeout=r.sync_timeout_s)
        except (SyncError, RuntimeError, OSError, ray.exceptions.GetTimeoutError) as e:
            self._channel = None
            if r.weight_sync == "collective":
                raise EngineError(f"engine actor {self.name}: rollout.weight_sync=collective: the group could not be "
                                  f"formed: {_reason(e)}") from None
            self._store_why = f"rollout.weight_sync=auto: the collective could not be formed: {_reason(e)}"

    @property
    def sync_note(self) -> str:
        """How updates reach this actor (the run's log says it at start)."""
        if self._store_why:
            return f"Ray's object store ({self._store_why})"
        return f"collective (gloo, 2 ranks, buckets of ≤ {self._spec.rollout.sync_bucket_mb} MB)"

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """The weights go in the engine's dtype (``rollout.dtype``: a float32 trainer's cast to bfloat16 here, half the
        bytes to store and send; the actor's engine would cast them anyway), to the store or through the collective."""
        if not isinstance(state_dict, self._ray.ObjectRef):
            from relayrl.models import DTYPES

            dtype = DTYPES[self._spec.engine_dtype]
            cast = self._spec.lora is None  # (an adapter goes as it is: the engine merges it in float32)
            state_dict = {k: v.to(dtype) if cast and v.is_floating_point() else v for k, v in state_dict.items()}
            if not self._store_why:
                with self._lock:
                    self._weights, self._version, actor, gen = state_dict, version, self._actor, self._generation
                try:
                    self._send(actor, state_dict, version)
                except self._ray.exceptions.RayActorError:
                    self._restart(gen)  # (which sends them to the replacement)
                return
            state_dict = self._ray.put(state_dict)
        ref = state_dict
        with self._lock:
            self._weights, self._version = ref, version
        self._call("load_weights", ref, version)

    def _send(self, actor, weights: dict[str, torch.Tensor], version: int) -> None:
        """One update through the collective (formed with this actor at its first); an actor that died in it raises
        RayActorError (the caller replaces it), one that stalls an EngineError at ``rollout.sync_timeout_s``."""
        from relayrl.engine.weight_sync import SyncError, metas, plan_buckets

        ray, r = self._ray, self._spec.rollout
        timeout = r.sync_timeout_s
        failed = f"engine actor {self.name}: the weight update to version {version} through the collective failed"
        plan = plan_buckets(metas(weights), r.sync_bucket_mb << 20)
        channel = self._channel
        try:
            if channel is None:
                self._form(actor)
                channel = self._channel
            if channel is None:  # (auto, and the group did not form with this actor: the store, as the log says now)
                ref = ray.put(weights)
                with self._lock:
                    self._weights = ref
                ray.get(actor.load_weights.remote(ref, version), timeout=timeout)
                return
            loaded = actor.sync_load.remote([[(m.name, m.dtype, m.shape) for m in b] for b in plan], version)
            channel.send(weights, plan)
            ray.get(loaded, timeout=timeout)
        except ray.exceptions.RayActorError:
            self._forget(channel)
            raise
        except (SyncError, RuntimeError, ray.exceptions.GetTimeoutError) as e:
            self._forget(channel)
            try:  # a dead actor is replaced; a live one that could not take the update stops the run
                ray.get(actor.node.remote(), timeout=10)
            except ray.exceptions.RayActorError:
                raise
            except Exception:  # noqa: BLE001 - alive but not answering: stalled
                pass
            raise EngineError(f"{failed}: {_reason(e)}") from None

    def _forget(self, channel) -> None:
        """A failed channel is dropped (not one a replacement formed meanwhile, on another thread)."""
        with self._lock:
            if self._channel is channel:
                self._channel = None

    def num_pending(self) -> int:
        with self._lock:
            return len(self._owed)

    def remember(self, responses: list[tuple[list[int], list[int]]]) -> int:
        """(kept by this actor: a restarted one has only what it decodes after)"""
        return self._call("remember", responses) or 0

    def take_spec(self) -> dict[str, int]:
        """The actor's speculative-decoding counts since the last call (a dead actor's are lost with it)."""
        return self._call("take_spec") or {}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with contextlib.suppress(Exception):
            self._ray.get(self._actor.close.remote(), timeout=30)
        with contextlib.suppress(Exception):
            self._ray.kill(self._actor)


def _address(node: dict) -> str:
    return f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}"


def describe_node(node_id: str) -> str:
    """``host:port (id 1a2b3c4d)`` of a node of the cluster, live or gone."""
    import ray

    node = next((n for n in ray.nodes() if n["NodeID"] == node_id), None)
    return f"{_address(node)} (id {node_id[:8]})" if node else f"id {node_id[:8]}"


def node_left(node_id: str) -> str:
    """'' while the node is alive; else what to tell the user: its address, gone."""
    import ray

    node = next((n for n in ray.nodes() if n["NodeID"] == node_id), None)
    if not node_id or (node is not None and node["Alive"]):
        return ""
    return f"its node {describe_node(node_id)} left the Ray cluster"


def check_placement(resources: dict[str, float], engines: int, who: str) -> None:
    """An EngineError, unless the live nodes can hold ``engines`` actors that each ask for ``resources`` (counted
    from the nodes' totals: a node offering 2 holds two actors asking 1)."""
    import ray

    if not resources:
        return
    live = [n for n in ray.nodes() if n["Alive"]]
    fits = sum(min(int(n["Resources"].get(k, 0) // v) for k, v in resources.items()) for n in live)
    if fits < engines:
        offered = "; ".join(f"{_address(n)}: " + (", ".join(
            f"{k} {v:g}" for k, v in sorted(n["Resources"].items())
            if not k.startswith("node:") and k not in ("memory", "object_store_memory")) or "nothing") for n in live)
        raise EngineError(f"{who}: the Ray cluster's live nodes hold {fits} of the {engines} engine(s) asking "
                          f"ray.engine_resources={resources} each (its nodes: {offered})")


def _reason(e: BaseException) -> str:
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    return lines[-1] if lines else type(e).__name__
