"""Routing replay measured: a bfloat16 engine (relayrl's hf engine, recording routes) beside a float32 trainer,
on mixture-of-experts models, without replay (algo.routing_replay=off) and with it (r3), against a dense model of
the same attention and active FFN width: the routing difference (``moe/routing_diff``) and the log-prob mismatch
(mean and max |trainer − engine| over the sampled tokens).

    python benchmarks/moe_replay.py --device cuda                          # tiny and Qwen3-30B-A3B per layer, 4 layers
    python benchmarks/moe_replay.py --device cpu --shapes tiny --rows 8    # check the script
    python benchmarks/moe_replay.py --model PATH                           # a saved (trained) MoE, e.g. moe_demo.py's

Shapes are randomly initialised from their configs (no download; a trained router is sharper than a random one, so
random models flip more near-ties than trained ones do): ``tiny`` (hidden 64, 8 experts, top-2, 2 layers) and
``30b-a3b-<n>l`` (``trainer_scale.QWEN3_30B_A3B``: hidden 2048, 128 experts of FFN 768, top-8, n layers).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_info, results_dir, write_results  # noqa: E402
from trainer_scale import QWEN3_30B_A3B  # noqa: E402

TINY = dict(QWEN3_30B_A3B, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_experts=8,
            num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=1000,
            num_hidden_layers=2)


def shape_of(name: str) -> dict:
    if name == "tiny":
        return TINY
    if name.startswith("30b-a3b-") and name.endswith("l"):
        return dict(QWEN3_30B_A3B, num_hidden_layers=int(name[len("30b-a3b-"):-1]))
    raise SystemExit(f"unknown shape {name!r}: tiny or 30b-a3b-<n>l")


def build(shape: dict, dense: bool, seed: int = 0):
    """The MoE of ``shape``, or (``dense``) a qwen3 of its attention with a dense FFN as wide as its active experts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {k: v for k, v in shape.items() if k != "model_type"}
    if dense:
        moe_keys = ("moe_intermediate_size", "num_experts", "num_experts_per_tok", "norm_topk_prob",
                    "decoder_sparse_step", "mlp_only_layers")
        cfg = {k: v for k, v in cfg.items() if k not in moe_keys}
        cfg["intermediate_size"] = shape["num_experts_per_tok"] * shape["moe_intermediate_size"]
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3" if dense else "qwen3_moe", **cfg)).eval()


def sample(model, vocab: int, device: str, rows: int, prompt: int, new: int):
    """Trajectories a bfloat16 hf engine samples from ``model`` (T=1, each row seeded), with their routes."""
    from relayrl.engine.hf import HFEngine
    from relayrl.models import moe
    from relayrl.records import GenRequest, Prompt, SamplingParams, Trajectory

    tok = SimpleNamespace(pad_token_id=0, eos_token_id=1)
    engine = HFEngine(copy.deepcopy(model).to(device=device, dtype=torch.bfloat16), tok, eos_token_ids=[1])
    g = torch.Generator().manual_seed(1)
    reqs = [GenRequest(f"r{i}", torch.randint(2, vocab, (prompt,), generator=g).tolist(),
                       SamplingParams(new, 1.0, seed=i)) for i in range(rows)]
    t = time.perf_counter()
    try:
        done = engine.generate(reqs)
    finally:
        engine.close()
    took = time.perf_counter() - t
    trajs = [Trajectory(Prompt(f"p{i}", []), "g", 0, r.prompt_ids, list(c.token_ids), list(c.logprobs),
                        list(c.versions), c.finish_reason, routes=moe.extend(None, c.routes)) for i, (r, c) in enumerate(zip(reqs, done))]
    return trajs, took


def mismatch(model, trajs, device: str, mode: str) -> dict:
    from relayrl.config import AlgoCfg, TrainerCfg
    from relayrl.train.batch import build_batch
    from relayrl.train.trainer import Trainer

    batch = build_batch(trajs, torch.zeros(len(trajs)), 0)
    tr = Trainer(model, TrainerCfg(device=device, micro_batch_tokens=4096), AlgoCfg(routing_replay=mode, kl_coef=0),
                 1.0, 10, 16)
    try:
        lp = tr.logprobs(batch)
        diff = (lp - batch.behav_logp).abs()[batch.loss_mask.bool()]
        out = {"mismatch_mean": diff.mean().item(), "mismatch_max": diff.max().item(), "tokens": int(diff.numel())}
        out.update(tr.fwd.route_stats(batch, rows=batch.size))
    finally:
        tr.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", nargs="*", default=["tiny", "30b-a3b-4l"])
    ap.add_argument("--model", nargs="*", default=[], help="saved MoE models (from_pretrained folders) to measure too")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", help="the results' folder (default: benchmarks/results; --shapes tiny alone: a temporary "
                    "one)")
    ap.add_argument("--name", default="moe_replay")
    a = ap.parse_args()
    cases = [(s, lambda s=s: build(shape_of(s), False), lambda s=s: build(shape_of(s), True), shape_of(s)["vocab_size"])
             for s in a.shapes]
    for path in a.model:
        from transformers import AutoModelForCausalLM

        cases.append((Path(path).name, lambda p=path: AutoModelForCausalLM.from_pretrained(p).eval(), None,
                      AutoModelForCausalLM.from_pretrained(path).config.vocab_size))
    data, rows = {"machine": machine_info(), "args": vars(a), "results": {}}, []
    for name, make, make_dense, vocab in cases:
        model = make()
        trajs, took = sample(model, vocab, a.device, a.rows, a.prompt, a.new_tokens)
        res = {mode: mismatch(copy.deepcopy(model), trajs, a.device, mode) for mode in ("off", "r3")}
        res["sample_s"] = took
        if make_dense is not None:
            dense = make_dense()
            res["dense"] = mismatch(dense, sample(dense, vocab, a.device, a.rows, a.prompt, a.new_tokens)[0],
                                    a.device, "off")
        data["results"][name] = res
        print(name, json.dumps(res), flush=True)
        d = res.get("dense", {})
        rows.append([name, f"{res['off'].get('moe/routing_diff', float('nan')):.2%}",
                     f"{res['off']['mismatch_mean']:.2e} / {res['off']['mismatch_max']:.2e}",
                     f"{res['r3']['mismatch_mean']:.2e} / {res['r3']['mismatch_max']:.2e}",
                     f"{d['mismatch_mean']:.2e} / {d['mismatch_max']:.2e}" if d else "—"])
        del model
        if a.device == "cuda":
            torch.cuda.empty_cache()
    header = ["model", "tokens routed apart (off)", "mismatch mean / max, off", "mismatch mean / max, r3",
              "dense of its shape, mean / max"]
    out = results_dir(a.out, check=a.shapes == ["tiny"] and not a.model)  # (a check of the script)
    write_results(out, a.name, header, rows, data)


if __name__ == "__main__":
    main()
