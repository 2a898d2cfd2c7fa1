"""trainer.pack: a micro-batch's rows as one sequence of their real tokens give the padded path's per-token
log-probs, entropy, loss and gradient (policy and critic), under a budget of real tokens."""

import copy

import pytest
import torch

from relayrl.config import AlgoCfg, CriticCfg, TrainerCfg
from relayrl.train.batch import micro_batches
from relayrl.train.critic import Critic, load_value_model
from relayrl.train.packing import Packed, padding_fraction
from relayrl.train.trainer import Trainer
from tests.test_shared_prefix import _groups


def test_positions_restart_per_row_and_the_rows_come_back():
    att = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    p = Packed(att)
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]]
    x = torch.arange(12).reshape(3, 4) + 1
    assert p.flat(x).tolist() == [[1, 2, 3, 5, 9, 10, 11, 12]]
    assert torch.equal(p.unflat(p.flat(x)), x * att)  # zero at the padding


def test_packed_micro_batches_count_real_tokens():
    class B:  # (micro_batches reads the attention mask, and each row's adapter: one, here)
        attention_mask = torch.tensor([[1] * n + [0] * (9 - n) for n in (9, 2, 3, 8, 1)])
        size = 5
        adapter = None

    lengths = [9, 2, 3, 8, 1]
    padded, packed = micro_batches(B, 10), micro_batches(B, 10, packed=True)
    assert padded == [[4, 1, 2], [3], [0]]  # 3 rows × longest 3 ≤ 10; then 8 and 9 alone
    assert packed == [[4, 1, 2], [3], [0]]  # 1+2+3 = 6 real tokens; + 8 > 10; 8; 9
    assert all(sum(lengths[i] for i in g) <= 10 for g in packed)
    assert micro_batches(B, 12, packed=True) == [[4, 1, 2], [3], [0]]  # 1+2+3 = 6; +8 > 12; 8; 9
    assert micro_batches(B, 17, packed=True) == [[4, 1, 2, 3], [0]]  # 14 real tokens; padded: 4 rows × 8 = 32 > 17
    assert micro_batches(B, 17) == [[4, 1, 2], [3], [0]]
    assert padding_fraction(lengths, micro_batches(B, 17), False) == pytest.approx(1 - 23 / (9 + 8 + 9))
    assert padding_fraction(lengths, micro_batches(B, 17, packed=True), True) == 0.0
    assert micro_batches(B, 1, packed=True) == [[4], [1], [2], [3], [0]]  # a row over the budget goes alone


@pytest.mark.parametrize("chunk", [0, 5])  # whole logits; the head in chunks of 5 tokens (boundaries inside rows)
def test_policy_logprobs_loss_and_gradient_equal_the_padded_rows(tiny, chunk):
    model, tok = tiny
    batch = _groups(tok)
    out = {}
    for pack in (False, True):
        m = copy.deepcopy(model)
        tr = Trainer(m, TrainerCfg(pack=pack, share_prefix=False, micro_batch_tokens=64, logprob_chunk_tokens=chunk),
                     AlgoCfg(kl_coef=0.1, entropy_coef=0.01), 1.0, 10, 16)
        old = tr.logprobs(batch)
        ref = tr.logprobs(batch, tr.ref)
        m.zero_grad()
        m.train()
        sums = tr.accumulate(batch, old + 0.05 * batch.loss_mask, ref, batch.loss_mask.sum().item(), batch.size)
        out[pack] = (old, sums, [p.grad.clone() for p in m.parameters()])
    assert len(micro_batches(batch, 64, packed=True)) < len(micro_batches(batch, 64))  # fewer passes packed
    (lp0, s0, g0), (lp1, s1, g1) = out[False], out[True]
    assert lp0.abs().sum() > 0
    torch.testing.assert_close(lp1, lp0, atol=2e-6, rtol=1e-5)
    for k in ("loss", "kl", "entropy"):
        assert s1[k] == pytest.approx(s0[k], rel=1e-5, abs=1e-7), k
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


def test_packing_with_shared_prefixes_gives_the_plain_rows_numbers(tiny):
    """trainer.pack with trainer.share_prefix (its default): where a group's prompt is forwarded once, its
    responses' micro-batches stay padded (the field says so), and the numbers are the plain padded forward's."""
    model, tok = tiny
    batch = _groups(tok)
    out = {}
    for pack, share in ((False, False), (True, True)):
        m = copy.deepcopy(model)
        tr = Trainer(m, TrainerCfg(pack=pack, share_prefix=share, micro_batch_tokens=64), AlgoCfg(kl_coef=0.1),
                     1.0, 10, 16)
        old = tr.logprobs(batch)
        m.zero_grad()
        m.train()
        sums = tr.accumulate(batch, old + 0.05 * batch.loss_mask, tr.logprobs(batch, tr.ref),
                             batch.loss_mask.sum().item(), batch.size)
        out[pack] = (old, sums, [p.grad.clone() for p in m.parameters()], tr)
    (lp0, s0, g0, _), (lp1, s1, g1, tr) = out[False], out[True]
    assert tr.sharing.enabled and tr.sharing.prefixes(tr.model, batch, grad=False) is not None  # (it did share)
    torch.testing.assert_close(lp1, lp0, atol=2e-6, rtol=1e-5)
    assert s1["loss"] == pytest.approx(s0["loss"], rel=1e-5, abs=1e-7)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


def test_attention_leaking_across_rows_would_be_seen(tiny):
    """The check above can fail: position ids that run on across rows (one long sequence, no restart) make
    transformers attend across rows, and the log-probs move."""
    model, tok = tiny
    batch = _groups(tok)
    tr = Trainer(model, TrainerCfg(pack=True, share_prefix=False, micro_batch_tokens=64), AlgoCfg(kl_coef=0.0),
                 1.0, 10, 16)
    right = tr.logprobs(batch)
    real = Packed.__init__

    def leaky(self, attention_mask):
        real(self, attention_mask)
        self.position_ids = torch.arange(self.position_ids.shape[1]).unsqueeze(0)

    Packed.__init__ = leaky
    try:
        wrong = tr.logprobs(batch)
    finally:
        Packed.__init__ = real
    assert (wrong - right).abs().max() > 1e-3


def test_critic_values_and_gradient_equal_the_padded_rows(tiny_path):
    from relayrl.models import load_tokenizer
    from tests.test_critic import reward_batch

    batch = reward_batch(load_tokenizer(tiny_path), 1)
    out = {}
    for pack in (False, True):
        torch.manual_seed(0)
        critic = Critic(load_value_model(tiny_path), CriticCfg(), TrainerCfg(pack=pack, share_prefix=False,
                        micro_batch_tokens=40), 10, torch.device("cpu"))
        v = critic.values(batch)
        critic.model.zero_grad()
        critic.model.train()
        (critic._forward(batch) * batch.loss_mask).sum().backward()  # (the padded path computes the padding too)
        out[pack] = (v, [p.grad.clone() for p in critic.model.parameters()])
    torch.testing.assert_close(out[True][0], out[False][0], atol=2e-6, rtol=1e-5)
    for a, b in zip(out[False][1], out[True][1]):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_micro_batches_never_mix_two_roles_adapters():
    """model.lora.per_role: a forward runs under one adapter, so a micro-batch holds one role's rows."""
    class B:
        attention_mask = torch.tensor([[1] * n + [0] * (9 - n) for n in (9, 2, 3, 8, 1)])
        size = 5
        adapter = torch.tensor([0, 1, 0, 1, 0])

    for packed in (False, True):
        groups = micro_batches(B, 100, packed=packed)
        assert sorted(map(sorted, groups)) == [[0, 2, 4], [1, 3]]


@pytest.mark.parametrize("family,refused", [("llama", False), ("gpt_oss", True)])
def test_a_bfloat16_model_is_checked_on_a_float32_model_of_its_architecture(family, refused):
    """bfloat16's rounding moves a packed row's log-probs by 0.01-0.1 nats (llama here: 0.065), which refused every
    bfloat16 model (`relayrl sft model.dtype=bfloat16` said its layers leak across rows) and would hide a real leak
    (Falcon-H1's is 0.006): the check runs on a small float32 model of the architecture instead, and still refuses
    gpt-oss (a sliding window over packed rows); torch's RNG is left as it was."""
    from relayrl.demo import model as demo_model
    from relayrl.train.packing import PackingError, check_packing
    from tests.families import build

    model = build(family, demo_model.build_tokenizer(demo_model.RECIPE["seed"], 300)).to(torch.bfloat16)
    state = torch.get_rng_state()
    if refused:
        with pytest.raises(PackingError, match="GptOssForCausalLM's log-probs"):
            check_packing(model)
    else:
        check_packing(model)
    assert torch.equal(torch.get_rng_state(), state)
