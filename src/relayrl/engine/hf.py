"""CPU engine: a batched decoding loop over a transformers model, run by a background thread.

The loop is relayrl's own (prefill, then one forward per token with a KV cache), so it can do
what ``model.generate`` cannot: rows that finish leave the batch at once (their KV-cache rows
are dropped), so a long-tail batch costs what its live rows cost, not what its longest row
costs (about 2x faster than ``generate`` on the demo task). Requests that arrive while a batch
runs wait for the next batch (joining them by re-prefilling the live rows lost on CPU). After every
token each row's token, log-prob and policy version are recorded, rows finish (EOS, budget, abort)
and stream out, and the loop passes a safe point where a pause holds it so weights can be swapped:
tokens after a swap carry the new version; the old weights' KV cache is kept (as in AReaL).
Llama-family models decode through relayrl's own forward (``fast_decode.py``); seeded requests
(``SamplingParams.seed``) sample from their own numbers (``sampling.sample_tokens``). With
``rollout.speculative`` a step may verify a draft per row in one forward and emit several tokens
(``speculative.py``: exact, the same tokens a seeded request gets without it).

``driven=True``: no background thread; whoever waits for generation decodes, on its own thread,
through ``serve`` (token by token, so it stops as soon as what it waits for is there). For a sync
trainer in the same process: torch's OpenMP threads belong to the thread that starts them, so decoding
on one thread and training on another runs two thread teams that slow each other (~1.6x per step).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import warnings
from collections import deque
from typing import Callable, Iterable, Iterator

import torch
from transformers import DynamicCache

from relayrl.engine.adapter import AdapterMerge
from relayrl.engine.base import Engine, EngineError, check_new, copy_weights
from relayrl.engine.fast_decode import SUPPORTED, fast_decoder
from relayrl.engine.row_routes import RowRoutes
from relayrl.engine.speculative import Speculator, draw_positions, padded, verify
from relayrl.models import cache_kwarg, moe, select_rows, vision
from relayrl.records import Completion, FinishReason, GenRequest
from relayrl.algos.token_sampling import sample_tokens, sampling_scores


class _Row:
    __slots__ = ("done", "logprobs", "req", "routes", "tokens", "versions")

    def __init__(self, req: GenRequest):
        self.req, self.tokens, self.logprobs, self.versions, self.done = req, [], [], [], False
        self.routes: list[torch.Tensor] = []  # a mixture of experts': the routes of the tokens it fed forward

    @property
    def context(self) -> list[int]:
        return list(self.req.prompt_ids) + list(self.req.response_so_far) + self.tokens


class HFEngine(Engine):
    def __init__(self, model, tokenizer, max_batch: int = 256, version: int = 0, batch_guard=None,
                 eos_token_ids: list[int] | None = None, driven: bool = False, fast_decode: bool = False,
                 adapter: AdapterMerge | None = None, speculator: Speculator | None = None):
        self.model = model.eval()
        self._adapter = adapter  # model.lora: updates bring the adapter only, merged into the base it keeps
        self._cache_kw = cache_kwarg(model)  # (transformers renamed it)
        self._fast = fast_decoder(model) if fast_decode else None  # None: the model's own forward
        if speculator is not None and self._fast is None:
            warnings.warn("rollout.speculative: off, as speculative decoding runs in relayrl's decoding forward "
                          f"(rollout.fast_decode: {', '.join(SUPPORTED)}), which this engine does not use",
                          stacklevel=2)
            speculator = None
        self._spec = speculator  # rollout.speculative: drafts verified in one forward (``speculative.py``)
        # a mixture of experts: the experts each token fed forward was routed to, on its completion (``models.moe``)
        self._routes = RowRoutes(model) if moe.replayable(model) else None
        self._images = vision.FeatureCache() if vision.processor_of(model) is not None else None  # (a group's, once)
        self.device = next(model.parameters()).device  # rollout.device: where it decodes (the CPU, or a GPU)
        # entered around each generate call (the continuous-batching engine pauses its own loop with it)
        self._guard = batch_guard or contextlib.nullcontext
        self.pad_id = tokenizer.pad_token_id
        if eos_token_ids is None:
            eos = model.generation_config.eos_token_id or tokenizer.eos_token_id
            eos_token_ids = eos if isinstance(eos, list) else [eos]
        self.eos_ids = set(eos_token_ids)
        self.max_batch = max_batch
        self._version = version
        self._step_version = version
        self._queue: deque[GenRequest] = deque()
        self._out: queue.Queue[Completion] = queue.Queue()
        self._aborted: set[str] = set()
        self._pending: set[str] = set()
        self._cv = threading.Condition()
        self._pause_depth = 0
        self._busy = False
        self._at_safe_point = False
        self._error: BaseException | None = None
        self._closed = False
        self.driven = driven
        self._batch: Iterator[None] | None = None  # driven: the batch being decoded, one token per next()
        self._thread = None if driven else threading.Thread(target=self._loop, name="relayrl-hf-engine", daemon=True)
        if self._thread is not None:
            self._thread.start()

    # -- interface ---------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    def submit(self, requests: list[GenRequest]) -> None:
        with self._cv:
            check_new(requests, self._pending)
            for r in requests:
                self._pending.add(r.request_id)
                self._queue.append(r)
            self._cv.notify_all()

    def get(self, timeout: float | None = None) -> list[Completion]:
        self._raise_if_failed()
        items = []
        try:
            if timeout is None:
                while not items:
                    if not self._pending and self._out.empty():
                        return []
                    try:
                        items.append(self._out.get(timeout=0.2))
                    except queue.Empty:
                        self._raise_if_failed()
            else:
                items.append(self._out.get(timeout=timeout))
        except queue.Empty:
            return []
        while True:
            try:
                items.append(self._out.get_nowait())
            except queue.Empty:
                break
        with self._cv:
            for c in items:
                if c.finish_reason is not None:  # (a streamed piece: the request goes on)
                    self._pending.discard(c.request_id)
                    self._aborted.discard(c.request_id)
        return items

    def abort(self, request_ids: Iterable[str]) -> None:
        with self._cv:
            ids = set(request_ids) & self._pending
            self._aborted |= ids
            # queued (not started) requests come back at once with no tokens
            keep = deque()
            for r in self._queue:
                if r.request_id in ids:
                    self._out.put(Completion(r.request_id, [], [], [], FinishReason.ABORTED))
                else:
                    keep.append(r)
            self._queue = keep

    @contextlib.contextmanager
    def pause(self):
        with self._cv:
            self._pause_depth += 1
            while self._busy and not self._at_safe_point and self._error is None:
                self._cv.wait(0.5)
        try:
            yield
        finally:
            with self._cv:
                self._pause_depth -= 1
                self._cv.notify_all()

    def load_weights(self, state_dict, version: int) -> None:
        with self.pause():
            if self._adapter is not None:
                self._adapter.apply(state_dict)
            else:
                copy_weights(self.model, state_dict)  # (cast to the engine's dtype as it is copied: rollout.dtype)
            self.mark_version(version)

    def mark_version(self, version: int) -> None:
        """Its weights are now ``version``'s (written by ``load_weights``, or by an engine sharing its model,
        ``hf_cb``'s fallback): what completions begun from here are tagged with."""
        self._version = version
        self._step_version = version
        if self._images is not None:  # (new weights, the vision tower's perhaps among them)
            self._images.clear()

    def take_spec(self) -> dict[str, int]:
        """Speculative decoding's counts since the last call (``speculative.metrics``; empty when off)."""
        return self._spec.take() if self._spec is not None else {}

    def remember(self, responses: list[tuple[list[int], list[int]]]) -> int:
        if self._spec is None:
            return 0
        with self.pause():  # (its store is the decoding thread's)
            return self._spec.remember(responses)

    def num_pending(self) -> int:
        with self._cv:
            return len(self._pending)

    def generate(self, requests: list[GenRequest], on_complete=None) -> list[Completion]:
        """Synchronous use: when nothing else is queued or running, decode in the calling thread.

        Same code path as the worker (pause and abort still apply); it only saves the hand-off
        to the background thread, which costs CPU time on small machines. ``on_complete`` runs
        as each row finishes, inside the decoding loop, and may call ``abort``."""
        one_setting = len({(r.params.temperature, r.params.top_p, r.params.top_k, r.adapter) for r in requests}) <= 1
        with self._cv:
            inline = one_setting and not self._busy and not self._queue and not self._pending and self._pause_depth == 0
            if inline:
                self._busy = True
                self._pending |= {r.request_id for r in requests}
        if not inline:
            return super().generate(requests, on_complete)
        return self._generate_inline(requests, on_complete)

    def _generate_inline(self, requests: list[GenRequest], on_complete) -> list[Completion]:
        self._on_complete = on_complete
        try:
            for i in range(0, len(requests), self.max_batch):
                rows = [_Row(r) for r in requests[i : i + self.max_batch]]
                with self._cv:
                    self._step_version = self._version
                with self._guard():
                    self._run(rows)
        finally:
            self._on_complete = None
            with self._cv:
                self._busy = False
                self._cv.notify_all()
        got = {}
        while len(got) < len(requests):
            for c in self.get(timeout=0):
                got[c.request_id] = c
        return [got[r.request_id] for r in requests]

    def serve(self, until: Callable[[], bool], timeout: float = 0.01) -> None:
        """Driven engine: decode on the calling thread until ``until()`` (checked after every token)
        or, with nothing to decode, for at most ``timeout`` seconds. A batch left unfinished stays
        at a token boundary (a safe point: weights may be swapped) until the next call."""
        deadline = time.monotonic() + timeout
        while not until():
            if self._batch is None:
                with self._cv:
                    if self._closed:
                        return
                    if self._pause_depth > 0 or not self._queue:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            return
                        self._cv.wait(min(left, 0.005))
                        continue
                self._batch = self._guarded(self._next_batch())
            with self._cv:
                self._at_safe_point = False
                self._step_version = self._version  # weights swapped while it waited
            if next(self._batch, StopIteration) is StopIteration:
                self._batch = None
        if self._batch is not None:
            with self._cv:
                self._at_safe_point = True
                self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # -- worker thread -----------------------------------------------------------------------
    def _raise_if_failed(self):
        if self._error is not None:
            raise EngineError(f"engine thread failed: {self._error!r}") from self._error

    _on_complete = None  # set only during an inline generate

    def _finish(self, row: _Row, reason: FinishReason) -> None:
        row.done = True
        if self._spec is not None:
            self._spec.finished(row.req.request_id, row.req.prompt_ids, list(row.req.response_so_far) + row.tokens,
                                reason in (FinishReason.STOP, FinishReason.LENGTH))
        routes = torch.cat(row.routes).numpy() if row.routes else None  # (numpy: pickled as bytes to another process)
        c = Completion(row.req.request_id, row.tokens, row.logprobs, row.versions, reason, routes)
        self._out.put(c)
        if self._on_complete is not None:
            self._on_complete(c)

    def _safe_point(self) -> bool:
        """Called with the lock held after each decoding step: wait here while paused (returns
        whether it did)."""
        if self._pause_depth == 0:
            return False
        self._at_safe_point = True
        self._cv.notify_all()
        while self._pause_depth > 0:
            self._cv.wait()
        self._at_safe_point = False
        self._step_version = self._version
        return True

    def _next_batch(self) -> list[_Row] | None:
        """Queued requests with the first one's sampling setting and adapter (one batch per setting and role
        of ``model.lora.per_role``; budgets may differ per row): all of them up to ``max_batch``, in their order,
        the others staying queued in theirs (two roles' requests interleaved make two batches, not one each)."""
        with self._cv:
            while not self._closed and (self._pause_depth > 0 or not self._queue):
                self._cv.wait()
            if self._closed:
                return None
            setting = lambda r: (r.params.temperature, r.params.top_p, r.params.top_k, r.adapter)  # noqa: E731
            first = setting(self._queue[0])
            rows, rest = [], deque()
            while self._queue:
                r = self._queue.popleft()
                if len(rows) < self.max_batch and setting(r) == first:
                    rows.append(_Row(r))
                else:
                    rest.append(r)
            self._queue = rest
            self._busy = True
            self._step_version = self._version
            return rows

    def _loop(self) -> None:
        while True:
            rows = self._next_batch()
            if rows is None:
                return
            for _ in self._guarded(rows):
                pass

    def _guarded(self, rows: list[_Row]) -> Iterator[None]:
        """Decode ``rows`` one token per step; an error fails them and reaches the caller of get()."""
        try:
            with self._guard():
                yield from self._steps(rows)
        except BaseException as e:  # propagate to the caller of get()
            with self._cv:
                for row in rows:
                    if not row.done:
                        self._finish(row, FinishReason.FAILED)
                self._error = e
        finally:
            with self._cv:
                self._busy = False
                self._at_safe_point = False
                self._cv.notify_all()

    def _record(self, rows: list[_Row], tokens: list[list[int]], logprobs: list[list[float]]) -> None:
        """The new tokens of each live row (one, or a verified draft's): record them, finish rows (a row
        stops at its first EOS or at its budget, the tokens after dropped), then the safe point (lock held)."""
        version = self._step_version
        for row, toks, lps in zip(rows, tokens, logprobs):
            start = len(row.tokens)
            for tok, lp in zip(toks, lps):
                row.tokens.append(tok)
                row.logprobs.append(lp)
                row.versions.append(version)
                if tok in self.eos_ids:
                    self._finish(row, FinishReason.STOP)
                elif len(row.tokens) >= row.req.params.max_new_tokens:
                    self._finish(row, FinishReason.LENGTH)
                if row.done:
                    break
            if row.done:
                continue
            if row.req.request_id in self._aborted:
                self._finish(row, FinishReason.ABORTED)
            elif row.req.stream:
                self._out.put(Completion(row.req.request_id, row.tokens[start:], row.logprobs[start:],
                                         row.versions[start:], None))
        if self._safe_point():  # aborts issued during a pause land here, before another token
            for row in rows:
                if not row.done and row.req.request_id in self._aborted:
                    self._finish(row, FinishReason.ABORTED)

    def _run(self, rows: list[_Row]) -> None:
        """Decode ``rows`` until each finishes (EOS, budget, abort)."""
        for _ in self._steps(rows):
            pass

    def _steps(self, rows: list[_Row]) -> Iterator[None]:
        """Decode ``rows`` until each finishes, yielding after every token; with rollout.speculative_lead in the
        parts ``Speculator.batch`` divides them into, one after the other (a lead per prompt first)."""
        parts = self._spec.batch([r.req.prompt_ids for r in rows]) if self._spec is not None else [range(len(rows))]
        for part in parts:
            yield from self._decode([rows[i] for i in part])

    @torch.no_grad()
    def _decode(self, rows: list[_Row]) -> Iterator[None]:
        with self._cv:
            for row in rows:
                if len(row.tokens) >= row.req.params.max_new_tokens:  # a zero budget returns at once
                    self._finish(row, FinishReason.LENGTH)
                elif row.req.request_id in self._aborted:  # (aborted while a lead decoded before it)
                    self._finish(row, FinishReason.ABORTED)
        live = [r for r in rows if not r.done]
        if not live:
            return
        if self._adapter is not None:  # (model.lora.per_role: the batch's role's adapter merged, if not already)
            self._adapter.use(live[0].req.adapter)
        ctx = [r.context for r in live]
        n = max(len(c) for c in ctx)
        ids = torch.tensor([[self.pad_id] * (n - len(c)) + c for c in ctx], device=self.device)
        att = torch.tensor([[0] * (n - len(c)) + [1] * len(c) for c in ctx], device=self.device)
        pos = (att.cumsum(-1) - 1).clamp(min=0)
        p = live[0].req.params
        if self._fast is not None:
            budget = max(r.req.params.max_new_tokens - len(r.tokens) for r in live)
            with self._recording(live, [len(c) for c in ctx], lambda: self._fast.rows_of):
                logits, cache = self._fast.prefill(ids, att, pos, n + min(budget, 256))
        else:
            cache = DynamicCache(config=self.model.config)
            with self._recording(live, [len(c) for c in ctx]):
                logits = self.model(**vision.inputs(self.model, ids, [r.req.images for r in live], self._images),
                                    attention_mask=att, position_ids=pos, **{self._cache_kw: cache},
                                    use_cache=True).logits[:, -1, :]
        pos = pos[:, -1]
        seeded = any(r.req.params.seed is not None for r in live)  # (-1: a row on the engine's stream)
        seeds = torch.tensor([-1 if r.req.params.seed is None else r.req.params.seed for r in live],
                             device=self.device) if seeded else None
        at = torch.tensor([len(c) for c in ctx], device=self.device)  # where in its context a row samples next
        drawn = None  # the tokens a verified draft emitted (speculative decoding), in place of sampling
        started = None  # when the decoding forward began (speculative decoding: what a forward costs)
        while True:
            if drawn is None:
                # (float32 scores whatever the engine's dtype, rollout.dtype: the log-probs are float32 values, from
                # its bfloat16 logits upcast, as the trainer takes its own from float32 logits)
                scores = sampling_scores(logits, p.temperature, p.top_k, p.top_p)  # the trainer reproduces this
                tok = sample_tokens(scores, seeds, at) if p.temperature > 0 else scores.argmax(-1)
                lps = torch.log_softmax(scores, dim=-1).gather(1, tok[:, None]).squeeze(1)
                drawn = [[t] for t in tok.tolist()], [[lp] for lp in lps.tolist()]
                if self._spec is not None:  # (counted, timed from ``started``, the declined drafts probed)
                    self._spec.plain(drawn[0], started)
            else:  # the last token each row emitted is the one fed next
                tok = torch.tensor([t[-1] for t in drawn[0]], device=self.device)
            emitted = torch.tensor([len(t) for t in drawn[0]], device=self.device)
            with self._cv:
                self._record(live, *drawn)
            drawn = None
            keep = [i for i, r in enumerate(live) if not r.done]
            if not keep:
                return
            yield  # a token boundary: a driven engine may stop here (and be paused, aborted, swapped)
            with self._cv:
                for row in live:
                    if not row.done and row.req.request_id in self._aborted:
                        self._finish(row, FinishReason.ABORTED)
            keep = [i for i, r in enumerate(live) if not r.done]
            if not keep:
                return
            if len(keep) < len(live):  # finished rows leave the batch and the KV cache
                if self._fast is not None:
                    keep = cache.keep(keep)  # (the rows reordered: a few moved, not the cache copied)
                else:
                    select_rows(cache, torch.tensor(keep, device=self.device), len(live))
                idx = torch.tensor(keep, device=self.device)
                live, tok, att, pos, at = [live[i] for i in keep], tok[idx], att[idx], pos[idx], at[keep]
                emitted = emitted[idx]
                seeds = seeds[keep] if seeds is not None else None
            pos, at = pos + emitted, at + emitted  # (pos: the fed token's; at: the next one sampled)
            if self._spec is not None:
                drawn = self._speculate(live, tok, pos, at, seeds, cache, p)
                if drawn is not None:
                    continue
            if self._fast is not None:
                started = time.perf_counter()
                with self._recording(live, [1] * len(live)):
                    logits = self._fast.decode(tok, pos, cache)
                continue
            att = torch.cat([att, att.new_ones(len(live), 1)], dim=1)
            with self._recording(live, [1] * len(live)):
                logits = self.model(input_ids=tok[:, None], attention_mask=att, position_ids=pos[:, None],
                                    **{self._cache_kw: cache}, use_cache=True).logits[:, -1, :]

    def _recording(self, live: list[_Row], real: list[int], rows_of=None):
        """A forward of ``live``'s rows: with a mixture of experts, their fed tokens' routes (``RowRoutes``)."""
        return contextlib.nullcontext() if self._routes is None else self._routes.forward(live, real, rows_of)

    def _speculate(self, live: list[_Row], tok, pos, at, seeds, cache, p) -> tuple[list, list] | None:
        """Drafts for the live rows verified in one forward (``speculative.verify``, exact): the tokens and
        log-probs each row emits; None when no row has a draft (a plain decoding step then)."""
        rows = [(r.req.request_id, r.req.prompt_ids, r.req.response_so_far + r.tokens if r.req.response_so_far
                 else r.tokens, r.req.params.max_new_tokens - len(r.tokens)) for r in live]
        drafts, sources = self._spec.drafts(rows)
        width = max(map(len, drafts)) + 1
        if width == 1:
            return None
        started, offsets = time.perf_counter(), torch.arange(width, device=self.device)
        with contextlib.nullcontext() if self._routes is None else self._routes.captured():
            fed = torch.cat([tok[:, None], padded(drafts, self.device)], 1)
            logits = self._fast.verify(fed, pos[:, None] + offsets, cache)
        scores = sampling_scores(logits, p.temperature, p.top_k, p.top_p)
        draw = lambda s: draw_positions(s, p.temperature, seeds, at)  # noqa: E731  (as plain decoding draws)
        tokens, logprobs, accepted = verify(scores, drafts, draw)
        self._spec.timed(len(live) * width, time.perf_counter() - started)
        self._fast.reject(cache, accepted, width)
        if self._routes is not None:  # (a mixture of experts: the routes of the tokens each row keeps)
            self._routes.verified(live, width, accepted)
        self._spec.accepted([r[0] for r in rows], drafts, accepted, sources)
        self._spec.forward(len(live), sum(map(len, tokens)))
        return tokens, logprobs
