"""How long an engine process takes to be ready, and where the time goes.

Overlapped modes (``run.mode=async``/``stream``) put the hf engine in a process of its own, which the
run waits for before its first step: on time-to-accuracy runs that start-up is part of the time. This
measures (1) ``ProcessEngine`` from construction to ready, as the pipeline waits for it, and (2) the
same work step by step in a spawned child with a timestamp after each phase: interpreter start,
``import torch``, the device's initialisation, ``import transformers``, relayrl's modules, building
the engine (model to the device, the decoding-forward check), a first short generation. The
in-process engine (what sync mode builds) is timed beside them.

    python benchmarks/engine_startup.py                 # on the CPU
    python benchmarks/engine_startup.py --device cuda
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def phases(spawned_at: float, device: str, model: str, q) -> None:
    marks = [("interpreter up", time.time() - spawned_at)]
    t = time.time()

    def mark(name):
        nonlocal t
        now = time.time()
        marks.append((name, now - t))
        t = now

    import torch

    mark("import torch")
    if device == "cuda":
        torch.zeros(1, device="cuda")
        mark("CUDA initialised")
    import transformers  # noqa: F401

    mark("import transformers")
    from relayrl.config import load_config
    from relayrl.engine.spec import build_local_engine, engine_spec
    from relayrl.records import GenRequest, SamplingParams

    mark("import relayrl")
    cfg = load_config(None, [f"model.path={model}", f"rollout.device={device}"])
    eng = build_local_engine(engine_spec(cfg.rollout, cfg.model.dtype, model, model, 0, 0, 0))
    mark("build the engine (load, to the device, check)")
    eng.generate([GenRequest("w", [1, 2, 3], SamplingParams(8, 1.0))])
    mark("first generation (8 tokens)")
    eng.close()
    q.put(marks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--model", default="builtin:demo")
    a = ap.parse_args()
    from relayrl.config import load_config
    from relayrl.models import load_policy, resolve_model_path
    from relayrl.engine.placement import open_engine
    from relayrl.engine.spec import build_local_engine, engine_spec

    model = resolve_model_path(a.model)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=phases, args=(time.time(), a.device, model, q))
    p.start()
    marks = q.get(timeout=600)
    p.join()
    print("a spawned child, phase by phase:")
    for name, s in marks:
        print(f"  {name:48s} {s:6.2f} s")
    print(f"  {'total':48s} {sum(s for _, s in marks):6.2f} s")

    cfg = load_config(None, [f"model.path={model}", "run.mode=async", f"rollout.device={a.device}"])
    sd = load_policy(model).state_dict()
    t0 = time.perf_counter()
    eng = open_engine(engine_spec(cfg.rollout, cfg.model.dtype, model, model, 0, 0, 1), cfg.run, cfg.ray, state_dict=sd)
    ready = time.perf_counter() - t0
    eng.close()
    t0 = time.perf_counter()
    eng = build_local_engine(engine_spec(cfg.rollout, cfg.model.dtype, model, model, 0, 0, 0))
    local = time.perf_counter() - t0
    eng.close()
    print(f"ProcessEngine, construction to ready (what async mode waits for): {ready:.2f} s")
    print(f"the engine in this process (sync mode; imports already done):     {local:.2f} s")


if __name__ == "__main__":
    main()
