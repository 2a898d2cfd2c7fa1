"""A mixture-of-experts policy that learns the demo task: the demo's recipe (tokenizer, warm start by SFT on its
reference solutions) on a tiny ``qwen3_moe`` instead of the Llama, then RL over seeds with routing replay.

    python benchmarks/moe_demo.py                          # build (once), then 3 seeds with algo.routing_replay=r3
    python benchmarks/moe_demo.py --seeds 3 -- algo.routing_replay=off

The model: the demo's shape (hidden 192, 4 layers, 4 heads) with 4 experts per layer, 2 per token, each expert's
FFN 256 wide (the active FFN is the demo Llama's 512). Its engine runs in bfloat16 (rollout.dtype), the trainer in
float32: the situation where engine and trainer route apart. The seeds' table goes to
``benchmarks/results/seeds_<name>.json`` through ``benchmarks/seeds.py``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MOE = {"experts": 4, "per_token": 2, "expert_ffn": 256}


def build(out: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from relayrl.demo import model as demo

    recipe = {**demo.RECIPE, "moe": MOE}
    torch.manual_seed(recipe["seed"])
    tok = demo.build_tokenizer(recipe["seed"], recipe["vocab_size"])
    cfg = AutoConfig.for_model(
        "qwen3_moe", vocab_size=len(tok), hidden_size=recipe["hidden_size"], num_hidden_layers=recipe["layers"],
        num_attention_heads=recipe["heads"], num_key_value_heads=recipe["heads"],
        head_dim=recipe["hidden_size"] // recipe["heads"], intermediate_size=recipe["intermediate_size"],
        num_experts=MOE["experts"], num_experts_per_tok=MOE["per_token"], moe_intermediate_size=MOE["expert_ffn"],
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, max_position_embeddings=512,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(cfg)
    print(f"moe demo model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, warm start ...")
    demo.warm_start(model, tok, recipe)
    return demo.save_built(out, model, tok, recipe)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path.home() / ".cache" / "relayrl" / "moe-demo")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--name", default="moe_demo_r3")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    if not (a.model / "config.json").exists():
        build(a.model)
    over = ["rollout.dtype=bfloat16", "algo.routing_replay=r3", *a.overrides]
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "seeds.py"), "--seeds", str(a.seeds), "--name", a.name,
                    "--", f"model.path={a.model}", *over], check=True)


if __name__ == "__main__":
    main()
