"""The sampling distribution (temperature, top-k, top-p): hand-computed, and the same in the
engine and the trainer, so importance ratios compare like with like."""

import math

import pytest
import torch

from relayrl.config import AlgoCfg, TrainerCfg
from relayrl.engine.hf import HFEngine
from relayrl.records import GenRequest, SamplingParams
from relayrl.algos.token_sampling import REMOVED, sampled_logprobs, sampling_scores, truncation_mask
from relayrl.train.trainer import Trainer, build_batch


def test_top_k_and_top_p_hand_computed():
    # probabilities .5 .3 .15 .05: top-p .8 keeps .5 and .3 (the tail .15+.05=.2 ≤ .2 goes); top-k 3 drops .05
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert truncation_mask(logits, top_p=0.8).tolist() == [[False, False, True, True]]
    assert truncation_mask(logits, top_k=3).tolist() == [[False, False, False, True]]
    assert truncation_mask(logits) is None
    s = sampling_scores(logits, temperature=1.0, top_p=0.8)
    assert s[0, 2].item() == REMOVED and torch.allclose(s.softmax(-1), torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    # the trainer's log-prob renormalises over the kept tokens: log(.5/.8)
    lp = sampled_logprobs(logits, torch.tensor([0]), 1.0, top_p=0.8)
    assert math.isclose(lp.item(), math.log(0.625), rel_tol=1e-5)
    # a target the truncation would remove keeps a finite log-prob (rounding at the boundary)
    lp = sampled_logprobs(logits, torch.tensor([3]), 1.0, top_p=0.8)
    assert math.isclose(lp.item(), math.log(0.05 / 0.85), rel_tol=1e-5)


def test_engine_and_trainer_agree_under_top_p_and_top_k(tiny):
    """Before, the engine recorded truncated log-probs and the trainer computed untruncated ones:
    every ratio was biased by 1/(kept mass) (here |Δ log p| ≈ 0.1-1)."""
    model, tok = tiny
    engine = HFEngine(model, tok, eos_token_ids=[])
    ids = tok.apply_chat_template([{"role": "user", "content": "Add 3 4"}], add_generation_prompt=True)["input_ids"]
    try:
        outs = engine.generate([GenRequest(f"r{i}", list(ids), SamplingParams(12, 1.0, top_p=0.7, top_k=20))
                                for i in range(4)])
    finally:
        engine.close()
    from relayrl.records import FinishReason, Prompt, Trajectory

    p = Prompt("p", [])
    trajs = [Trajectory(p, "g", i, list(ids), c.token_ids, c.logprobs, c.versions, FinishReason.LENGTH)
             for i, c in enumerate(outs)]
    batch = build_batch(trajs, torch.zeros(4), tok.pad_token_id)
    tr = Trainer(model, TrainerCfg(), AlgoCfg(), 1.0, 10, 16, top_p=0.7, top_k=20)
    diff = (tr.logprobs(batch) - batch.behav_logp).abs()[batch.loss_mask.bool()]
    assert diff.max() < 1e-4
    untruncated = Trainer(model, TrainerCfg(), AlgoCfg(), 1.0, 10, 16)
    assert (untruncated.logprobs(batch) - batch.behav_logp).abs()[batch.loss_mask.bool()].max() > 1e-2


def test_seeded_uniforms_are_a_function_of_seed_and_position_and_uniform():
    from relayrl.algos.token_sampling import seeded_uniform

    seeds = torch.arange(20000).repeat_interleave(10)
    pos = torch.arange(10).repeat(20000)
    u = seeded_uniform(seeds, pos)
    assert 0 < u.min() and u.max() < 1
    assert torch.equal(u, seeded_uniform(seeds, pos))
    assert torch.equal(u[:10], seeded_uniform(torch.zeros(10, dtype=torch.long), torch.arange(10)))
    counts = torch.histc(u.float(), bins=20, min=0, max=1)
    chi2 = float(((counts - len(u) / 20) ** 2 / (len(u) / 20)).sum())
    assert chi2 < 45  # 19 degrees of freedom: p ≈ 0.001
    assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 0.01  # neighbours independent


def test_seeded_sampling_draws_from_the_distribution_and_ignores_its_batch():
    from relayrl.algos.token_sampling import sample_tokens

    n = 40000
    scores = torch.log(torch.tensor([0.1, 0.2, 0.0, 0.7])).expand(n, 4)  # token 2: no mass
    tok = sample_tokens(scores, torch.arange(n), torch.zeros(n, dtype=torch.long))
    freq = torch.bincount(tok, minlength=4).double() / n
    assert torch.allclose(freq, torch.tensor([0.1, 0.2, 0.0, 0.7], dtype=torch.double), atol=0.01)
    other = torch.randn(5, 4)
    mixed = sample_tokens(torch.cat([scores[:7], other]), torch.cat([torch.arange(7), torch.full((5,), -1)]),
                          torch.zeros(12, dtype=torch.long))
    assert torch.equal(mixed[:7], tok[:7])  # the seeded rows draw what they drew without their batch mates
    state = torch.get_rng_state()
    sample_tokens(scores[:7], torch.arange(7), torch.zeros(7, dtype=torch.long))
    assert torch.equal(state, torch.get_rng_state())  # seeded rows take nothing from the global stream


@pytest.mark.parametrize("fast", [False, True])
def test_a_seeded_request_samples_the_same_alone_in_a_batch_and_continued(tiny, fast):
    """hf engine: a seeded request's tokens depend on its seed alone (not on its batch, not on the
    global stream), and a response cut and continued goes on as if it had not been cut."""
    model, tok = tiny
    ids = tok.apply_chat_template([{"role": "user", "content": "Add 3 4"}], add_generation_prompt=True)["input_ids"]
    req = lambda rid, seed, n=30, so_far=(): GenRequest(rid, list(ids), SamplingParams(n, 1.0, seed=seed),  # noqa: E731
                                                      list(so_far))
    eng = HFEngine(model, tok, fast_decode=fast)
    eng.eos_ids = set()
    try:
        torch.manual_seed(0)
        alone = eng.generate([req("a", 7)])[0].token_ids
        torch.manual_seed(1)
        batch = eng.generate([req("x", None), req("b", 7), req("y", 8), req("z", None)])
        assert batch[1].token_ids == alone and batch[2].token_ids != alone
        first = eng.generate([req("c1", 7, 12)])[0].token_ids
        rest = eng.generate([req("c2", 7, 18, first)])[0].token_ids
        assert first + rest == alone
    finally:
        eng.close()
