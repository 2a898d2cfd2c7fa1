"""CPU engine on transformers' continuous-batching manager (``model.init_continuous_batching``).

Requests join and leave the running batch token by token, so a long response never holds a
slot that a new request could use. Tokens stream back cumulatively; each new token is tagged
with the version loaded when it arrived. Weight swaps happen under the manager's own
``pause()``, after every token produced so far has been collected, so version tags are exact.
An abort is taken under the pause too: the tokens returned are exactly those streamed
before the cancel, and anything the manager produces for that request later is dropped.

The manager samples with one temperature (set at construction from the rollout config).
Requests with other sampling settings (greedy evaluation, say) are served by a batched
``generate`` engine over the same model object, which shares every weight swap.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Iterable

from relayrl.engine.adapter import AdapterMerge
from relayrl.engine.base import Engine, EngineError, check_new, copy_weights
from relayrl.engine.hf import HFEngine
from relayrl.records import Completion, FinishReason, GenRequest, SamplingParams


class _Live:
    __slots__ = ("req", "tokens", "logprobs", "versions")

    def __init__(self, req: GenRequest):
        self.req, self.tokens, self.logprobs, self.versions = req, [], [], []


class HFContinuousEngine(Engine):
    def __init__(self, model, tokenizer, params: SamplingParams, version: int = 0, num_blocks: int = 256,
                 page_size: int = 32, max_batch_tokens: int = 2048, max_batch: int = 256,
                 eos_token_ids: list[int] | None = None, adapter: AdapterMerge | None = None):
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        self.model = model.eval()
        self.params = params
        self._adapter = adapter  # model.lora: updates bring the adapter only, merged into the base it keeps
        if eos_token_ids is None:
            eos = model.generation_config.eos_token_id or tokenizer.eos_token_id
            eos_token_ids = eos if isinstance(eos, list) else [eos]
        self.eos_ids = set(eos_token_ids)
        gen = GenerationConfig(
            do_sample=True,
            temperature=params.temperature,
            top_k=params.top_k or None,
            top_p=params.top_p if params.top_p < 1 else None,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=sorted(self.eos_ids) or -1,
            pad_token_id=tokenizer.pad_token_id,
        )
        cb = ContinuousBatchingConfig(
            return_logprobs=True, num_blocks=num_blocks, page_size=page_size, max_batch_tokens=max_batch_tokens,
            max_requests_per_batch=max_batch, allow_block_sharing=False,
        )
        self.mgr = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        self.mgr.start()
        self._fallback = HFEngine(model, tokenizer, max_batch=max_batch, version=version, batch_guard=self.mgr.pause,
                                  eos_token_ids=eos_token_ids)
        self._version = version
        self._lock = threading.RLock()
        self._live: dict[str, _Live] = {}
        self._out: queue.Queue[Completion] = queue.Queue()
        self._fallback_ids: set[str] = set()
        self._closed = False
        self._collector = threading.Thread(target=self._collect_loop, name="relayrl-cb-collector", daemon=True)
        self._collector.start()

    @property
    def version(self) -> int:
        return self._version

    def _same_params(self, p: SamplingParams) -> bool:
        q = self.params
        # (a seeded request goes to relayrl's loop, which samples it from its own numbers)
        return (p.temperature, p.top_p, p.top_k, p.seed) == (q.temperature, q.top_p, q.top_k, None)

    def submit(self, requests: list[GenRequest]) -> None:
        fallback = [r for r in requests if not self._same_params(r.params)]
        with self._lock:
            check_new(requests, self._live, self._fallback_ids)
            self._fallback_ids |= {r.request_id for r in fallback}
            for r in requests:
                if not self._same_params(r.params):
                    continue
                if r.params.max_new_tokens <= 0:
                    self._out.put(Completion(r.request_id, [], [], [], FinishReason.LENGTH))
                    continue
                self._live[r.request_id] = _Live(r)
                self.mgr.add_request(
                    list(r.prompt_ids) + list(r.response_so_far), request_id=r.request_id,
                    max_new_tokens=r.params.max_new_tokens, streaming=True,
                )
        if fallback:
            self._fallback.submit(fallback)

    def _apply(self, out) -> None:
        """Fold one streamed (cumulative) output into its live request. Caller holds the lock."""
        live = self._live.get(out.request_id)
        if live is None:  # finished or aborted already: late output is dropped
            return
        n_old = len(live.tokens)
        new = list(out.generated_tokens[n_old:])
        live.tokens += new
        live.logprobs += [float(x) for x in out.logprobs[n_old : n_old + len(new)]]
        live.versions += [self._version] * len(new)
        if out.is_finished():
            del self._live[out.request_id]
            if out.error is not None:
                reason = FinishReason.FAILED
            elif live.tokens and live.tokens[-1] in self.eos_ids:
                reason = FinishReason.STOP
            else:
                reason = FinishReason.LENGTH
            self._out.put(Completion(out.request_id, live.tokens, live.logprobs, live.versions, reason))

    def _drain_manager(self) -> None:
        while True:
            out = self.mgr.get_result(timeout=0)
            if out is None:
                return
            self._apply(out)

    def _collect_loop(self) -> None:
        # Taking an output and tagging it happen under one lock: a weight swap (which takes the
        # lock after draining the manager) cannot fall between them and tag old tokens as new.
        while not self._closed:
            with self._lock:
                out = self.mgr.get_result(timeout=0.005)
                if out is not None:
                    self._apply(out)

    def get(self, timeout: float | None = None) -> list[Completion]:
        if self.mgr.background_thread_status.fatal_error is not None:
            raise EngineError(f"continuous batching failed: {self.mgr.background_thread_status.fatal_error!r}")
        items = []
        for c in self._fallback.get(timeout=0):
            self._fallback_ids.discard(c.request_id)
            items.append(c)
        try:
            if not items:
                deadline = None if timeout is None else timeout
                waited = 0.0
                while True:
                    if timeout is None and self.num_pending() == 0 and self._out.empty():
                        return []
                    try:
                        items.append(self._out.get(timeout=0.05))
                        break
                    except queue.Empty:
                        waited += 0.05
                        for c in self._fallback.get(timeout=0):
                            self._fallback_ids.discard(c.request_id)
                            items.append(c)
                        if items or (deadline is not None and waited >= deadline):
                            break
            while True:
                items.append(self._out.get_nowait())
        except queue.Empty:
            pass
        return items

    def abort(self, request_ids: Iterable[str]) -> None:
        ids = set(request_ids)
        self._fallback.abort(ids & self._fallback_ids)
        with self.mgr.pause(), self._lock:
            self._drain_manager()
            for rid in ids:
                live = self._live.pop(rid, None)
                if live is not None:
                    self.mgr.cancel_request(rid)
                    self._out.put(Completion(rid, live.tokens, live.logprobs, live.versions, FinishReason.ABORTED))

    @contextlib.contextmanager
    def pause(self):
        with self._fallback.pause(), self.mgr.pause(), self._lock:
            self._drain_manager()
            yield

    def load_weights(self, state_dict, version: int) -> None:
        with self.pause():
            if self._adapter is not None:
                self._adapter.apply(state_dict)
            else:
                copy_weights(self.model, state_dict)
            self._version = version
            self._fallback.mark_version(version)

    def num_pending(self) -> int:
        with self._lock:
            return len(self._live) + self._out.qsize() + self._fallback.num_pending()

    def close(self) -> None:
        self._closed = True
        self._collector.join(timeout=5)
        self.mgr.stop(block=True)
        self._fallback.close()
