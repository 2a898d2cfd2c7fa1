import pytest
import torch

from relayrl.demo import model as demo_model

TINY = {"hidden_size": 32, "layers": 2, "heads": 2, "intermediate_size": 64, "vocab_size": 300}


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    """A tiny random Llama + demo tokenizer saved with save_pretrained (no SFT)."""
    path = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    recipe = {**demo_model.RECIPE, **TINY}
    tok = demo_model.build_tokenizer(recipe["seed"], recipe["vocab_size"])
    model = demo_model.build_model(tok, recipe)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture()
def tiny(tiny_path):
    from relayrl.models import load_policy, load_tokenizer

    return load_policy(tiny_path), load_tokenizer(tiny_path)
