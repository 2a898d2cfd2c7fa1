"""The model-family conformance suite: for every family of ``tests/families.py`` (tiny random models built from
their configs), the trainer's numbers under each memory feature equal the plain forward's, and the engine's
log-probs of its own samples equal the trainer's. docs/reference/families.md is the table these cells make."""

import copy

import pytest
import torch

from relayrl.config import AlgoCfg, TrainerCfg
from relayrl.demo import model as demo_model
from relayrl.train.head_transform import LogitMap, probe
from relayrl.train.trainer import Trainer
from tests.families import FAMILIES, build
from tests.test_shared_prefix import _groups

SCALED = {"granite": LogitMap(0.25), "granitemoe": LogitMap(0.25), "cohere2": LogitMap(0.25),
          "falcon_h1": LogitMap(0.5), "gemma2": LogitMap(1.0, 3.0), "gemma3": LogitMap(1.0, 5.0)}


@pytest.fixture(scope="module")
def tok():
    return demo_model.build_tokenizer(demo_model.RECIPE["seed"], 300)


def _trainer(model, **trainer):
    cfg = TrainerCfg(**{"micro_batch_tokens": 64, "share_prefix": False, **trainer})
    return Trainer(model, cfg, AlgoCfg(kl_coef=0.1, entropy_coef=0.01), 0.8, 10, 16, top_k=40, top_p=0.95)


def _pass(model, batch, **trainer):
    """(π_old log-probs, the loss's sums, the gradient) of one accumulate with ``trainer`` settings."""
    tr = _trainer(model, **trainer)
    old = tr.logprobs(batch)
    ref = tr.logprobs(batch, tr.ref)
    model.zero_grad()
    model.train()
    sums = tr.accumulate(batch, old + 0.05 * batch.loss_mask, ref, batch.loss_mask.sum().item(), batch.size)
    return old, sums, [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_map_after_the_head_is_found_from_the_model(family, tok):
    assert probe(build(family, tok)) == SCALED.get(family, LogitMap())


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_head_equals_whole_logits(family, tok):
    """The chunked LM head (the default, trainer.logprob_chunk_tokens) against whole logits: log-probs,
    entropy, loss and every gradient, on families that scale or softcap their logits after the head too."""
    model = build(family, tok)
    batch = _groups(tok)
    (o0, s0, g0), (o1, s1, g1) = (_pass(copy.deepcopy(model), batch, logprob_chunk_tokens=c) for c in (0, 7))
    assert o0.abs().max() > 1.0  # (logits large enough that a missed map would show)
    torch.testing.assert_close(o1, o0, atol=1e-5, rtol=1e-4)
    for k in ("loss", "kl", "entropy"):
        assert s1[k] == pytest.approx(s0[k], rel=1e-4, abs=1e-6), k
    assert sum(g.abs().sum() for g in g1) > 0
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama-tied", "granite", "gemma2", "cohere2"])
def test_chunked_head_under_bf16_equals_whole_logits(family, tok):
    """trainer.bf16 (the float32 head under bfloat16 autocast): chunked against whole logits, Gemma's softcap
    included (it was refused under bf16 even with whole logits)."""
    model = build(family, tok)
    batch = _groups(tok)
    out = []
    for c in (0, 7):
        with torch.autocast("cpu", torch.bfloat16):
            out.append(_pass(copy.deepcopy(model), batch, logprob_chunk_tokens=c, bf16=True))
    (o0, s0, g0), (o1, s1, g1) = out
    torch.testing.assert_close(o1, o0, atol=2e-3, rtol=1e-2)
    assert s1["loss"] == pytest.approx(s0["loss"], rel=1e-2, abs=2e-3)
    a, b = torch.cat([g.flatten() for g in g0]), torch.cat([g.flatten() for g in g1])
    assert (b - a).norm() <= 1e-2 * a.norm()  # (bfloat16's rounding: the whole gradient, not each element)


def _hooked(tok, hook):
    model = build("llama", tok)
    model.register_forward_hook(hook)
    return model


def _set_logits(fn):
    def hook(module, args, out):
        out.logits = fn(module, out.logits)
        return out
    return hook


@pytest.mark.parametrize("fn, why", [
    (lambda m, x: x + 0.01 * x * x, "is not a scale or a softcap"),
    (lambda m, x: x * torch.arange(1, x.shape[1] + 1, dtype=x.dtype)[:, None], "is not a scale or a softcap"),
    (lambda m, x: x * m.model.norm.weight[0], "depends on trainable parameters"),
    (lambda m, x: x[..., :-3], "changes the logits' shape"),
])
def test_a_map_it_cannot_reproduce_is_refused_in_one_line(tok, fn, why):
    from relayrl.models import ModelError

    model = _hooked(tok, _set_logits(fn))
    with pytest.raises(ModelError, match=why) as e:
        _trainer(model, logprob_chunk_tokens=7)
    assert "set trainer.logprob_chunk_tokens=0" in str(e.value) and "\n" not in str(e.value)
    _trainer(_hooked(tok, _set_logits(fn)), logprob_chunk_tokens=0)  # (whole logits: the model's own)


def test_the_start_up_check_refuses_a_head_that_is_not_reproduced(tok, monkeypatch):
    """Belt and braces: should the probe find a wrong map, the first comparison with the model's own logits
    refuses the chunked head (never wrong numbers)."""
    from relayrl.models import ModelError
    from relayrl.train import logprobs

    monkeypatch.setattr(logprobs, "probe", lambda model: LogitMap(1.0))
    with pytest.raises(ModelError, match="chunked head's log-probs differ from GraniteForCausalLM's own"):
        _trainer(build("granite", tok), logprob_chunk_tokens=7)
