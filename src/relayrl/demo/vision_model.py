"""Build a tiny random Idefics3 vision-language model offline, for tests of image prompts.

Nothing is downloaded. ``build_tiny_vlm(path)`` trains a byte-level BPE tokenizer on a few sentences, wraps it
with the PIL image processor in an ``Idefics3Processor`` and saves both with a random, untrained Idefics3 (a
SigLIP-style vision encoder, a pixel-shuffle connector and a Llama) built from a config, so that it loads with
``AutoModelForImageTextToText.from_pretrained(path)`` and ``AutoProcessor.from_pretrained(path)``.
Images are never split: each one is one tile of ``image_size`` pixels, ``(image_size / 32) ** 2`` ``<image>``
tokens in the prompt (4 at the default 64) between ``<fake_token_around_image><global-img>`` and
``<fake_token_around_image>``. Deterministic for a given seed; about 0.3 s once transformers is imported.

``build_tiny_gemma3(path)`` does the same for Gemma 3 (a SigLIP tower, its pooling projector, a Gemma 3 text model with
a sliding and a global layer): ``<start_of_image>`` in a prompt becomes ``<start_of_image>``, 4 ``<image_soft_token>``
and ``<end_of_image>``, whose image tokens attend to each other both ways.
"""

from __future__ import annotations

from pathlib import Path

import torch

PATCH = 16
SCALE = 2  # (the connector's pixel shuffle: SCALE**2 patches make one <image> token)

# Rendered as Idefics3's own template does: "User:<image>what digit?<end_of_utterance>\nAssistant:".
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ m['role'] | capitalize }}"
    "{% if m['content'] is string %}{{ ': ' + m['content'] }}"
    "{% else %}{{ ':' if m['content'] and m['content'][0]['type'] == 'image' else ': ' }}"
    "{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<end_of_utterance>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>", "<global-img>"] + [
    f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)
]
WORDS = ["sum", "answer", "digit", "image", "what", "the", "is", "of", "User", "Assistant", "System"]
SENTENCES = [
    "User: what digit is in the image?",
    "Assistant: the answer is 7.",
    "What is the sum of the digits? The answer is 12.",
    "The image shows a digit; read it and give the answer.",
]


def build_tokenizer(vocab_words: list[str] | None = None, vocab_size: int = 400):
    """Byte-level BPE over a few sentences, the digits and ``vocab_words``, with Idefics3's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    words = WORDS + list(vocab_words or [])
    text = SENTENCES + [" ".join(str(d) for d in range(10))] + [" ".join(words)] * 4
    tok.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        eos_token="<end_of_utterance>",
        padding_side="left",
        extra_special_tokens={
            "image_token": "<image>",
            "fake_image_token": "<fake_token_around_image>",
            "global_image_token": "<global-img>",
            "end_of_utterance_token": "<end_of_utterance>",
        },
    )


def build_processor(tokenizer, image_size: int):
    """``Idefics3Processor`` with the PIL image processor, one unsplit tile of ``image_size`` per image."""
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": 2 * image_size},
        max_image_size={"longest_edge": image_size},
        do_image_splitting=False,
    )
    return Idefics3Processor(
        image_processor, tokenizer, image_seq_len=image_seq_len(image_size), chat_template=CHAT_TEMPLATE
    )


def image_seq_len(image_size: int) -> int:
    """``<image>`` tokens per image: ``(image_size / PATCH) ** 2`` patches, ``SCALE ** 2`` to a token."""
    return (image_size // PATCH) ** 2 // SCALE**2


def build_model(tokenizer, image_size: int, vision: dict | None = None, text: dict | None = None):
    """The random Idefics3; ``vision`` and ``text`` override its towers' sizes (the VLM demo's are larger)."""
    from transformers import AutoModelForImageTextToText, Idefics3Config

    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    cfg = Idefics3Config(
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": image_size,
            "patch_size": PATCH,
            **(vision or {}),
        },
        text_config={
            "model_type": "llama",
            "vocab_size": len(tokenizer),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 512,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            "tie_word_embeddings": False,
            **(text or {}),
        },
        scale_factor=SCALE,
        image_token_id=image_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    return AutoModelForImageTextToText.from_config(cfg)


def build_tiny_vlm(
    path: str | Path, *, seed: int = 0, image_size: int = 64, vocab_words: list[str] | None = None
) -> Path:
    """Build the tiny random Idefics3 and its processor into ``path`` (``save_pretrained``); return ``path``."""
    if image_size % (PATCH * SCALE):
        raise ValueError(f"image_size must be a multiple of {PATCH * SCALE}, got {image_size}")
    tokenizer = build_tokenizer(vocab_words)
    processor = build_processor(tokenizer, image_size)
    torch.manual_seed(seed)
    model = build_model(processor.tokenizer, image_size)
    model.eval()
    gen = model.generation_config
    gen.bos_token_id = tokenizer.bos_token_id
    gen.eos_token_id = tokenizer.eos_token_id
    gen.pad_token_id = tokenizer.pad_token_id
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<start_of_image>{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
GEMMA_SPECIAL = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
                 "<image_soft_token>"]


def build_tiny_gemma3(path: str | Path, *, seed: int = 0, image_size: int = 64, image_tokens: int = 4) -> Path:
    """A tiny random Gemma 3 (``Gemma3ForConditionalGeneration``) and its ``Gemma3Processor`` into ``path`` (heads of
    32 dims: vLLM's CPU attention takes no fewer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (AutoModelForImageTextToText, Gemma3Config, Gemma3ImageProcessorPil, Gemma3Processor,
                              PreTrainedTokenizerFast)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(SENTENCES + [" ".join(str(d) for d in range(10)), " ".join(WORDS)], trainers.BpeTrainer(
        vocab_size=400, special_tokens=GEMMA_SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", pad_token="<pad>", eos_token="<end_of_turn>", padding_side="left",
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"})
    processor = Gemma3Processor(Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size}), tokenizer,
                                chat_template=GEMMA_TEMPLATE, image_seq_length=image_tokens)
    ids = tokenizer.convert_tokens_to_ids
    cfg = Gemma3Config(
        text_config={"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "sliding_window": 16,
                     "layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": 512,
                     "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                     "pad_token_id": tokenizer.pad_token_id},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": image_size, "patch_size": PATCH},
        mm_tokens_per_image=image_tokens, boi_token_index=ids("<start_of_image>"),
        eoi_token_index=ids("<end_of_image>"), image_token_index=ids("<image_soft_token>"))
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(cfg).eval()
    gen = model.generation_config
    gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = (tokenizer.bos_token_id, tokenizer.eos_token_id,
                                                            tokenizer.pad_token_id)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m relayrl.demo.vision_model OUT_DIR")
    print(build_tiny_vlm(sys.argv[1]))
