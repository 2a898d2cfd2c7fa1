"""Tiny random models of the decoder-only families users post-train with transformers 5.x, built from their
configs (nothing downloaded), with the demo's tokenizer: the conformance suite's models (test_families.py).

Each family's own setting that changes its logits after the head is set away from 1 (and its head's weights
scaled up so that logits are tens, not hundredths, as a trained model's are): a chunked head that ignored the
map would be visibly wrong."""

from __future__ import annotations

import torch

COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, max_position_embeddings=512, tie_word_embeddings=False)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
LINEAR = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_conv_kernel_dim=4)

# family -> (model_type, config overrides)
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3_moe": ("qwen3_moe", {**MOE, "decoder_sparse_step": 1, "mlp_only_layers": []}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "gemma2": ("gemma2", {"final_logit_softcapping": 3.0, "attn_logit_softcapping": 50.0, "tie_word_embeddings": True}),
    "gemma3": ("gemma3_text", {"final_logit_softcapping": 5.0, "tie_word_embeddings": True}),
    "phi3": ("phi3", {}),
    "granite": ("granite", {"logits_scaling": 4.0}),
    "granitemoe": ("granitemoe", {"logits_scaling": 4.0, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "cohere2": ("cohere2", {"logit_scale": 0.25, "tie_word_embeddings": True}),
    "olmo2": ("olmo2", {}),
    "smollm3": ("smollm3", {}),
    "falcon_h1": ("falcon_h1", {"lm_head_multiplier": 0.5, "mamba_d_ssm": 32, "mamba_n_heads": 4, "mamba_d_head": 8,
                                "mamba_d_state": 8, "mamba_chunk_size": 16}),
    # hybrid linear attention: Gated DeltaNet layers beside full attention (Qwen3-Next with experts, Qwen3.5's text
    # model), Mamba-2 beside attention (Nemotron-H)
    "qwen3_next": ("qwen3_next", {**MOE, **LINEAR, "layer_types": ["linear_attention", "full_attention"],
                                  "shared_expert_intermediate_size": 32, "decoder_sparse_step": 1, "mlp_only_layers": []}),
    "qwen3_5": ("qwen3_5_text", {**LINEAR, "layer_types": ["linear_attention", "full_attention"]}),
    "nemotron_h": ("nemotron_h", {"hybrid_override_pattern": "M*", "mamba_num_heads": 4, "mamba_head_dim": 8,
                                  "ssm_state_size": 8, "n_groups": 1, "chunk_size": 16, "expand": 1}),
    "gpt_oss": ("gpt_oss", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16}),
    "deepseek_v3": ("deepseek_v3", {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
                                    "moe_intermediate_size": 32, "first_k_dense_replace": 1, "kv_lora_rank": 16,
                                    "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
                                    "num_key_value_heads": 4}),
}


def build(family: str, tokenizer, seed: int = 0, head_scale: float = 30.0):
    """``family``'s tiny random model for ``tokenizer``'s vocabulary, float32, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, over = FAMILIES[family]
    ids = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
               bos_token_id=None)
    cfg = AutoConfig.for_model(model_type, **{**COMMON, **ids, **over})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        head = model.get_output_embeddings()
        # (logits of a few tens; through the input embedding too where tied, which the norm after it absorbs)
        head.weight.mul_(head_scale)
    return model.eval()
