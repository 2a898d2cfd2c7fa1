"""The evidence behind ``run.mismatch_alarm``: how far apart the engine's and the trainer's log-probs of
the engine's own tokens are (``logprob_mismatch_mean``, per token, under the weights of the version that
sampled them) when the engine samples the trained policy, and when it does not.

Each scenario is the demo (``relayrl train`` in this process, the alarm off) for ``--steps`` steps:

    float32 engine              the default: the engine's copy in model.dtype
    bfloat16 engine             rollout.dtype=bfloat16 (the mismatch real users have with vLLM in bf16)
    vLLM (CPU build)            rollout.engine=vllm (skipped where vLLM is not installed)
    sync broken after step K    the engine keeps its version count but stops taking the weights from
                                the K-th update on (the "adapter silently not applied" of verl #3516)

and prints, per scenario, the mismatch of each step (all fresh tokens; and the rows checked against both
this version's weights and the previous version's), and the step at which the loop's rule
(``run.loop.check_sampling``) with the default threshold would stop the run: never on a correct engine,
at the first step after the break on a broken one (the tokens of the step of the break were sampled
before it).

    python benchmarks/mismatch_alarm.py                 # 8 steps each, the sync broken from update 2
    python benchmarks/mismatch_alarm.py --lora 8        # the same with model.lora.r=8 (adapter-only sync)
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_info, write_results


@contextlib.contextmanager
def broken_sync(from_update: int):
    """Engines (hf, hf-cb) that stop copying the weights they are sent from the ``from_update``-th update on,
    keeping the version they are told: they go on sampling the weights they had."""
    from relayrl.engine import hf, hf_cb

    real, calls = hf.copy_weights, [0]

    def skipping(model, state_dict):
        calls[0] += 1
        if calls[0] < from_update:
            real(model, state_dict)

    hf.copy_weights = hf_cb.copy_weights = skipping
    try:
        yield
    finally:
        hf.copy_weights = hf_cb.copy_weights = real


KEYS = ("logprob_mismatch_mean", "logprob_mismatch_check", "logprob_mismatch_check_prev_weights")


def run(overrides: list[str], steps: int) -> list[dict]:
    """Each step's mismatch metrics (the alarm on, so that its check runs, but at a threshold nothing reaches)."""
    import json

    from rich.console import Console

    from relayrl.config import load_config
    from relayrl.run.loop import train

    with tempfile.TemporaryDirectory() as d:
        cfg = load_config(None, [f"run.output_dir={d}", f"run.steps={steps}", "run.mismatch_alarm=1e9",
                                 "data.eval_path=null", "run.progress=false", *overrides])
        with open("/dev/null", "w") as null:
            train(cfg, console=Console(file=null))
        rows = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: r.get(k) for k in ("step", "logprob_mismatch_tokens", "logprob_mismatch_max", *KEYS)}
            for r in rows if "step" in r]


def fired(per_step: list[dict], alarm: float) -> int | None:
    """The first step at which ``run.mismatch_alarm=alarm`` would have stopped the run (the loop's own rule)."""
    from relayrl.engine.base import PolicyMismatch
    from relayrl.run.loop import check_sampling

    for m in per_step:
        try:
            check_sampling(m, alarm, m["step"] - 1)
        except PolicyMismatch:
            return m["step"]
    return None


def _g(x) -> str:
    return "-" if x is None else f"{x:.2g}"


def main() -> None:
    from relayrl.config import RunCfg

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--break-at", type=int, default=2, help="the first weight update the broken engine ignores")
    ap.add_argument("--lora", type=int, default=0, help="model.lora.r of every scenario (0: full fine-tuning)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--alarm", type=float, default=RunCfg.model_fields["mismatch_alarm"].default,
                    help="the threshold whose firing step is reported (default: run.mismatch_alarm's default)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="mismatch_alarm")
    a = ap.parse_args()
    base = [f"run.seed={a.seed}"] + ([f"model.lora.r={a.lora}"] if a.lora else [])
    scenarios = [("float32 engine", [], False), ("bfloat16 engine", ["rollout.dtype=bfloat16"], False)]
    try:
        import vllm  # noqa: F401

        scenarios.append(("vLLM (CPU build)", ["rollout.engine=vllm"], False))
    except ImportError:
        print("vLLM is not installed: its row is skipped")
    scenarios += [(f"sync broken from update {a.break_at}", [], True),
                  (f"bfloat16 engine, sync broken from update {a.break_at}", ["rollout.dtype=bfloat16"], True)]
    data = {"machine": machine_info(), "args": vars(a), "results": {}}
    rows = []
    for name, extra, broken in scenarios:
        with broken_sync(a.break_at) if broken else contextlib.nullcontext():
            per_step = run(base + extra, a.steps)
        data["results"][name] = per_step
        step = fired(per_step, a.alarm)
        expect = f"step {a.break_at + 1}" if broken else "never"
        rows.append([name, " ".join(_g(m[KEYS[0]]) for m in per_step),
                     " ".join(f"{_g(m[KEYS[1]])}/{_g(m[KEYS[2]])}" for m in per_step),
                     f"step {step}" if step else "never", expect])
        print(" | ".join(rows[-1]), flush=True)
    write_results(Path(a.out), a.name + (f"_lora{a.lora}" if a.lora else ""),
                  ["scenario", "logprob_mismatch_mean per step",
                   "rows checked: under this version's weights / the previous version's",
                   f"alarm ({a.alarm:g}) fires at", "should fire at"], rows, data)


if __name__ == "__main__":
    main()
