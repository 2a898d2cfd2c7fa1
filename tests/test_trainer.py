import math

import pytest
import torch

from relayrl.config import AlgoCfg, TrainerCfg
from relayrl.records import FinishReason, Prompt, Trajectory
from relayrl.train.trainer import Trainer, build_batch, micro_batches


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
        assert isinstance(m.get(k), float) and math.isfinite(m[k]), (k, m.get(k))  # present, a number, not NaN
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


def _stale_batch(tok, model):
    """Half the sequences sampled by version 0 with behaviour log-probs off the current policy,
    half by the current version 1 with exact ones."""
    trajs = _trajs(tok)
    batch = build_batch(trajs, torch.linspace(-1, 1, 8), tok.pad_token_id)
    tr = Trainer(model, TrainerCfg(), AlgoCfg(), 1.0, 10, 16)
    cur = tr.logprobs(batch)
    noise = torch.linspace(-0.6, 0.6, batch.behav_logp.numel()).reshape(batch.behav_logp.shape)
    stale_rows = torch.arange(8)[:, None] < 4
    batch.behav_logp = torch.where(stale_rows, cur + noise, cur) * batch.loss_mask
    batch.versions = torch.where(stale_rows & batch.loss_mask.bool(), 0, batch.versions.clamp(min=1))
    return batch


def _m2po_keep_by_hand(log_r, adv, mask, tau):
    """M2PO's mask the slow way: drop the trust-region token (A > 0 and r > 1, or A < 0 and r < 1)
    with the largest (log r)², one at a time, until the mean (log r)² of the tokens left is ≤ τ."""
    keep, sq = mask.clone(), log_r**2
    cand = mask.bool() & (((adv > 0) & (log_r > 0)) | ((adv < 0) & (log_r < 0)))
    while (sq * keep).sum() > tau * keep.sum() and (cand & keep.bool()).any():
        keep.view(-1)[torch.where(cand & keep.bool(), sq, -1.0).flatten().argmax()] = 0
    return keep


@pytest.mark.parametrize("offpolicy,spread", [("none", 2.0), ("decoupled", 2.0), ("tis", 2.0), ("m2po", 0.7)])
def test_offpolicy_corrections_match_their_formulas_by_hand(tiny, offpolicy, spread):
    """One accumulation at θ = π_old (every PPO ratio 1, inside the clip), so each token's loss is
    -weight · A · π_θ/sg(π_θ): the loss and the gradient against the formulas of algorithms.md §2,
    written out here on a plain forward pass. The stale half's behaviour log-probs are off by up to
    ±spread: 2 nats reach decoupled PPO's bound (w > 5: dropped) and TIS's cap (w > 2: truncated);
    0.7 has M2PO mask some of the stale tokens, not all."""
    model, tok = tiny
    batch = _stale_batch(tok, model)
    tr = Trainer(model, TrainerCfg(), AlgoCfg(offpolicy=offpolicy), 1.0, 10, 16)
    stale = (batch.versions == 0) & batch.loss_mask.bool()
    noise = (torch.rand(batch.behav_logp.shape, generator=torch.Generator().manual_seed(0)) * 2 - 1) * spread
    batch.behav_logp = torch.where(stale, tr.logprobs(batch) + noise, batch.behav_logp) * batch.loss_mask
    model.zero_grad()
    sums = tr.accumulate(batch, None, None, batch.loss_mask.sum().item(), float(batch.size), version=1)
    got = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    mask, adv = batch.loss_mask, batch.advantages
    model.zero_grad()
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits[:, :-1]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    ratio = torch.exp(logp - logp.detach())  # π_θ/π_old: 1, with the gradient of log π_θ
    w_behav = torch.exp(logp.detach() - batch.behav_logp)  # π_old/π_behav
    if offpolicy == "none":
        per_tok = -adv * ratio
    elif offpolicy == "decoupled":  # w = π_prox/π_behav on stale tokens only, tokens with w > 5 dropped
        assert ((w_behav > 5) & stale).any() and ((w_behav < 5) & stale).any()
        w = torch.where(stale, w_behav * (w_behav <= 5), torch.ones_like(w_behav))
        per_tok = -w * adv * ratio
    elif offpolicy == "tis":  # w = min(π_old/π_behav, 2) on every token
        assert ((w_behav > 2) & stale).any() and ((w_behav < 2) & stale).any()
        per_tok = -w_behav.clamp(max=2.0) * adv * ratio
    else:  # M2PO: -M · π_θ/π_behav · A, no clip
        log_r = (logp - batch.behav_logp) * mask
        keep = _m2po_keep_by_hand(log_r.detach(), adv, mask, 0.04)
        dropped = (mask - keep).bool()  # some stale trust-region tokens (A < 0 there, so r < 1), not all
        assert dropped.any() and not (dropped & ~stale).any() and dropped.sum() < (stale & (log_r < 0)).sum()
        per_tok = -keep * torch.exp(log_r) * adv
    loss = (per_tok * mask).sum() / mask.sum()  # token_mean over the whole batch
    loss.backward()
    want = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    assert stale.any() and abs(sums["loss"] - loss.item()) < 1e-5, (sums["loss"], loss.item())
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-4)


def test_ess_scales_the_step_on_off_policy_batches(tiny):
    model, tok = tiny
    batch = _stale_batch(tok, model)
    lrs = {}
    for on in (False, True):
        tr = Trainer(model, TrainerCfg(lr=1e-3, warmup_steps=0), AlgoCfg(ess_lr_scale=on), 1.0, 10, 16)
        m = tr.step(batch, version=1)
        lrs[on] = m["lr"]
        assert 0 < m["ess_frac"] < 1  # uneven importance weights: fewer effective samples than rows
    assert lrs[False] == 1e-3 and lrs[True] < 1e-3


@pytest.mark.parametrize("offpolicy", ["decoupled", "m2po"])
def test_offpolicy_gradient_does_not_depend_on_the_micro_batch_split(tiny, offpolicy):
    """Before, decoupled PPO / M2PO applied per micro-batch only when it held a stale token, and
    M2PO's second-moment budget was per micro-batch: 1×8 and 8×1 gave different gradients."""
    model, tok = tiny
    batch = _stale_batch(tok, model)
    batch.behav_logp = batch.behav_logp + 0.1 * batch.loss_mask  # fresh tokens with an engine mismatch too
    grads = []
    for budget in (10_000, 1):
        tr = Trainer(model, TrainerCfg(micro_batch_tokens=budget, lr=1e-9), AlgoCfg(offpolicy=offpolicy), 1.0, 10, 16)
        model.zero_grad()
        with torch.no_grad():
            before = [p.clone() for p in model.parameters()]
        torch.manual_seed(0)
        real_step = tr.opt.step
        tr.opt.step = lambda: grads.append(torch.cat([p.grad.flatten().clone() for p in model.parameters()
                                                      if p.grad is not None]))  # capture, do not move
        tr.step(batch, version=1)
        tr.opt.step = real_step
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert grads[0].abs().sum() > 0
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-4)


def test_mismatch_is_measured_on_tokens_of_the_previous_version(tiny):
    """Periodic mode trains only on tokens one version old: the metric used to read 0 there (it
    looked only at current-version tokens). Now they are checked under the weights that sampled
    them, kept from the previous step."""
    model, tok = tiny
    tr = Trainer(model, TrainerCfg(lr=1e-2, warmup_steps=0), AlgoCfg(), 1.0, 10, 16)
    a = build_batch(_trajs(tok, seed=1), torch.linspace(-1, 1, 8), tok.pad_token_id)
    b = build_batch(_trajs(tok, seed=2), torch.linspace(-1, 1, 8), tok.pad_token_id)
    a.behav_logp, a.versions = tr.logprobs(a), torch.where(a.loss_mask.bool(), 0, -1)  # sampled by v0
    b.behav_logp, b.versions = tr.logprobs(b), torch.where(b.loss_mask.bool(), 1, -1)  # by v1 = weights now
    m1 = tr.step(a, version=1)  # the trainer is at v1 and keeps these weights; a's tokens cannot be checked
    assert m1["logprob_mismatch_tokens"] == 0 and m1["logprob_mismatch_mean"] is None
    m2 = tr.step(b, version=2)  # b's tokens are one version old: checked under the kept v1 weights
    assert m2["logprob_mismatch_tokens"] > 0 and m2["logprob_mismatch_mean"] < 1e-5
    # an engine off by 0.5 nats on such tokens is reported as such (not as 0)
    tr2 = Trainer(model, TrainerCfg(lr=1e-2, warmup_steps=0), AlgoCfg(), 1.0, 10, 16)
    tr2.versions.prev = (1, {k: p.detach().clone() for k, p in model.named_parameters()})
    b.behav_logp = tr2.logprobs(b) + 0.5 * b.loss_mask
    assert abs(tr2.step(b, version=2)["logprob_mismatch_mean"] - 0.5) < 1e-4


def test_token_level_advantages_and_masks(tiny):
    """The batch carries an advantage per token (agents' step credit) and a loss mask that can
    take response tokens out (tool output, template tokens between turns). A per-token advantage
    equal to the sequence's gives the same gradient as the sequence form; masked tokens add
    nothing to it."""
    model, tok = tiny
    trajs = _trajs(tok)
    adv = torch.linspace(-1, 1, 8)
    grads = []
    tr = Trainer(model, TrainerCfg(), AlgoCfg(), 1.0, 10, 16)
    for a in (adv, [[float(x)] * len(t.response_ids) for x, t in zip(adv, trajs)]):
        batch = build_batch(trajs, a, tok.pad_token_id)
        model.zero_grad()
        tr.accumulate(batch, None, None, batch.loss_mask.sum().item(), float(batch.size))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], atol=1e-7)
    # a row whose first response token is masked: its target drops out of the mask and the advantages
    t = trajs[0]
    t.mask = [0] + [1] * (len(t.response_ids) - 1)
    b = build_batch(trajs, adv, tok.pad_token_id)
    start = len(t.prompt_ids) - 1
    assert b.loss_mask[0, start] == 0 and b.advantages[0, start] == 0
    assert b.loss_mask[0].sum() == len(t.response_ids) - 1
    assert b.advantages[0, start + 1] == adv[0]


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("updates", [1, 2])
def test_rows_with_zero_advantage_are_skipped_and_the_update_is_the_same(tiny_path, agg, updates):
    """Half the rows have advantage 0 (a group all right or all wrong): they are not forwarded, and the
    weights after the step equal those of a step that forwards every row (the normalisers count them)."""
    from relayrl.models import load_policy, load_tokenizer

    adv = torch.tensor([1.0, -1.0, 0.0, 0.0, 0.5, 0.0, -0.5, 0.0])
    out = []
    for skip in (True, False):
        model = load_policy(tiny_path)
        batch = build_batch(_trajs(load_tokenizer(tiny_path)), adv, 0)
        tr = Trainer(model, TrainerCfg(lr=1e-2, warmup_steps=0, updates_per_step=updates),
                     AlgoCfg(agg=agg, kl_coef=0), 1.0, 10, 16)  # (a KL term sees every row: next test)
        if not skip:
            tr._contributing = lambda mini, ref: None
        torch.manual_seed(0)  # the same mini-batch split
        m = tr.step(batch)
        out.append(({k: v.clone() for k, v in model.state_dict().items()}, m))
    (skipped, m1), (full, m2) = out
    assert m1["rows_skipped"] == 4 and m2["rows_skipped"] == 0
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-5, abs=1e-7)  # (summation order: a 2e-4 loss, ~1e-9 apart)
    for k in full:
        assert torch.allclose(skipped[k], full[k], atol=1e-6, rtol=1e-5), k
    assert any(not torch.equal(skipped[k], load_policy(tiny_path).state_dict()[k]) for k in full)


def test_no_row_is_skipped_when_a_term_sees_it(tiny):
    """A KL loss term or an entropy bonus has a gradient on rows with advantage 0: nothing is skipped."""
    model, tok = tiny
    adv = torch.tensor([1.0, -1.0, 0.0, 0.0, 0.5, 0.0, -0.5, 0.0])
    for algo in (AlgoCfg(kl_coef=0.1), AlgoCfg(entropy_coef=0.01), AlgoCfg(ess_lr_scale=True)):
        tr = Trainer(model, TrainerCfg(), algo, 1.0, 10, 16)
        assert tr.step(build_batch(_trajs(tok), adv, tok.pad_token_id))["rows_skipped"] == 0, algo


def test_bf16_autocast_keeps_float32_logits_weights_and_log_probs_close(tiny):
    """trainer.bf16: the step runs under bfloat16 autocast, but the weights (and their copies: the KL
    reference, a deep copy) stay float32, the output projection returns float32 logits, and the
    log-probs stay within bfloat16's rounding of the float32 ones."""
    import copy

    model, tok = tiny
    batch = build_batch(_trajs(tok), torch.linspace(-1, 1, 8), tok.pad_token_id)
    exact = Trainer(copy.deepcopy(model), TrainerCfg(), AlgoCfg(kl_coef=0.0), 1.0, 10, 16).logprobs(batch)
    tr = Trainer(model, TrainerCfg(bf16=True, lr=1e-2, warmup_steps=0), AlgoCfg(kl_coef=0.1), 1.0, 10, 16)
    with torch.autocast("cpu", torch.bfloat16):
        lp = tr.logprobs(batch)
        hidden = torch.randn(2, 3, model.config.hidden_size)
        assert model.get_output_embeddings()(hidden).dtype == torch.float32
        twin = copy.deepcopy(model)  # its head computes with its own weights
        twin.get_output_embeddings().weight.data.zero_()
        assert twin.get_output_embeddings()(hidden).abs().max() == 0
        assert model.get_output_embeddings()(hidden).abs().max() > 0
    err = (lp - exact).abs().max().item()
    assert 0 < err < 0.05, err  # (autocast really ran, and rounded no further than bfloat16 does)
    m = tr.step(batch)
    assert all(p.dtype == torch.float32 for p in model.parameters()) and math.isfinite(m["loss"])


@pytest.mark.parametrize("checkpointing,attention", [("off", "eager"), ("on", "sdpa")])
def test_bf16_on_a_cpu_attends_eagerly_unless_checkpointed(tiny, checkpointing, attention):
    """trainer.bf16 on a CPU: eager attention for speed, but not where checkpointing asks for memory (eager
    holds every head's T x T probabilities)."""
    model, _ = tiny
    model.set_attn_implementation("sdpa")
    Trainer(model, TrainerCfg(bf16=True, gradient_checkpointing=checkpointing), AlgoCfg(kl_coef=0.0), 1.0, 10, 16)
    assert model.config._attn_implementation == attention


def test_bf16_needs_float32_weights():
    from relayrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="trainer.bf16=true needs model.dtype=float32"):
        load_config(None, ["trainer.bf16=true", "model.dtype=bfloat16"])
