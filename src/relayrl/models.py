"""Loading policies and tokenizers (``from_pretrained``), chat templates, token log-probs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_model_path(path: str, log=print) -> str:
    if path == "builtin:demo":
        from relayrl.demo.model import demo_model_path

        return str(demo_model_path(log=log))
    if path.startswith("builtin:"):
        raise ValueError(f"unknown built-in model {path!r}; valid: builtin:demo")
    return path


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if tok.chat_template is None:
        raise ValueError(f"tokenizer at {path!r} has no chat template; relayrl applies chat templates to prompts")
    return tok


def load_policy(path: str, dtype: str = "float32"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])


def encode_prompt(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T)[target] per position, in float32."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.gather(F.log_softmax(logits, dim=-1), -1, targets.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    logp = F.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)
