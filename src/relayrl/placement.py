"""Where generation runs: which engine, how many, in which process, on which cores.

    rollout.engine    hf | hf-cb | vllm        what decodes
    rollout.engines   N                        data-parallel engines behind ``EngineRouter``
    run.backend       local | ray              child processes here, or Ray actors (restarted)

``open_engine`` builds the one ``Engine`` the rollout talks to; ``build_local_engine`` builds a
single engine wherever it runs (this process, an engine process, a Ray actor) from a plain spec.
"""

from __future__ import annotations

import contextlib
import os

from relayrl.engine import make_engine
from relayrl.engine.base import Engine


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def threads(cfg) -> tuple[bool, int, int]:
    """(hf engine in its own process?, engine threads, trainer threads). Overlapped modes put the
    engine in its own process and split the cores between the two; otherwise both use all cores."""
    r, n = cfg.rollout, cores()
    own = r.engine_process if r.engine_process is not None else cfg.run.mode != "sync"
    own = own or r.engines > 1 or cfg.run.backend == "ray"  # (a router needs engines with threads of their own)
    if not (own and cfg.run.mode != "sync"):
        return own, r.engine_threads, cfg.run.threads or n
    engine = r.engine_threads or max(1, n // 2)
    return own, engine, cfg.run.threads or max(1, n - engine)


def eos_token_ids(weights: str, tokenizer) -> list[int]:
    """The ids that end a response: the model's generation config, else the tokenizer's EOS."""
    from transformers import GenerationConfig

    eos = None
    with contextlib.suppress(Exception):
        eos = GenerationConfig.from_pretrained(weights).eos_token_id
    eos = eos if eos is not None else tokenizer.eos_token_id
    return [e for e in (eos if isinstance(eos, list) else [eos]) if e is not None]


def engine_spec(cfg, weights: str, tokenizer_path: str, version: int, seed: int, engine_threads: int) -> dict:
    """What ``build_local_engine`` needs, picklable (for engine processes and Ray actors)."""
    from relayrl.models import model_context

    return {"rollout": cfg.rollout, "weights": weights, "tokenizer": tokenizer_path, "dtype": cfg.model.dtype,
            "version": version, "threads": engine_threads, "seed": seed,
            "max_model_len": cfg.rollout.vllm_max_model_len or model_context(weights) or 2048}


def build_local_engine(spec: dict, driven: bool = False, model=None, tokenizer=None) -> Engine:
    """One engine, in the calling process (``model``/``tokenizer``: already loaded, else from the spec)."""
    from relayrl.models import load_policy, load_tokenizer

    r = spec["rollout"]
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(spec["tokenizer"])
    if r.engine == "vllm":
        from relayrl.engine.vllm import VLLMEngine

        return VLLMEngine(spec["weights"], eos_token_ids(spec["weights"], tokenizer), dtype=spec["dtype"],
                          version=spec["version"], max_model_len=spec["max_model_len"], seed=spec["seed"],
                          gpu_memory_utilization=r.vllm_gpu_memory_utilization, max_num_seqs=r.max_batch,
                          sleep=r.vllm_sleep)
    from relayrl.distributed import resolve_device

    model = model if model is not None else load_policy(spec["weights"], spec["dtype"])
    model = model.to(resolve_device(r.device, "rollout.device"))
    return make_engine(r, model, tokenizer, version=spec["version"], driven=driven)


def open_engine(cfg, spec: dict, state_dict=None, tokenizer=None, run_name: str = "run") -> Engine:
    """The engine the rollout uses (``spec`` from ``engine_spec``). ``state_dict``: the policy's
    weights, when they are already in memory (an hf engine process shares them)."""
    own, _, _ = threads(cfg)
    r = cfg.rollout
    with contextlib.ExitStack() as undo:  # engines started before one that fails are closed again
        engines = []
        for i in range(r.engines):
            seeded = {**spec, "seed": spec["seed"] + 1_000_000_007 * i}  # (engine 0: the spec's seed)
            e = _one(cfg, seeded, own, state_dict, tokenizer, f"relayrl-{run_name}-engine-{i}")
            undo.callback(e.close)
            engines.append(e)
        undo.pop_all()
    if len(engines) == 1:
        return engines[0]
    from relayrl.engine.router import EngineRouter

    return EngineRouter(engines)


def _one(cfg, spec: dict, own: bool, state_dict, tokenizer, name: str) -> Engine:
    if cfg.run.backend == "ray":
        from relayrl.engine.ray_engine import RayEngine

        start_ray(cfg)
        import ray  # the driver's job id in the name: two runs of one run.name on a shared cluster do not collide

        return RayEngine(spec, f"{name}-job{ray.get_runtime_context().get_job_id()}",
                         max_restarts=cfg.ray.max_engine_restarts)
    if cfg.rollout.engine == "vllm":  # (vLLM's engine core is a process of its own already)
        return build_local_engine(spec, tokenizer=tokenizer)
    if own:
        from relayrl.engine.process import ProcessEngine
        from relayrl.models import load_policy

        if state_dict is None:
            state_dict = load_policy(spec["weights"], spec["dtype"]).state_dict()
        return ProcessEngine(spec["rollout"], spec["weights"], spec["tokenizer"], spec["dtype"], state_dict,
                             spec["version"], spec["threads"], seed=spec["seed"])
    return build_local_engine(spec, driven=True, tokenizer=tokenizer)


def start_ray(cfg) -> None:
    """Join ``ray.address``, or start a local cluster (once per process)."""
    try:
        import ray
    except ImportError:
        raise ValueError("run.backend=ray: Ray is not installed; pip install -e '.[ray]'") from None
    if ray.is_initialized():
        return
    if cfg.ray.address:
        kw = {"address": cfg.ray.address}
    else:  # a local cluster of this process only: no token to hand around
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        kw = {"num_cpus": cfg.ray.num_cpus or cores()}
    ray.init(include_dashboard=False, log_to_driver=False, namespace="relayrl", **kw)


def engine_counters(engine) -> dict:
    """Restarts of dead engine actors and the requests they re-ran, summed over a router's engines."""
    engines = getattr(engine, "engines", [engine])
    return {"engine_restarts_total": sum(getattr(e, "restarts", 0) for e in engines),
            "engine_requeued_total": sum(getattr(e, "requeued", 0) for e in engines)}
