"""trainer.gradient_checkpointing: each decoder layer replays its forward in the backward pass, and the loss
and gradients are those without (the policy, plain and through shared prefixes, and the critic)."""

import copy
import dataclasses

import pytest
import torch

from relayrl.config import AlgoCfg, CriticCfg, TrainerCfg
from relayrl.train import checkpointing
from relayrl.train.critic import Critic, load_value_model
from relayrl.train.trainer import Trainer
from tests.test_shared_prefix import _groups


def _count_layer_runs(model) -> list[int]:
    """[calls, runs]: the decoder layers' calls, and how often their own forward ran (a checkpointed one:
    once more per call with gradients, in the backward)."""
    runs = [0, 0]
    for layer in checkpointing.decoder_layers(model):
        layer.register_forward_pre_hook(lambda *a: runs.__setitem__(0, runs[0] + 1))
        inner = getattr(layer, "_relayrl_plain_forward", None)
        if inner is not None:
            def counted(*a, _f=inner, **kw):
                runs[1] += 1
                return _f(*a, **kw)
            layer._relayrl_plain_forward = counted
    return runs


@pytest.mark.parametrize("share", [False, True])
def test_policy_loss_and_gradients_equal_without(tiny, share):
    model, tok = tiny
    batch = _groups(tok)
    out = []
    for gc in ("off", "on"):
        m = copy.deepcopy(model)
        tr = Trainer(m, TrainerCfg(gradient_checkpointing=gc, share_prefix=share, micro_batch_tokens=64),
                     AlgoCfg(kl_coef=0.1, entropy_coef=0.01), 1.0, 10, 16)
        runs = _count_layer_runs(m)
        old = tr.logprobs(batch)
        ref = tr.logprobs(batch, tr.ref)
        assert runs[1] in (0, runs[0])  # (no_grad: nothing replayed)
        if share:
            assert tr.sharing.prefixes(m, batch, False) is not None  # the shared path is taken
        runs[:] = [0, 0]
        m.zero_grad()
        m.train()
        sums = tr.accumulate(batch, old + 0.05 * batch.loss_mask, ref, batch.loss_mask.sum().item(), batch.size)
        out.append((sums, [p.grad.clone() for p in m.parameters()], runs))
    (s0, g0, _), (s1, g1, (calls, ran)) = out
    assert calls > 0 and ran == 2 * calls  # each layer ran in each pass's forward and once more in its backward
    for k in ("loss", "kl", "entropy"):
        assert s1[k] == pytest.approx(s0[k], rel=1e-5, abs=1e-7), k
    assert sum(g.abs().sum() for g in g1) > 0
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


def test_the_kv_cache_survives_the_replay(tiny):
    """A shared prefix's pass writes the cache and a suffix's reads it: with checkpointing the cache is as
    it would be without (transformers' own checkpointing would drop it), and replays leave it so."""
    model, tok = tiny
    batch = _groups(tok)
    checkpointing.enable(model)
    model.train()
    from relayrl.train.shared_prefix import PrefixSharing

    pre = PrefixSharing(True, 10_000).prefixes(model, batch, grad=True)
    idx = list(range(batch.size))
    out = pre.outputs(idx)
    kv_before = [x.detach().clone() for pair in pre.kv for x in pair]
    out.sum().backward()
    pre_grads = [x.grad is not None and x.grad.abs().sum() > 0 for pair in pre.leaves for x in pair]
    assert all(pre_grads)  # the suffixes read the prompt's keys and values
    assert all(torch.equal(a, b) for a, b in zip(kv_before, [x.detach() for pair in pre.kv for x in pair]))
    pre.backward()


def test_critic_loss_and_gradients_equal_without(tiny_path, tiny):
    _, tok = tiny
    batch = _groups(tok)
    targets = torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(2)) * batch.loss_mask
    out = []
    for gc in ("off", "on"):
        critic = Critic(load_value_model(tiny_path), CriticCfg(lr=1e-2),
                        TrainerCfg(gradient_checkpointing=gc, micro_batch_tokens=64), 10, torch.device("cpu"))
        values = critic.values(batch)
        runs = _count_layer_runs(critic.model)
        metrics = critic.step(dataclasses.replace(batch, values=values, returns=targets))
        out.append((values, metrics, critic.model.state_dict(), runs))
    (v0, m0, w0, _), (v1, m1, w1, (calls, ran)) = out
    assert calls > 0 and ran == 2 * calls
    torch.testing.assert_close(v1, v0)
    assert m1["critic/loss"] == pytest.approx(m0["critic/loss"], rel=1e-6)
    assert m1["critic/grad_norm"] == pytest.approx(m0["critic/grad_norm"], rel=1e-5)
    for k in w0:
        torch.testing.assert_close(w1[k], w0[k], atol=1e-6, rtol=1e-5)


def test_auto_is_on_from_the_threshold(tiny, monkeypatch):
    model, _ = tiny
    n = sum(p.numel() for p in model.parameters())
    assert not checkpointing.wanted("auto", model) and checkpointing.wanted("on", model)
    assert not checkpointing.wanted("off", model)
    monkeypatch.setattr(checkpointing, "AUTO_MIN_PARAMS", n)
    assert checkpointing.wanted("auto", model)
    Trainer(model, TrainerCfg(), AlgoCfg(kl_coef=0.1), 1.0, 10, 16)
    assert all(hasattr(x, "_relayrl_plain_forward") for x in checkpointing.decoder_layers(model))


def test_a_model_without_decoder_layers_is_refused():
    with pytest.raises(ValueError, match="trainer.gradient_checkpointing=off"):
        checkpointing.enable(torch.nn.Linear(2, 2))
