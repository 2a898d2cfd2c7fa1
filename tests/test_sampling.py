"""The sampling distribution (temperature, top-k, top-p): hand-computed, and the same in the
engine and the trainer, so importance ratios compare like with like."""

import math

import torch

from relayrl.config import AlgoCfg, TrainerCfg
from relayrl.engine.hf import HFEngine
from relayrl.records import GenRequest, SamplingParams
from relayrl.sampling import REMOVED, sampled_logprobs, sampling_scores, truncation_mask
from relayrl.trainer import Trainer, build_batch


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
