"""trainer.share_prefix: a group's prompt forwarded once gives the plain forward's logits and gradients."""

import copy
import dataclasses
import types
import warnings

import pytest
import torch

from relayrl.config import AlgoCfg, TrainerCfg
from relayrl.records import FinishReason, Prompt, Trajectory
from relayrl.train.shared_prefix import PrefixSharing, cuts, worth_it
from relayrl.train.trainer import Trainer, build_batch


def test_cuts_by_hand():
    # group 0: two rows with the same 4-token prompt, trained from position 3 (predicting token 4)
    # group 1: agent branches that part after 2 tokens; group 2: one row alone
    ids = torch.tensor([[1, 2, 3, 4, 5, 6],
                        [1, 2, 3, 4, 7, 0],
                        [1, 2, 8, 9, 9, 9],
                        [1, 2, 7, 9, 9, 0],
                        [5, 5, 5, 5, 5, 0]])
    att = (ids != 0).long()
    att[0, -1] = 1
    loss = torch.zeros(5, 5)
    loss[0, 3:], loss[1, 3:4], loss[2, 4:], loss[3, 3:4], loss[4, 2:4] = 1, 1, 1, 1, 1
    owner, cut = cuts(ids, att, loss, torch.tensor([10, 10, 11, 11, 12]))
    assert owner.tolist() == [0, 0, 1, 1, 2]
    assert cut.tolist() == [3, 3, 2, 2, 2]  # prompt before the first trained position; parted histories; alone
    assert worth_it(owner, cut)
    assert not worth_it(owner, torch.tensor([3, 3, 1, 1, 2]), min_prefix=4)  # no prefix long enough
    assert not worth_it(torch.tensor([0, 1, 2]), torch.tensor([3, 3, 3]))  # every row alone


def _groups(tok, prompts=("Add 1 2", "Sum mod 10: a=3 b=4 c=5", "x"), per_group=4, seed=0):
    """Trajectories: a group of ``per_group`` responses to each prompt (prompts of different lengths),
    responses of random lengths; advantages and behaviour log-probs to train on."""
    g = torch.Generator().manual_seed(seed)
    trajs, group = [], []
    for k, text in enumerate(prompts):
        p = Prompt(f"p{k}", [{"role": "user", "content": text}], "3")
        prompt_ids = list(tok.apply_chat_template(p.messages, add_generation_prompt=True)["input_ids"])
        for i in range(per_group):
            r = int(torch.randint(1, 20, (1,), generator=g))
            resp = torch.randint(5, 200, (r,), generator=g).tolist()
            trajs.append(Trajectory(p, f"g{k}", i, prompt_ids, resp, [-1.0] * r, [0] * r, FinishReason.STOP))
            group.append(k)
    adv = torch.randn(len(trajs), generator=g)
    batch = build_batch(trajs, adv, tok.pad_token_id, group=torch.tensor(group))
    return batch


@pytest.mark.parametrize("budget", [10_000, 40])  # one micro-batch; many, and prefixes forwarded in chunks
def test_logits_and_gradients_equal_the_plain_forward(tiny, budget):
    model, tok = tiny
    batch = _groups(tok)
    sharing = PrefixSharing(True, budget)
    pre = sharing.prefixes(model, batch, grad=True)
    assert pre is not None and pre.C >= 2
    groups = pre.micro_batches(budget)
    assert sorted(i for g in groups for i in g) == list(range(batch.size))
    assert (len(groups) > 1) == (budget < 100)

    def loss(logits, mb):
        lp = torch.log_softmax(logits, -1).gather(-1, mb.input_ids[:, 1:, None]).squeeze(-1)
        return (lp * mb.loss_mask * mb.advantages).sum()

    model.zero_grad()
    plain = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    loss(plain, batch).backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    m = batch.loss_mask.bool()
    for idx in groups:
        mb = batch.select(idx)
        logits = pre.outputs(idx)
        assert logits.shape == (len(idx), mb.input_ids.shape[1] - 1, plain.shape[-1])
        n = logits.shape[1]
        torch.testing.assert_close(logits[mb.loss_mask.bool()], plain[idx][:, :n][m[idx][:, :n]], atol=1e-4, rtol=1e-4)
        loss(logits, mb).backward()
    got_before = [p.grad.clone() for p in model.parameters()]
    pre.backward()  # the prefixes' share of the gradient arrives here
    got = [p.grad for p in model.parameters()]
    assert max((a - b).abs().max().item() for a, b in zip(want, got_before)) > 1e-3  # the prefix part matters...
    for a, b in zip(want, got):  # ...and with it, the gradient is the plain forward's
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-3)


def _step(model, batch, share: bool, **algo):
    tr = Trainer(model, TrainerCfg(lr=1e-2, warmup_steps=0, share_prefix=share, micro_batch_tokens=64),
                 AlgoCfg(**algo), 1.0, 10, 16)
    m = tr.step(batch)
    return tr, m


@pytest.mark.parametrize("algo", [{}, {"kl_coef": 0.1}, {"loss": "ppo_clip"}])
def test_a_training_step_with_shared_prefixes_is_the_plain_step(tiny, algo):
    model, tok = tiny
    batch = _groups(tok)
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    tr, m_shared = _step(a, batch, True, **algo)
    assert tr.sharing.enabled and tr.sharing.verified
    _, m_plain = _step(b, batch, False, **algo)
    assert any(not torch.equal(p, q) for p, q in zip(a.parameters(), model.parameters()))  # it trained
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=2e-5, rtol=1e-4)
    for k in ("loss", "grad_norm", "entropy", "logprob_mismatch_mean"):
        assert m_shared[k] == pytest.approx(m_plain[k], rel=1e-3, abs=1e-5), k


def test_a_model_whose_shared_forward_differs_trains_with_the_plain_one(tiny):
    model, tok = tiny
    batch = _groups(tok)
    blind = copy.deepcopy(model)
    # a model that cannot read a KV cache: its suffixes see no prompt (bound to it: the KL reference, its deep
    # copy, runs its own weights)
    blind.forward = types.MethodType(lambda self, **kw: type(self).forward(self, **{
        k: v for k, v in kw.items() if k not in ("cache", "past_key_values", "cache_position")}), blind)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        tr, _ = _step(blind, batch, True)
    assert not tr.sharing.enabled
    assert any("trainer.share_prefix" in str(x.message) and "plain forward" in str(x.message) for x in w)
    plain = copy.deepcopy(model)
    _step(plain, batch, False)
    for p, q in zip(blind.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q)


def test_rows_that_share_nothing_ride_along(tiny):
    """A group whose rows part at their first token (cut 0) and a row alone, in micro-batches with a
    shared group: every row's logits are the plain forward's."""
    model, tok = tiny
    shared = _groups(tok, prompts=("Add 1 2",), per_group=3)
    g = torch.Generator().manual_seed(1)
    odd = []
    for k in range(3):  # group 1: rows 0 and 1 start differently; group 2: row 2 alone
        ids = torch.randint(5, 200, (6 + k,), generator=g).tolist()
        odd.append(Trajectory(Prompt(f"q{k}", [], "1"), f"h{k}", k, ids[:3], ids[3:], [-1.0] * (3 + k), [0] * (3 + k),
                              FinishReason.STOP))
    trajs = [*_rows(shared, tok), *odd]
    batch = build_batch(trajs, torch.randn(len(trajs), generator=g), tok.pad_token_id,
                        group=torch.tensor([0, 0, 0, 1, 1, 2]))
    for budget in (10_000, 16):
        pre = PrefixSharing(True, budget).prefixes(model, batch, grad=False)
        assert pre is not None and pre.cut[3:].tolist() == [0, 0, 2]
        with torch.no_grad():
            plain = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
            for idx in pre.micro_batches(budget):
                mask = batch.select(idx).loss_mask.bool()
                got = pre.outputs(idx)
                torch.testing.assert_close(got[mask], plain[idx][:, : got.shape[1]][mask], atol=1e-4, rtol=1e-4)


def _rows(batch, tok):
    """The trajectories back out of a batch built by ``_groups`` (prompt before the first trained token)."""
    out = []
    for i in range(batch.size):
        n = int(batch.attention_mask[i].sum())
        p = int(batch.loss_mask[i].argmax()) + 1
        ids = batch.input_ids[i, :n].tolist()
        out.append(Trajectory(Prompt("p", [], "3"), "g", i, ids[:p], ids[p:], [-1.0] * (n - p), [0] * (n - p),
                              FinishReason.STOP))
    return out


@pytest.mark.parametrize("updates", [1, 2])
def test_the_critic_shares_prefixes_too(tiny_path, tiny, updates):
    """The critic's values and its update through the body's shared prefixes are the plain ones'."""
    from relayrl.config import CriticCfg
    from relayrl.train.critic import Critic, load_value_model

    _, tok = tiny
    batch = _groups(tok)
    initial = load_value_model(tiny_path).state_dict()
    targets = torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(2)) * batch.loss_mask
    out = {}
    for share in (True, False):
        critic = Critic(load_value_model(tiny_path), CriticCfg(lr=1e-2, updates_per_step=updates),
                        TrainerCfg(share_prefix=share, micro_batch_tokens=64), 10, torch.device("cpu"))
        values = critic.values(batch)
        torch.manual_seed(0)  # (the mini-batches' order)
        metrics = critic.step(dataclasses.replace(batch, values=values, returns=targets))
        assert critic.sharing.enabled == share and critic.sharing.verified == share
        out[share] = (values, metrics, critic.model.state_dict())
    (v1, m1, w1), (v0, m0, w0) = out[True], out[False]
    torch.testing.assert_close(v1, v0, atol=1e-5, rtol=1e-4)
    assert m1["critic/loss"] == pytest.approx(m0["critic/loss"], rel=1e-4)
    assert any(not torch.equal(w1[k], initial[k]) for k in initial)  # it trained
    for k in w0:
        torch.testing.assert_close(w1[k], w0[k], atol=1e-4, rtol=1e-3)  # (two Adam steps of lr 1e-2: 1% of one)
