"""relayrl's decoding forward on mixtures of experts (``engine/fast_decode.py``, ``engine/row_routes.py``): the
same tokens, log-probs and recorded routes as the model's own forward, through the deduplicated prefill of a
group's copies, one token a row, and verified drafts (speculative decoding), of which only the accepted
tokens' routes are kept."""

import copy

import pytest
import torch

from relayrl.demo import model as demo_model
from relayrl.engine.fast_decode import fast_decoder
from relayrl.engine.hf import HFEngine
from relayrl.engine.speculative import Speculator
from relayrl.models import moe
from relayrl.records import GenRequest, SamplingParams
from tests.families import FAMILIES, MOE, build

# (qwen2_moe is not one of the conformance suite's families: added here only, not to ``FAMILIES`` itself)
QWEN2_MOE = ("qwen2_moe", {**MOE, "shared_expert_intermediate_size": 32, "decoder_sparse_step": 1, "mlp_only_layers": []})
FAST_MOE = ["qwen3_moe", "qwen2_moe", "mixtral"]


def _build(family, tok):
    if family != "qwen2_moe":
        return build(family, tok)
    FAMILIES["qwen2_moe"] = QWEN2_MOE
    try:
        return build(family, tok)
    finally:
        del FAMILIES["qwen2_moe"]


@pytest.fixture(scope="module")
def tok():
    return demo_model.build_tokenizer(demo_model.RECIPE["seed"], 300)


def _requests(tok, tag=""):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, len(tok), (n,), generator=g).tolist() for n in (9, 14, 6)]
    # (a group of 3 copies of one prompt: the prefill computes it once and copies it; two other lengths: padding)
    ctx = [prompts[0]] * 3 + prompts[1:]
    return [GenRequest(f"{tag}r{i}", c, SamplingParams(20, 1.0, seed=i)) for i, c in enumerate(ctx)]


def _generate(model, tok, fast, spec=None, passes=1, counts=None):
    engine = HFEngine(copy.deepcopy(model), tok, fast_decode=fast, speculator=spec)
    try:
        assert (engine._fast is not None) == fast
        out = [engine.generate(_requests(tok, f"p{k}.")) for k in range(passes)]
        if counts is not None:
            counts.update(engine.take_spec())  # (the speculator's own counts: drafted, accepted, ...)
        return out
    finally:
        engine.close()


def _full_forward_routes(model, prompt, response):
    """The routes the model's own forward chooses over the whole sequence, at every position fed."""
    rec = moe.Recorder(model)
    with rec.capture(), torch.no_grad():
        model(input_ids=torch.tensor([prompt + response]))
    return rec.routes()[: len(prompt) + len(response) - 1]


def _same_share(a, b):
    return float((a.sort(-1).values == b.sort(-1).values).all(-1).all(-1).float().mean())


@pytest.mark.parametrize("family", FAST_MOE)
def test_the_decoding_forward_gives_a_mixture_of_experts_own_tokens_log_probs_and_routes(family, tok):
    model = _build(family, tok)
    assert fast_decoder(copy.deepcopy(model)) is not None  # (its logits checked against the model's at start)
    [own], [fast] = _generate(model, tok, False), _generate(model, tok, True)
    for r, a, b in zip(_requests(tok), own, fast):
        assert a.token_ids == b.token_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
        assert b.routes.shape == (len(r.prompt_ids) + len(b.token_ids) - 1, *a.routes.shape[1:])
        # every fed position's experts, those the model's own forward over the whole sequence chooses
        assert _same_share(torch.from_numpy(b.routes), _full_forward_routes(model, r.prompt_ids, b.token_ids)) > 0.99


def test_verified_drafts_keep_only_the_accepted_tokens_routes(tok):
    """The second epoch drafts from the first (history) and accepts most of it; its tokens are the first's (seeded
    requests draw the same numbers) and so are its routes: a draft token rejected leaves none behind."""
    model = build("qwen3_moe", tok)
    counts = {}
    # (choose=False: every draft verified, whatever a timed forward costs on this machine)
    first, second = _generate(model, tok, True, Speculator(["history"], max_draft=8, choose=False), passes=2,
                              counts=counts)
    for r, a, b in zip(_requests(tok), first, second):
        assert a.token_ids == b.token_ids
        assert b.routes.shape == a.routes.shape == (len(r.prompt_ids) + len(a.token_ids) - 1, *a.routes.shape[1:])
        assert _same_share(torch.from_numpy(b.routes), torch.from_numpy(a.routes)) > 0.99
    # drafts were verified and accepted (the test passed with speculation off: it counted every emitted token)
    assert counts.get("accepted", 0) > 40, counts
