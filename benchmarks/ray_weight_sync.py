"""A full-weight update to an engine that is a Ray actor (``run.backend=ray``): through Ray's object store against
through the collective (``rollout.weight_sync``), side by side, with the actor on the trainer's node.

The model is random weights of a real model's shape (``benchmarks/weight_sync.py``'s shapes: Qwen2.5-0.5B by
default), held by an ``hf`` engine in the actor. Each path updates ``--repeats`` times; printed: seconds an update
(``load_weights`` returning: the actor holds the new weights), the trainer's and the actor's peak resident memory
above their level before the updates, and the ratio object store / collective (``auto`` takes the collective).

    python benchmarks/ray_weight_sync.py
    python benchmarks/ray_weight_sync.py --shape 8b-layers --bucket-mb 1100
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_info, results_dir, write_results  # noqa: E402
from weight_sync import SHAPES, Peak, build  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import psutil
    import ray

    from relayrl.config import RolloutCfg
    from relayrl.engine.ray_engine import RayEngine
    from relayrl.engine.spec import EngineSpec
    from relayrl.demo import model as demo_model

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="bench")
    rows, data = [], {"machine": machine_info(), "shape": args.shape, "dtype": args.dtype, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        model = build(args.shape, Path(tmp), args.dtype)
        demo_model.build_tokenizer(0, 512).save_pretrained(tmp)  # (the engine needs one; the update does not use it)
        sd = model.state_dict()
        new = {k: v + 1e-3 for k, v in sd.items()}
        size = sum(v.numel() * v.element_size() for v in sd.values()) / 2**30
        print(f"{args.shape}: {size:.2f} GiB in {args.dtype}; an hf engine in a Ray actor on this node")
        times = {}
        for path in ("file", "collective"):
            r = RolloutCfg(weight_sync=path, sync_bucket_mb=args.bucket_mb, sync_timeout_s=600)
            spec = EngineSpec(r, tmp, tmp, args.dtype, threads=1, max_model_len=512)
            eng = RayEngine(spec, f"bench-{path}")
            try:
                actor = psutil.Process(ray.get(eng._actor.pid.remote()))
                peak, took = Peak([psutil.Process(), actor]), []
                for i in range(args.repeats):
                    t0 = time.perf_counter()
                    eng.load_weights(new, i + 1)
                    took.append(time.perf_counter() - t0)
                mem = peak.end()
            finally:
                eng.close()
            times[path] = min(took)
            name = "object store" if path == "file" else "collective"
            data["runs"].append({"path": name, "bucket_mb": args.bucket_mb, "seconds": took, "peak_gib": mem})
            rows.append([name, str(args.bucket_mb) if path == "collective" else "—", f"{min(took):.2f}",
                         f"{sum(took) / len(took):.2f}", f"{mem[0]:.2f}", f"{mem[1]:.2f}"])
        rows.append(["object store / collective", "", f"{times['file'] / times['collective']:.2f}x", "", "", ""])
    ray.shutdown()
    header = ["path", "bucket MB", "s an update (best)", "s (mean)", "trainer peak +GiB", "actor peak +GiB"]
    write_results(results_dir(args.out), f"ray_weight_sync-{args.shape}", header, rows, data)


if __name__ == "__main__":
    main()
