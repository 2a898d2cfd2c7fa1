import functools
import time

import pytest
import torch

from relayrl.engine import hf
from relayrl.models import token_logprobs
from relayrl.records import FinishReason, GenRequest, SamplingParams


@pytest.fixture(params=[False, True], ids=["model-forward", "fast-decode"])
def HFEngine(request):
    """Every test here runs on both decoding forwards: the model's own and relayrl's (fast_decode)."""
    return functools.partial(hf.HFEngine, fast_decode=request.param)


def _req(tok, rid, n=32, temp=1.0, so_far=()):
    ids = tok.apply_chat_template([{"role": "user", "content": "Add 3 4"}], add_generation_prompt=True)["input_ids"]
    return GenRequest(rid, list(ids), SamplingParams(n, temp), list(so_far))


def _wait_busy(eng):
    deadline = time.time() + 30
    while not eng._busy:
        assert time.time() < deadline
        time.sleep(0.0005)


def _no_eos(model, eng):
    eng.eos_ids = set()


def test_logprobs_match_a_forward_pass(tiny, HFEngine):
    model, tok = tiny
    eng = HFEngine(model, tok)
    try:
        reqs = [_req(tok, f"r{i}", 16, temp=0.7) for i in range(4)]
        outs = eng.generate(reqs)
        for r, c in zip(reqs, outs):
            assert len(c.token_ids) == len(c.logprobs) == len(c.versions) > 0
            assert set(c.versions) == {0}
            ids = torch.tensor([r.prompt_ids + c.token_ids])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[:, len(r.prompt_ids) - 1 : -1]
            lp = token_logprobs(logits, ids[:, len(r.prompt_ids) :], 0.7)[0]
            assert torch.allclose(lp, torch.tensor(c.logprobs), atol=1e-4)
    finally:
        eng.close()


def test_budgets_per_row_and_finish_reasons(tiny, HFEngine):
    model, tok = tiny
    eng = HFEngine(model, tok)
    _no_eos(model, eng)
    try:
        outs = eng.generate([_req(tok, "a", 3), _req(tok, "b", 9)])
        assert [len(c.token_ids) for c in outs] == [3, 9]
        assert all(c.finish_reason == FinishReason.LENGTH for c in outs)
    finally:
        eng.close()


def test_abort_returns_tokens_so_far_and_continuation_works(tiny, HFEngine):
    model, tok = tiny
    eng = HFEngine(model, tok)
    _no_eos(model, eng)
    try:
        eng.submit([_req(tok, "long", 200), _req(tok, "short", 2)])
        _wait_busy(eng)
        with eng.pause():  # held at a token boundary mid-generation: the abort lands there
            eng.abort(["long"])
        got = {c.request_id: c for c in eng.drain()}
        assert got["short"].finish_reason == FinishReason.LENGTH
        long = got["long"]
        assert long.finish_reason == FinishReason.ABORTED
        assert 0 < len(long.token_ids) < 200
        # continue the partial response with its remaining budget
        rest = eng.generate([_req(tok, "long2", 200 - len(long.token_ids), so_far=long.token_ids)])[0]
        assert len(long.token_ids) + len(rest.token_ids) == 200
    finally:
        eng.close()


def test_weight_swap_mid_generation_tags_versions(tiny, HFEngine):
    model, tok = tiny
    eng = HFEngine(model, tok)
    _no_eos(model, eng)
    new = {k: v + 0.01 for k, v in model.state_dict().items()}
    try:
        eng.submit([_req(tok, "x", 400)])
        _wait_busy(eng)
        eng.load_weights(new, version=7)  # pauses at the next token boundary, swaps, resumes
        (c,) = list(eng.drain())
        assert len(c.token_ids) == 400
        v = c.versions
        assert v[0] == 0 and v[-1] == 7 and v == sorted(v)  # old tokens keep version 0, then all 7
        assert set(v) == {0, 7}
        assert eng.version == 7
    finally:
        eng.close()


def test_abort_and_swap_inside_one_pause_sample_nothing_with_the_new_weights(tiny, HFEngine):
    """Partial rollouts cut in-flight rows and swap weights under one pause: the rows come back at
    the safe point with only old-version tokens (none sampled over the old KV cache by new weights)."""
    model, tok = tiny
    eng = HFEngine(model, tok)
    _no_eos(model, eng)
    new = {k: v + 0.01 for k, v in model.state_dict().items()}
    try:
        eng.submit([_req(tok, "a", 400), _req(tok, "b", 400)])
        _wait_busy(eng)
        with eng.pause():
            eng.abort(["a", "b"])
            eng.load_weights(new, version=3)
        got = list(eng.drain())
        assert len(got) == 2 and all(c.finish_reason == FinishReason.ABORTED for c in got)
        assert all(c.token_ids and set(c.versions) == {0} and len(c.token_ids) < 400 for c in got)
    finally:
        eng.close()


def test_engine_failure_propagates(tiny, HFEngine):
    model, tok = tiny
    eng = HFEngine(model, tok)
    try:
        bad = GenRequest("bad", [10**7], SamplingParams(4))  # token id beyond the vocabulary
        eng.submit([bad])
        import pytest

        with pytest.raises(Exception):
            for _ in range(50):
                eng.get(timeout=0.1)
                if eng._error is not None:
                    eng.get(timeout=0.1)
    finally:
        eng.close()


def test_mixed_sampling_settings_in_one_call(tiny, HFEngine):
    model, tok = tiny
    eng = HFEngine(model, tok)
    _no_eos(model, eng)
    try:
        outs = eng.generate([_req(tok, "greedy", 6, temp=0.0), _req(tok, "hot", 6, temp=1.0),
                             _req(tok, "greedy2", 6, temp=0.0)])
        assert [len(c.token_ids) for c in outs] == [6, 6, 6]
        assert outs[0].token_ids == outs[2].token_ids  # greedy is deterministic: same prompt, same tokens
    finally:
        eng.close()


def _forward_logprobs(model, prompt_ids, token_ids, temp):
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, len(prompt_ids) - 1 : -1]
    return token_logprobs(logits, ids[:, len(prompt_ids) :], temp)[0]


def test_rows_leave_the_batch_and_requests_queue_meanwhile(tiny, HFEngine):
    """Rows of different budgets leave the batch (and its KV cache) one by one; requests submitted
    while it runs form the next batch. Budgets and log-probs stay exact for every row."""
    model, tok = tiny
    eng = HFEngine(model, tok)
    _no_eos(model, eng)
    try:
        first = [_req(tok, f"s{i}", 3 + 5 * i) for i in range(7)] + [_req(tok, "long", 60)]
        eng.submit(first)
        _wait_busy(eng)
        with eng.pause():
            later = [_req(tok, f"t{i}", 5) for i in range(4)]
            eng.submit(later)
        got = {c.request_id: c for c in eng.drain()}
        for r in first + later:
            c = got[r.request_id]
            assert len(c.token_ids) == r.params.max_new_tokens and c.finish_reason == FinishReason.LENGTH
            lp = _forward_logprobs(model, r.prompt_ids, c.token_ids, 1.0)
            assert torch.allclose(lp, torch.tensor(c.logprobs), atol=1e-4), r.request_id
    finally:
        eng.close()


def test_a_driven_engine_decodes_on_the_waiting_thread_and_stops_between_tokens(tiny, HFEngine):
    """``driven=True``: no engine thread; ``serve`` decodes on the caller's thread, token by token,
    stops as soon as ``until()`` holds, and a batch left at a token boundary can be aborted or get
    new weights (its later tokens carry the new version) before it goes on."""
    import threading

    model, tok = tiny
    eng = HFEngine(model, tok, driven=True)
    _no_eos(model, eng)
    seen_threads = set()
    real_steps = eng._steps

    def steps(rows):
        for _ in real_steps(rows):
            seen_threads.add(threading.get_ident())
            yield

    eng._steps = steps
    try:
        assert eng._thread is None
        eng.submit([_req(tok, "a", 20), _req(tok, "b", 20)])
        got = []
        ticks = [0]

        def after_five():
            ticks[0] += 1
            return ticks[0] > 5

        eng.serve(after_five)
        assert eng.num_pending() == 2 and not eng.get(timeout=0)  # stopped mid-batch, nothing finished
        with eng.pause():  # at a token boundary already: the pause does not wait
            eng.abort(["b"])
            eng.load_weights({k: v.clone() for k, v in model.state_dict().items()}, 7)
        eng.serve(lambda: got.extend(eng.get(timeout=0)) or len(got) == 2, timeout=5)
        by = {c.request_id: c for c in got}
        assert by["b"].finish_reason == FinishReason.ABORTED and 0 < len(by["b"].token_ids) < 20
        a = by["a"]
        assert a.finish_reason == FinishReason.LENGTH and len(a.token_ids) == 20
        assert a.versions[0] == 0 and a.versions[-1] == 7 and a.versions == sorted(a.versions)
        assert seen_threads == {threading.get_ident()}  # decoded here, on the test's own thread
    finally:
        eng.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_hf_engine_decodes_on_a_gpu_with_the_trainers_log_probs(tiny_path):
    """rollout.device=cuda: the engine's model, batches and KV cache on the GPU; tokens, log-probs and
    versions come back as Python lists, and match a forward pass; new weights (CPU tensors from the
    trainer) are copied onto the GPU."""
    from relayrl.config import load_config
    from relayrl.models import load_policy, load_tokenizer
    from relayrl.engine.spec import build_local_engine, engine_spec

    cfg = load_config(None, [f"model.path={tiny_path}", "rollout.device=cuda"])
    tok = load_tokenizer(tiny_path)
    eng = build_local_engine(engine_spec(cfg.rollout, cfg.model.dtype, tiny_path, tiny_path, 0, 0, 0), tokenizer=tok)
    try:
        assert eng.device.type == "cuda"
        reqs = [_req(tok, f"r{i}", 24, temp=0.7) for i in range(6)]
        outs = eng.generate(reqs)
        model = load_policy(tiny_path)
        for r, c in zip(reqs, outs):
            ids = torch.tensor([r.prompt_ids + c.token_ids])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[:, len(r.prompt_ids) - 1 : -1]
            lp = token_logprobs(logits, ids[:, len(r.prompt_ids) :], 0.7)[0]
            assert torch.allclose(lp, torch.tensor(c.logprobs), atol=1e-3)
        sd = {k: v * 0 for k, v in model.state_dict().items()}
        eng.load_weights(sd, 1)
        assert all(float(p.abs().sum()) == 0 for p in eng.model.parameters())
        assert set(eng.generate([_req(tok, "after", 4)])[0].versions) == {1}
    finally:
        eng.close()


def test_rollout_device_cpu_keeps_the_engine_on_the_cpu(tiny_path):
    from relayrl.config import load_config
    from relayrl.models import load_tokenizer
    from relayrl.engine.spec import build_local_engine, engine_spec

    cfg = load_config(None, [f"model.path={tiny_path}", "rollout.device=cpu"])
    eng = build_local_engine(engine_spec(cfg.rollout, cfg.model.dtype, tiny_path, tiny_path, 0, 0, 0), tokenizer=load_tokenizer(tiny_path))
    try:
        assert eng.device.type == "cpu" and len(eng.generate([_req(load_tokenizer(tiny_path), "r", 4)])[0].token_ids)
    finally:
        eng.close()
