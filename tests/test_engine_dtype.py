"""rollout.dtype: the engine's copy of the policy in bfloat16 beside a float32 trainer. It generates
(through relayrl's decoding forward), its log-probs are float32 values close to, not equal to, the
trainer's; weight loads (in process, in an engine process, in a Ray actor) reach the bfloat16 copy;
the config takes it where it applies."""

import pytest
import torch

from relayrl.config import AlgoCfg, ConfigError, RolloutCfg, TrainerCfg, load_config
from relayrl.engine.spec import EngineSpec, build_local_engine, engine_spec
from relayrl.models import load_policy, load_tokenizer, token_logprobs
from relayrl.records import FinishReason, GenRequest, Prompt, SamplingParams, Trajectory

PROMPTS = [(3, 4), (12, 9), (1, 100)]


def _requests(tok, n=24, tag="r"):
    """Two seeded samples of each prompt: the same requests draw the same numbers in every engine."""
    out = []
    for i, (a, b) in enumerate(PROMPTS):
        ids = tok.apply_chat_template([{"role": "user", "content": f"Add {a} {b}"}], add_generation_prompt=True)
        for j in range(2):
            out.append(GenRequest(f"{tag}{i}-{j}", list(ids["input_ids"]), SamplingParams(n, 1.0, seed=10 * i + j)))
    return out


def _engine(tiny_path, dtype: str):
    cfg = load_config(None, [f"model.path={tiny_path}", f"rollout.dtype={dtype}"])
    spec = engine_spec(cfg.rollout, cfg.model.dtype, tiny_path, tiny_path, 0, 0, 0)
    return build_local_engine(spec, tokenizer=load_tokenizer(tiny_path))


def _trainer_logprobs(model, req, c) -> torch.Tensor:
    """The float32 model's log-probs of the tokens the engine sampled."""
    ids = torch.tensor([req.prompt_ids + c.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, len(req.prompt_ids) - 1 : -1]
    return token_logprobs(logits, ids[:, len(req.prompt_ids):], 1.0)[0]


def _gap(model, reqs, outs) -> float:
    """Largest |engine log-prob − the float32 model's| over every sampled token."""
    return max((_trainer_logprobs(model, r, c) - torch.tensor(c.logprobs)).abs().max().item()
               for r, c in zip(reqs, outs))


def _perturbed(tiny_path, scale=0.05):
    other = load_policy(tiny_path)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * torch.randn_like(p))
    return other


def _mismatch(tiny_path, reqs, outs) -> float:
    """The trainer's own engine/trainer mismatch metric on these completions (a float32 trainer)."""
    from relayrl.train.trainer import Trainer, build_batch

    trajs = [Trajectory(Prompt(f"p{i // 2}", []), f"g{i // 2}", i % 2, r.prompt_ids, c.token_ids, c.logprobs,
                        c.versions, c.finish_reason) for i, (r, c) in enumerate(zip(reqs, outs))]
    batch = build_batch(trajs, torch.linspace(-1, 1, len(trajs)), 0)
    tr = Trainer(load_policy(tiny_path), TrainerCfg(device="cpu", warmup_steps=0), AlgoCfg(kl_coef=0.0), 1.0, 10, 64)
    return tr.step(batch, version=0)["logprob_mismatch_mean"]


def test_a_bfloat16_engine_generates_float32_logprobs_close_to_the_trainers(tiny_path):
    tok = load_tokenizer(tiny_path)
    out, gaps = {}, {}
    model = load_policy(tiny_path)
    for dtype in ("float32", "bfloat16"):
        eng = _engine(tiny_path, dtype)
        assert eng.model.dtype == getattr(torch, dtype)
        assert eng._fast is not None  # relayrl's decoding forward works in bfloat16 (checked at start)
        reqs = _requests(tok)
        out[dtype] = eng.generate(reqs)
        eng.close()
        assert all(c.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and c.token_ids for c in out[dtype])
        gaps[dtype] = _gap(model, reqs, out[dtype])
    lps = [x for c in out["bfloat16"] for x in c.logprobs]
    # float32 values (from the bfloat16 logits, upcast), not bfloat16-rounded ones
    assert sum(torch.tensor(x).bfloat16().float().item() != x for x in lps) > len(lps) // 2
    assert gaps["float32"] < 1e-4
    assert 1e-4 < gaps["bfloat16"] < 0.02, gaps  # close, not equal
    # the trainer's mismatch metric sees it: nonzero but small; none for a float32 engine
    reqs = _requests(tok)
    assert _mismatch(tiny_path, reqs, out["float32"]) < 1e-5
    assert 1e-5 < _mismatch(tiny_path, reqs, out["bfloat16"]) < 0.01


def test_load_weights_reaches_the_bfloat16_copy(tiny_path):
    tok = load_tokenizer(tiny_path)
    old, new = load_policy(tiny_path), _perturbed(tiny_path)
    eng = _engine(tiny_path, "bfloat16")
    try:
        reqs = _requests(tok, tag="a")
        before = eng.generate(reqs)
        eng.load_weights(new.state_dict(), 1)  # float32 weights, cast on the way in
        params = dict(eng.model.named_parameters())
        for k, v in new.state_dict().items():
            if k in params:
                assert params[k].dtype == torch.bfloat16 and torch.equal(params[k], v.bfloat16()), k
        reqs = _requests(tok, tag="b")
        after = eng.generate(reqs)
    finally:
        eng.close()
    assert {v for c in after for v in c.versions} == {1}
    assert [c.logprobs for c in after] != [c.logprobs for c in before]
    # the engine samples the new weights: its log-probs are the new model's (to bfloat16's rounding)
    assert _gap(new, reqs, after) < 0.05 < _gap(old, reqs, after)


@pytest.mark.slow
def test_an_engine_process_in_bfloat16_takes_float32_weights(tiny_path):
    from relayrl.engine.process import ProcessEngine

    tok = load_tokenizer(tiny_path)
    old, new = load_policy(tiny_path), _perturbed(tiny_path)
    spec = EngineSpec(RolloutCfg(dtype="bfloat16"), tiny_path, tiny_path, "float32", threads=1)
    eng = ProcessEngine(spec, old.state_dict())
    try:
        assert {v.dtype for v in eng._shared.values()} == {torch.bfloat16}  # half the shared memory
        reqs = _requests(tok, tag="a")
        assert _gap(old, reqs, eng.generate(reqs)) < 0.02
        eng.load_weights(new.state_dict(), 3)
        reqs = _requests(tok, tag="b")
        after = eng.generate(reqs)
    finally:
        eng.close()
    assert {v for c in after for v in c.versions} == {3}
    assert _gap(new, reqs, after) < 0.05 < _gap(old, reqs, after)


@pytest.mark.slow
def test_a_ray_engine_in_bfloat16_takes_float32_weights(tiny_path, monkeypatch):
    ray = pytest.importorskip("ray", reason="Ray is part of the dev extra: pip install -e '.[dev]'")
    from relayrl.engine.ray_engine import RayEngine

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, namespace="relayrl-tests-dtype")
    tok = load_tokenizer(tiny_path)
    old, new = load_policy(tiny_path), _perturbed(tiny_path)
    spec = EngineSpec(RolloutCfg(dtype="bfloat16"), tiny_path, tiny_path, "float32", threads=1, max_model_len=512)
    eng = RayEngine(spec, "test-engine-dtype", max_restarts=0)
    try:
        assert ray.get(eng._actor.num_pending.remote()) == 0
        eng.load_weights(new.state_dict(), 2)
        # half the bytes sent (through the collective, auto's choice) and kept for a replacement
        assert {v.dtype for v in eng._weights.values()} == {torch.bfloat16}
        reqs = _requests(tok, tag="b")
        after = eng.generate(reqs)
    finally:
        eng.close()
        ray.shutdown()
    assert {v for c in after for v in c.versions} == {2}
    assert _gap(new, reqs, after) < 0.05 < _gap(old, reqs, after)


def test_the_config(tiny_path):
    base = [f"model.path={tiny_path}"]
    for engine in ("hf", "hf-cb"):
        cfg = load_config(None, base + [f"rollout.engine={engine}", "rollout.dtype=bfloat16"])
        assert engine_spec(cfg.rollout, cfg.model.dtype, tiny_path, tiny_path, 0, 0, 0).engine_dtype == "bfloat16"
    with pytest.raises(ConfigError, match="rollout.dtype is set, but it only applies with rollout.engine=hf or hf-cb"):
        load_config(None, base + ["rollout.engine=vllm", "rollout.dtype=bfloat16"])
    with pytest.raises(ConfigError, match="rollout.dtype"):
        load_config(None, base + ["rollout.dtype=float16"])
    # 'auto' (the default): model.dtype, whatever it is; vLLM always model.dtype
    for model_dtype in ("float32", "bfloat16"):
        assert EngineSpec(RolloutCfg(), "m", "m", model_dtype).engine_dtype == model_dtype
    assert EngineSpec(RolloutCfg(engine="vllm"), "m", "m", "float32").engine_dtype == "float32"
    assert EngineSpec(RolloutCfg(dtype="float32"), "m", "m", "bfloat16").engine_dtype == "float32"
    # a bfloat16 engine beside trainer.bf16 autocast, and beside a bfloat16 trainer: both allowed
    load_config(None, base + ["rollout.dtype=bfloat16", "trainer.bf16=true"])
    load_config(None, base + ["rollout.dtype=bfloat16", "model.dtype=bfloat16"])


def test_hf_cb_generates_in_bfloat16(tiny_path):
    cfg = load_config(None, [f"model.path={tiny_path}", "rollout.engine=hf-cb", "rollout.dtype=bfloat16",
                             "rollout.max_new_tokens=12"])
    tok = load_tokenizer(tiny_path)
    eng = build_local_engine(engine_spec(cfg.rollout, cfg.model.dtype, tiny_path, tiny_path, 0, 0, 0), tokenizer=tok)
    try:
        assert eng.model.dtype == torch.bfloat16
        reqs = [GenRequest(f"cb{i}", r.prompt_ids, SamplingParams(12, 1.0)) for i, r in enumerate(_requests(tok))]
        outs = eng.generate(reqs)
    finally:
        eng.close()
    assert all(c.token_ids and len(c.logprobs) == len(c.token_ids) for c in outs)
    assert _gap(load_policy(tiny_path), reqs, outs) < 0.02
