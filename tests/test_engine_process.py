"""The engine in a child process: same answers as in-process, weights through shared memory,
versions, aborts, and a clear error when the child cannot start."""

import pytest
import torch

from relayrl.config import RolloutCfg
from relayrl.engine import EngineError
from relayrl.engine.process import ProcessEngine
from relayrl.engine.spec import EngineSpec
from relayrl.models import token_logprobs
from relayrl.records import FinishReason, GenRequest, SamplingParams


def _req(tok, rid, n, so_far=()):
    ids = tok.apply_chat_template([{"role": "user", "content": "Add 3 4"}], add_generation_prompt=True)["input_ids"]
    return GenRequest(rid, list(ids), SamplingParams(n, 1.0), list(so_far))


def _check_logprobs(model, req, c):
    ids = torch.tensor([req.prompt_ids + req.response_so_far + c.token_ids])
    start = len(req.prompt_ids) + len(req.response_so_far)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, start - 1 : -1]
    lp = token_logprobs(logits, ids[:, start:], 1.0)[0]
    assert torch.allclose(lp, torch.tensor(c.logprobs), atol=1e-4)


@pytest.mark.slow
def test_process_engine_generates_swaps_weights_and_aborts(tiny, tiny_path):
    model, tok = tiny
    eng = ProcessEngine(EngineSpec(RolloutCfg(), tiny_path, tiny_path, "float32", version=2, threads=1), model.state_dict())
    try:
        reqs = [_req(tok, f"r{i}", 12) for i in range(3)]
        for r, c in zip(reqs, eng.generate(reqs)):
            assert set(c.versions) == {2} and len(c.token_ids) == len(c.logprobs) > 0
            _check_logprobs(model, r, c)
        # new weights through shared memory: later tokens carry version 5 and match the new model
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
        eng.load_weights(model.state_dict(), 5)
        assert eng.version == 5
        r = _req(tok, "after", 12)
        c = eng.generate([r])[0]
        assert set(c.versions) == {5}
        _check_logprobs(model, r, c)
        # an abort comes back with exactly the tokens generated, which can be continued
        eng.submit([_req(tok, "long", 10**4)])
        with eng.pause():
            eng.abort(["long"])
        (cut,) = list(eng.drain())
        assert cut.finish_reason == FinishReason.ABORTED and len(cut.token_ids) == len(cut.versions)
        assert eng.num_pending() == 0
    finally:
        eng.close()
    assert not eng._proc.is_alive()


def test_process_engine_reports_a_failed_start(tiny, tmp_path):
    model, _ = tiny
    with pytest.raises(EngineError, match="failed to start"):
        ProcessEngine(EngineSpec(RolloutCfg(), str(tmp_path / "missing"), str(tmp_path / "missing"), "float32"),
                      model.state_dict())


@pytest.mark.slow
def test_a_dead_engine_process_is_reported_within_seconds_by_every_call(tiny, tiny_path):
    """The async rollout polls ``get`` with a timeout and publishes through ``load_weights``: before
    the fix a dead child made the first return [] forever and the second wait 120 s."""
    import os
    import signal
    import time

    model, tok = tiny
    eng = ProcessEngine(EngineSpec(RolloutCfg(), tiny_path, tiny_path, "float32", threads=1), model.state_dict())
    try:
        eng.submit([_req(tok, "long", 10**4)])
        os.kill(eng._proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineError, match="died .killed by SIGKILL"):
            for _ in range(200):
                eng.get(timeout=0.05)
        with pytest.raises(EngineError, match="died"):
            eng.load_weights(model.state_dict(), 1)
        assert time.monotonic() - t0 < 5
    finally:
        eng.close()
