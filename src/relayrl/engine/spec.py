"""What an engine is built from, wherever it runs: ``EngineSpec`` (picklable: it travels to an engine
process or a Ray actor) and ``build_local_engine``, which builds one engine in the calling process.
Engines that run elsewhere (``process``, ``ray_engine``) are handed a spec and build from it here,
so they never import ``placement``, which decides where engines run.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

from relayrl.config.sections import RolloutCfg
from relayrl.engine import make_engine
from relayrl.engine.base import Engine
from relayrl.lora_weights import LoraSpec


@dataclass(frozen=True)
class EngineSpec:
    rollout: RolloutCfg  # the rollout section: engine kind, batch, sampling and vLLM settings
    weights: str  # the policy's weights (a folder ``from_pretrained`` reads)
    tokenizer: str
    dtype: str  # model.dtype
    version: int = 0  # the policy version the weights are
    threads: int = 0  # torch threads of the engine's process (0: leave as is)
    seed: int = 0
    max_model_len: int = 2048  # vLLM's context
    # model.lora: the engine keeps its base weights and load_weights receives adapters only (lora_weights.LoraSpec)
    lora: LoraSpec | None = None
    routes: bool = False  # vLLM: return each fed token's experts (algo.routing_replay=r3 on a mixture of experts)

    @property
    def engine_dtype(self) -> str:
        """The dtype of the engine's copy of the weights: ``rollout.dtype``, or model.dtype where it is 'auto'
        (vLLM: always model.dtype; the config refuses rollout.dtype there)."""
        r = self.rollout
        return self.dtype if r.dtype == "auto" or r.engine == "vllm" else r.dtype

    def reseeded(self, seed: int) -> "EngineSpec":
        return dataclasses.replace(self, seed=seed)


def engine_spec(rollout: RolloutCfg, dtype: str, weights: str, tokenizer_path: str, version: int, seed: int,
                engine_threads: int, lora: LoraSpec | None = None, routes: bool = False) -> EngineSpec:
    """The spec of the run's engines (``rollout``: the config's rollout section, ``dtype``: model.dtype; ``lora``:
    the adapter's shape with model.lora, ``weights`` then being the base model's)."""
    from relayrl.models.prompts import model_context

    return EngineSpec(rollout, weights, tokenizer_path, dtype, version, engine_threads, seed,
                      rollout.vllm_max_model_len or model_context(weights) or 2048, lora, routes)


def eos_token_ids(weights: str, tokenizer) -> list[int]:
    """The ids that end a response: the model's generation config, else the tokenizer's EOS."""
    from transformers import GenerationConfig

    eos = None
    with contextlib.suppress(Exception):
        eos = GenerationConfig.from_pretrained(weights).eos_token_id
    eos = eos if eos is not None else tokenizer.eos_token_id
    return [e for e in (eos if isinstance(eos, list) else [eos]) if e is not None]


def lora_versions(r: RolloutCfg) -> int:
    """Adapter versions sampled at once at most, with model.lora: the staleness bound + 1. In async mode requests in
    flight were submitted at most rollout.max_staleness versions back; periodic mode's bound is 1 and sync's 0,
    where rollout.max_staleness keeps its default (2: it may only be set in async mode), which covers both."""
    return max(1, r.max_staleness) + 1


def build_local_engine(spec: EngineSpec, driven: bool = False, model=None, tokenizer=None) -> Engine:
    """One engine, in the calling process (``model``/``tokenizer``: already loaded, else from the spec). A
    ``model`` passed becomes the engine's: it is moved to ``rollout.device`` and cast to ``spec.engine_dtype``
    in place."""
    from relayrl.models import DTYPES, load_policy, load_tokenizer

    r = spec.rollout
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(spec.tokenizer)
    if r.engine == "vllm":
        from relayrl.engine.vllm import VLLMEngine

        return VLLMEngine(spec.weights, eos_token_ids(spec.weights, tokenizer), dtype=spec.dtype,
                          version=spec.version, max_model_len=spec.max_model_len, seed=spec.seed,
                          gpu_memory_utilization=r.vllm_gpu_memory_utilization, max_num_seqs=r.max_batch,
                          sleep=r.vllm_sleep, lora=spec.lora, lora_versions=lora_versions(r), routes=spec.routes,
                          speculative=r.speculative_max_draft if r.speculative == "on" else 0,
                          weight_sync=r.weight_sync, sync_bucket_mb=r.sync_bucket_mb, sync_timeout_s=r.sync_timeout_s)
    from relayrl.models.devices import resolve_device

    adapter = None
    if spec.lora is not None:
        # loaded in model.dtype: the adapter merges from its copy of the base as loaded (on the CPU), taken
        # before the cast to the engine's dtype (rollout.dtype)
        from relayrl.engine.adapter import AdapterMerge

        model = model if model is not None else load_policy(spec.weights, spec.dtype)
        adapter = AdapterMerge(model, spec.lora)
    model = model if model is not None else load_policy(spec.weights, spec.engine_dtype)
    model = model.to(resolve_device(r.device, "rollout.device"), DTYPES[spec.engine_dtype])
    return make_engine(r, model, tokenizer, version=spec.version, driven=driven, adapter=adapter)
