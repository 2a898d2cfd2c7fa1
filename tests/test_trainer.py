import pytest
import torch

from relayrl.config import AlgoCfg, TrainerCfg
from relayrl.records import FinishReason, Prompt, Trajectory
from relayrl.trainer import Trainer, build_batch, micro_batches


def _trajs(tok, n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = Prompt(f"p{i}", [{"role": "user", "content": "Add 1 2"}], "3")
        prompt_ids = tok.apply_chat_template(p.messages, add_generation_prompt=True)["input_ids"]
        r = int(torch.randint(1, 12, (1,), generator=g))
        resp = torch.randint(5, 200, (r,), generator=g).tolist()
        t = Trajectory(p, f"g{i // 4}", i % 4, list(prompt_ids), resp, [-1.0] * r, [0] * r, FinishReason.STOP)
        out.append(t)
    return out


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_grads_equal_for_one_microbatch_of_8_and_8_of_1(tiny, agg):
    model, tok = tiny
    trajs = _trajs(tok)
    adv = torch.linspace(-1, 1, 8)
    batch = build_batch(trajs, adv, tok.pad_token_id)
    grads = []
    for budget in (10_000, 1):
        assert len(micro_batches(batch, budget)) == (1 if budget > 1 else 8)
        tr = Trainer(model, TrainerCfg(micro_batch_tokens=budget), AlgoCfg(agg=agg), 1.0, 10, 16)
        old = tr.logprobs(batch) + 0.05 * batch.loss_mask  # off-policy enough that some ratios clip
        model.zero_grad()
        tr.accumulate(batch, old, None, batch.loss_mask.sum().item(), float(batch.size))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert grads[0].abs().sum() > 0
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-4)


def test_build_batch_aligns_response_tokens(tiny):
    _, tok = tiny
    t = _trajs(tok, 1)[0]
    b = build_batch([t], torch.tensor([1.0]), tok.pad_token_id)
    targets = b.input_ids[0, 1:][b.loss_mask[0].bool()].tolist()
    assert targets == t.response_ids
    assert b.behav_logp[0][b.loss_mask[0].bool()].tolist() == t.behav_logprobs


def test_step_changes_parameters_and_reports_metrics(tiny):
    model, tok = tiny
    batch = build_batch(_trajs(tok), torch.linspace(-1, 1, 8), tok.pad_token_id)
    tr = Trainer(model, TrainerCfg(lr=1e-2, warmup_steps=0), AlgoCfg(kl_coef=0.1), 1.0, 10, 16)
    before = [p.detach().clone() for p in model.parameters()]
    m = tr.step(batch)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    for k in ("loss", "grad_norm", "clip_frac", "kl", "entropy", "logprob_mismatch_mean"):
        assert k in m and m[k] == m[k]  # present and not NaN
    assert m["entropy"] > 0


def test_on_policy_shortcut_gives_the_same_gradient_as_recomputing_pi_old(tiny):
    model, tok = tiny
    batch = build_batch(_trajs(tok), torch.linspace(-1, 1, 8), tok.pad_token_id)
    tr = Trainer(model, TrainerCfg(), AlgoCfg(), 1.0, 10, 16)
    grads = []
    for old in (None, tr.logprobs(batch)):
        model.zero_grad()
        tr.accumulate(batch, old, None, batch.loss_mask.sum().item(), float(batch.size))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-4)
