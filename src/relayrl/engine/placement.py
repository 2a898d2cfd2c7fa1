"""Where generation runs: which engine, how many, in which process, on which cores.

    rollout.engine    hf | hf-cb | vllm        what decodes
    rollout.engines   N                        data-parallel engines behind ``EngineRouter``
    run.backend       local | ray              child processes here, or Ray actors (restarted)

``open_engine`` builds the one ``Engine`` the rollout talks to from an ``EngineSpec``
(``engine.spec``), which the engines that run elsewhere build from in their own process.
"""

from __future__ import annotations

import contextlib
import os
import time

from relayrl.config.rules import own_engine_process
from relayrl.config.sections import RayCfg, RolloutCfg, RunCfg
from relayrl.engine.base import Engine
from relayrl.engine.spec import EngineSpec, build_local_engine


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _cpu_times() -> dict[int, tuple[int, int]]:
    """Per core: (idle + iowait, total) jiffies since boot (Linux's /proc/stat; empty elsewhere)."""
    out = {}
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("cpu") and line[3].isdigit():
                    name, *v = line.split()
                    v = [int(x) for x in v[:8]]
                    out[int(name[3:])] = (v[3] + v[4], sum(v))
    except OSError:
        pass
    return out


def free_cores(sample_s: float = 0.3) -> int:
    """How many of this process's cores other processes leave free now: the idle share of each,
    summed over ``sample_s`` (at least 1). A thread per core that a neighbour keeps busy slows every
    parallel region to the pace of the thread that shares its core (torch splits the work evenly),
    and waits spin: one busy neighbour made the default demo 3.7x slower, a second run beside it 35-60x."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    a = _cpu_times()
    if not a or not allowed:
        return cores()
    time.sleep(sample_s)
    b = _cpu_times()
    idle = sum((b[c][0] - a[c][0]) / max(1, b[c][1] - a[c][1]) for c in allowed if c in a and c in b)
    return max(1, min(len(allowed), int(idle + 0.25)))  # (a core three-quarters idle counts as free)


def threads(r: RolloutCfg, run: RunCfg, free: int | None = None) -> tuple[bool, int, int]:
    """(hf engine in its own process?, engine threads, trainer threads). Overlapped modes put the
    engine in its own process and split the free cores (``free_cores``) between the two; otherwise
    both use all the free cores. ``run.threads`` and ``rollout.engine_threads`` set them instead."""
    own = own_engine_process(r, run)
    n = free if free is not None else (cores() if run.threads and (r.engine_threads or not own) else free_cores())
    if not (own and run.mode != "sync"):
        return own, r.engine_threads, run.threads or n
    engine = r.engine_threads or max(1, n // 2)
    return own, engine, run.threads or max(1, n - engine)


def open_engine(spec: EngineSpec, run: RunCfg, ray_cfg: RayCfg, state_dict=None, tokenizer=None) -> Engine:
    """The engine the rollout uses. ``state_dict``: the policy's weights, when they are already in
    memory (an hf engine process shares them)."""
    own = own_engine_process(spec.rollout, run)
    if run.backend == "ray":  # (before any starts: a cluster that cannot hold them all is one line, not a wait)
        from relayrl.engine.ray_engine import check_placement

        start_ray(ray_cfg)
        check_placement(ray_cfg.engine_resources, spec.rollout.engines, "run.backend=ray")
    with contextlib.ExitStack() as undo:  # engines started before one that fails are closed again
        engines = []
        for i in range(spec.rollout.engines):
            seeded = spec.reseeded(spec.seed + 1_000_000_007 * i)  # (engine 0: the spec's seed)
            e = _one(seeded, run, ray_cfg, own, state_dict, tokenizer, f"relayrl-{run.name}-engine-{i}")
            undo.callback(e.close)
            engines.append(e)
        undo.pop_all()
    if len(engines) == 1:
        return engines[0]
    from relayrl.engine.router import EngineRouter

    return EngineRouter(engines)


def _one(spec: EngineSpec, run: RunCfg, ray_cfg: RayCfg, own: bool, state_dict, tokenizer, name: str) -> Engine:
    if run.backend == "ray":
        from relayrl.engine.ray_engine import RayEngine

        start_ray(ray_cfg)
        import ray  # the driver's job id in the name: two runs of one run.name on a shared cluster do not collide

        return RayEngine(spec, f"{name}-job{ray.get_runtime_context().get_job_id()}",
                         max_restarts=ray_cfg.max_engine_restarts, resources=ray_cfg.engine_resources)
    if spec.rollout.engine == "vllm":  # (vLLM's engine core is a process of its own already)
        return build_local_engine(spec, tokenizer=tokenizer)
    if own:
        from relayrl.engine.process import ProcessEngine
        from relayrl.models import load_policy

        if state_dict is None:
            state_dict = load_policy(spec.weights, spec.dtype).state_dict()
        return ProcessEngine(spec, state_dict)
    return build_local_engine(spec, driven=True, tokenizer=tokenizer)


def start_ray(ray_cfg: RayCfg) -> None:
    """Join ``ray.address``, or start a local cluster (once per process)."""
    try:
        import ray
    except ImportError:
        raise ValueError("run.backend=ray: Ray is not installed; pip install -e '.[ray]'") from None
    if ray.is_initialized():
        return
    if ray_cfg.address:
        kw = {"address": ray_cfg.address}
    else:  # a local cluster of this process only: no token to hand around
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        kw = {"num_cpus": ray_cfg.num_cpus or cores()}
    ray.init(include_dashboard=False, log_to_driver=False, namespace="relayrl", **kw)


def sync_notes(engine) -> str:
    """How weight updates reach the engines (``sync_note`` of vLLM's and Ray's), each distinct note once."""
    notes = [getattr(e, "sync_note", "") for e in getattr(engine, "engines", [engine])]
    return "; ".join(dict.fromkeys(n for n in notes if n))


def placement_note(engine) -> str:
    """Where Ray's engine actors run (``engines on Ray nodes: 10.0.0.2:6380 (id 1a2b3c4d) ×2``); '' for other engines."""
    from collections import Counter

    nodes = [e.node for e in getattr(engine, "engines", [engine]) if getattr(e, "node", "")]
    if not nodes:
        return ""
    from relayrl.engine.ray_engine import describe_node

    return "engines on Ray nodes: " + ", ".join(f"{describe_node(n)} ×{k}" for n, k in Counter(nodes).items())


def engine_counters(engine) -> dict:
    """Restarts of dead engine actors and the requests they re-ran, summed over a router's engines."""
    engines = getattr(engine, "engines", [engine])
    return {"engine_restarts_total": sum(getattr(e, "restarts", 0) for e in engines),
            "engine_requeued_total": sum(getattr(e, "requeued", 0) for e in engines)}


def spec_metrics(engine, on: bool, total: dict | None = None) -> dict:
    """Speculative decoding's ``spec/...`` metrics since the last call, summed over a router's engines (none
    with ``rollout.speculative=off``; zeros in a step whose engines drafted nothing); their counts are added to
    ``total`` (the run's, ``RunState.speculative``)."""
    from relayrl.engine.speculative import add_counts, metrics

    if not on:
        return {}
    counts: dict[str, int] = {}
    for e in getattr(engine, "engines", [engine]):
        take = getattr(e, "take_spec", None)
        add_counts(counts, take() if take is not None else {})
    if total is not None:
        add_counts(total, counts)
    return metrics(counts)
