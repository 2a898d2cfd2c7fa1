"""The tiny random Idefics3 (relayrl.demo.vision_model): it loads back with the Auto classes as a processor with the
PIL image processor and a model whose logits are the built ones."""

import torch
from PIL import Image

from relayrl.demo import vision_model


def test_tiny_vlm_reloads_with_the_auto_classes(tmp_path):
    from transformers import (
        AutoModelForImageTextToText,
        AutoProcessor,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )

    path = vision_model.build_tiny_vlm(tmp_path / "vlm", seed=3)
    processor = AutoProcessor.from_pretrained(path)
    assert isinstance(processor, Idefics3Processor)
    assert isinstance(processor.image_processor, Idefics3ImageProcessorPil)

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what digit?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "User:<image>what digit?<end_of_utterance>\nAssistant:"
    inputs = processor(text=[text], images=[[Image.new("RGB", (60, 40), (200, 10, 30))]], return_tensors="pt")
    assert inputs["pixel_values"].shape == (1, 1, 3, 64, 64)
    assert (inputs["input_ids"] == processor.image_token_id).sum() == vision_model.image_seq_len(64) == 4

    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    assert model.config.image_token_id == processor.image_token_id
    torch.manual_seed(3)
    built = vision_model.build_model(processor.tokenizer, 64).eval()
    with torch.no_grad():
        logits = model(**inputs).logits
        assert logits.shape == (1, inputs["input_ids"].shape[1], len(processor.tokenizer))
        assert torch.equal(logits, built(**inputs).logits)
