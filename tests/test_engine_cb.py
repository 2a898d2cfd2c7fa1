"""The continuous-batching engine: log-probs, abort with exact partial tokens, weight swaps mid-flight."""

import time

import pytest
import torch

from relayrl.engine.hf_cb import HFContinuousEngine
from relayrl.models import token_logprobs
from relayrl.records import FinishReason, GenRequest, SamplingParams

P = SamplingParams(400, 0.8)


@pytest.fixture()
def engine(tiny):
    model, tok = tiny
    eng = HFContinuousEngine(model, tok, P, num_blocks=64, page_size=16, max_batch_tokens=256, eos_token_ids=[])
    yield eng, model, tok
    eng.close()


def _ids(tok):
    return list(tok.apply_chat_template([{"role": "user", "content": "Add 3 4"}], add_generation_prompt=True)["input_ids"])


def _check_logprobs(model, prompt, c, temperature):
    x = torch.tensor([prompt + c.token_ids])
    with torch.no_grad():
        logits = model(input_ids=x).logits[:, len(prompt) - 1 : -1]
    lp = token_logprobs(logits, x[:, len(prompt) :], temperature)[0]
    assert torch.allclose(lp, torch.tensor(c.logprobs), atol=1e-4)


def test_cb_logprobs_budgets_and_greedy_fallback(engine):
    eng, model, tok = engine
    p = _ids(tok)
    outs = eng.generate([GenRequest("a", p, SamplingParams(5, 0.8)), GenRequest("b", p, SamplingParams(11, 0.8)),
                         GenRequest("g", p, SamplingParams(6, 0.0))])
    assert [len(c.token_ids) for c in outs] == [5, 11, 6]
    assert all(c.finish_reason == FinishReason.LENGTH for c in outs)
    _check_logprobs(model, p, outs[1], 0.8)


def test_cb_abort_keeps_exactly_the_streamed_tokens(engine):
    eng, model, tok = engine
    p = _ids(tok)
    eng.submit([GenRequest("long", p, P)])
    while len(eng._live["long"].tokens) < 20:  # abort mid-generation
        time.sleep(0.001)
    eng.abort(["long"])
    (c,) = list(eng.drain())
    assert c.finish_reason == FinishReason.ABORTED and 0 < len(c.token_ids) < 400
    assert len(c.logprobs) == len(c.versions) == len(c.token_ids)
    _check_logprobs(model, p, c, 0.8)  # the kept tokens are the ones generated, with their log-probs
    rest = eng.generate([GenRequest("cont", p, SamplingParams(400 - len(c.token_ids), 0.8), c.token_ids)])[0]
    assert len(c.token_ids) + len(rest.token_ids) == 400, rest.finish_reason


def test_cb_weight_swap_mid_flight_tags_versions(engine):
    eng, model, tok = engine
    new = {k: v + 0.01 for k, v in model.state_dict().items()}
    eng.submit([GenRequest("x", _ids(tok), P)])
    while len(eng._live["x"].tokens) < 5:  # swap mid-flight
        time.sleep(0.001)
    eng.load_weights(new, version=3)
    (c,) = list(eng.drain(timeout=120))
    assert len(c.token_ids) == 400
    assert c.versions[0] == 0 and c.versions[-1] == 3 and c.versions == sorted(c.versions)
    assert eng.version == 3


def test_cb_swap_between_taking_an_output_and_tagging_it_keeps_old_versions(engine):
    """A weight swap that lands after the collector took an output from the manager and before it
    tagged the tokens must not tag tokens sampled by the old weights with the new version."""
    import threading

    eng, model, tok = engine
    new = {k: v + 0.01 for k, v in model.state_dict().items()}
    real_get, seen = eng.mgr.get_result, {}

    def get_result(timeout=None):
        if threading.current_thread() is seen.get("swap"):
            return None  # the swap's own drain finds nothing newer: the collector holds the latest output
        out = real_get(timeout=timeout)
        if out is not None and out.request_id == "x" and not seen and len(out.generated_tokens) >= 5:
            seen["n"] = len(out.generated_tokens)  # sampled by version 0
            swap = seen["swap"] = threading.Thread(target=eng.load_weights, args=(new, 3))
            swap.start()
            swap.join(0.5)  # the swap gets in here unless the collector holds the engine's lock
        return out

    eng.mgr.get_result = get_result
    eng.submit([GenRequest("x", _ids(tok), SamplingParams(60, 0.8))])
    (c,) = list(eng.drain(timeout=120))
    seen["swap"].join()
    assert eng.version == 3 and c.versions[-1] == 3
    assert set(c.versions[: seen["n"]]) == {0}, c.versions[: seen["n"]]
