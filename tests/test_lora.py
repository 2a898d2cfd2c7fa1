"""LoRA (``model.lora``): the adapter is what trains and what travels. The trainer's parameter set,
its KL reference (the base with the adapter off), the engines' merge of adapter-only updates
(W = W_base + scale·B·A from the base they keep, never twice), and their composition with the
trainer's options."""

import copy

import pytest
import torch

from relayrl.config import AlgoCfg, RolloutCfg, TrainerCfg
from relayrl.config.sections import LoraCfg
from relayrl.engine import EngineError
from relayrl.engine.adapter import AdapterMerge
from relayrl.engine.hf import HFEngine
from relayrl.lora_weights import lora_pairs
from relayrl.models import ModelError, load_policy, token_logprobs
from relayrl.records import GenRequest, SamplingParams
from relayrl.train import lora
from relayrl.train.trainer import Trainer, build_batch
from tests.test_trainer import _trajs

ALL = ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")


def _wrapped(tiny_path, r=4, **kw):
    torch.manual_seed(0)
    return lora.wrap(load_policy(tiny_path), LoraCfg(r=r, **kw))


def _batch(tok, seed=0):
    return build_batch(_trajs(tok, seed=seed), torch.linspace(-1, 1, 8), tok.pad_token_id)


def _randomise_b(model, seed=1):
    """B away from its zero start, so the adapter changes the policy."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for k, p in model.named_parameters():
            if "lora_B" in k:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))


def test_all_linear_targets_every_linear_layer_but_the_head(tiny_path):
    model, spec = _wrapped(tiny_path)
    assert spec.targets == ALL and spec.r == 4 and spec.scale == 32 / 4
    trained = lora.trainable(model)
    assert trained and all("lora_" in k for k in trained)
    assert len(trained) == 2 * 7 * 2  # A and B of 7 modules in each of 2 layers
    assert not any(p.requires_grad for k, p in model.named_parameters() if "lora_" not in k)
    _, chosen = _wrapped(tiny_path, targets=["q_proj", "v_proj"])
    assert chosen.targets == ("q_proj", "v_proj")


@pytest.mark.parametrize("targets, needle", [
    (["qproj"], "'qproj' names no module of the model; its linear layers: down_proj"),
    (["embed_tokens"], "'embed_tokens' names a module that is not linear (Embedding)"),
    (["lm_head"], "is the output head"),
])
def test_targets_that_cannot_take_an_adapter_name_the_field(tiny_path, targets, needle):
    with pytest.raises(ModelError, match="model.lora.targets") as e:
        _wrapped(tiny_path, targets=targets)
    assert needle in str(e.value)


def test_the_trainer_trains_the_adapter_only_and_publishes_it(tiny, tiny_path):
    _, tok = tiny
    model, _ = _wrapped(tiny_path)
    base = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    tr = Trainer(model, TrainerCfg(lr=1e-2, warmup_steps=0), AlgoCfg(), 1.0, 10, 16)
    assert {id(p) for g in tr.opt.param_groups for p in g["params"]} == {id(p) for p in lora.trainable(model).values()}
    m = tr.step(_batch(tok))
    assert m["grad_norm"] > 0
    after = model.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in base.items())  # the base never moves
    sent = tr.full_state_dict()
    pairs = lora_pairs(sent)  # PEFT's saved names, A and B of every target
    assert len(pairs) == 14 and {k.rpartition(".")[2] for k in pairs} == set(ALL)
    assert any(b.abs().sum() > 0 for _, b in pairs.values())  # B moved off zero
    assert all(v.device.type == "cpu" for v in sent.values())
    full = sum(v.numel() for v in base.values())
    assert sum(v.numel() for v in sent.values()) < full / 5


def test_the_kl_reference_is_the_base_with_the_adapter_off(tiny, tiny_path):
    _, tok = tiny
    model, _ = _wrapped(tiny_path)
    _randomise_b(model)
    tr = Trainer(model, TrainerCfg(warmup_steps=0), AlgoCfg(kl_coef=0.1), 1.0, 10, 16)
    assert tr.ref is None and tr.ref_is_base  # no second model
    batch = _batch(tok)
    plain = Trainer(load_policy(tiny_path), TrainerCfg(), AlgoCfg(), 1.0, 10, 16)
    ref = tr._ref_logprobs(batch)
    assert torch.allclose(ref, plain.logprobs(batch), atol=1e-5)  # the base model's own log-probs
    assert not torch.allclose(ref, tr.logprobs(batch), atol=1e-3)  # and not the policy's
    m = tr.step(batch)
    assert m["kl"] > 0


def test_the_mismatch_check_keeps_the_adapter_of_the_last_version_only(tiny, tiny_path):
    _, tok = tiny
    model, _ = _wrapped(tiny_path)
    tr = Trainer(model, TrainerCfg(warmup_steps=0), AlgoCfg(), 1.0, 10, 16)
    batch = _batch(tok)
    batch.versions[:4] = 0  # half the rows sampled one version ago
    batch.versions[4:] = 1
    tr.step(batch, version=1)
    assert tr.versions.prev is not None and set(tr.versions.prev[1]) == set(lora.trainable(model))


def _grads(model):
    return torch.cat([p.grad.flatten() for p in lora.trainable(model).values()])


@pytest.mark.parametrize("option", [
    {"share_prefix": False}, {"gradient_checkpointing": "on"}, {"logprob_chunk_tokens": 0}, {"bf16": True},
])
def test_the_adapters_gradient_is_the_same_through_the_trainers_options(tiny, tiny_path, option):
    """share_prefix (on by default), logprob chunking (the head patched through PEFT's wrapper), gradient
    checkpointing (PEFT's decoder layers found), bf16 (to bfloat16's precision): the same gradient."""
    _, tok = tiny
    batch = _batch(tok)
    grads = []
    for tcfg in (TrainerCfg(), TrainerCfg(**option)):
        model, _ = _wrapped(tiny_path)
        _randomise_b(model)  # (else A's gradient is 0: B is)
        tr = Trainer(model, tcfg, AlgoCfg(), 1.0, 10, 16)
        if tcfg.gradient_checkpointing == "on":
            assert any(hasattr(m, "_relayrl_plain_forward") for m in model.modules())
        model.train()
        with torch.autocast("cpu", torch.bfloat16, enabled=tcfg.bf16):
            tr.accumulate(batch, None, None, batch.loss_mask.sum().item(), float(batch.size))
        grads.append(_grads(model))
    assert grads[0].abs().sum() > 0
    tol = 5e-2 if option.get("bf16") else 1e-4
    assert torch.allclose(grads[0], grads[1], rtol=tol, atol=tol * grads[0].abs().max().item())


# ---- the engines' side


def _engine(path, tok, spec, dtype=torch.float32, **kw):
    """As ``spec.build_local_engine`` makes it: the adapter's base taken in float32, then the cast."""
    model = load_policy(path)
    adapter = AdapterMerge(model, spec)
    return HFEngine(model.to(dtype), tok, adapter=adapter, **kw)


def _req(tok, rid, n=12):
    ids = tok.apply_chat_template([{"role": "user", "content": "Add 3 4"}], add_generation_prompt=True)["input_ids"]
    return GenRequest(rid, list(ids), SamplingParams(n, 1.0), [])


def _check_logprobs(model, req, c, atol=1e-4):
    ids = torch.tensor([req.prompt_ids + c.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, len(req.prompt_ids) - 1 : -1]
    lp = token_logprobs(logits, ids[:, len(req.prompt_ids):], 1.0)[0]
    assert torch.allclose(lp, torch.tensor(c.logprobs), atol=atol), (lp - torch.tensor(c.logprobs)).abs().max()


@pytest.mark.parametrize("fast", [False, True], ids=["model-forward", "fast-decode"])
def test_the_hf_engine_samples_the_base_plus_the_adapter(tiny, tiny_path, fast):
    """The engine's log-probs are the PEFT model's (the trained policy) after an adapter-only update; the
    same update twice changes nothing (merged from the base kept, never onto merged weights)."""
    _, tok = tiny
    model, spec = _wrapped(tiny_path)
    _randomise_b(model)
    adapter = lora.adapter_state(model)
    eng = _engine(tiny_path, tok, spec, fast_decode=fast)
    try:
        eng.load_weights(adapter, 1)
        once = {k: v.clone() for k, v in eng.model.state_dict().items()}
        eng.load_weights(adapter, 2)
        assert all(torch.equal(v, eng.model.state_dict()[k]) for k, v in once.items())  # not applied twice
        reqs = [_req(tok, f"r{i}") for i in range(3)]
        model.eval()
        for r, c in zip(reqs, eng.generate(reqs)):
            assert set(c.versions) == {2}
            _check_logprobs(model, r, c)
        zero = {k: torch.zeros_like(v) if "lora_B" in k else v for k, v in adapter.items()}
        eng.load_weights(zero, 3)  # B = 0: the base model again, exactly
        base = load_policy(tiny_path).state_dict()
        assert all(torch.equal(v, base[k]) for k, v in eng.model.state_dict().items() if k in base)
    finally:
        eng.close()


def test_an_adapter_that_does_not_fit_is_refused_and_nothing_changes(tiny, tiny_path):
    _, tok = tiny
    model, spec = _wrapped(tiny_path)
    _randomise_b(model)
    adapter = lora.adapter_state(model)
    eng = _engine(tiny_path, tok, spec)
    try:
        before = {k: v.clone() for k, v in eng.model.state_dict().items()}
        part = {k: v for k, v in adapter.items() if "layers.1.mlp.down_proj" not in k}
        lone = {k: v for k, v in adapter.items() if "layers.1.mlp.down_proj.lora_B" not in k}
        wrong_rank = {k: torch.cat([v, v], dim=0 if "lora_A" in k else 1) for k, v in adapter.items()}
        for bad, needle in ((part, "targets without an update"), (lone, "only one of lora_A / lora_B"),
                            (wrong_rank, "do not fit its weight"), (load_policy(tiny_path).state_dict(),
                                                                      "is not a LoRA adapter's tensor")):
            with pytest.raises(EngineError, match=needle):
                eng.load_weights(bad, 7)
        assert eng.version == 0
        assert all(torch.equal(v, eng.model.state_dict()[k]) for k, v in before.items())
    finally:
        eng.close()


def test_a_bfloat16_engine_merges_in_float32_then_rounds(tiny, tiny_path):
    _, tok = tiny
    model, spec = _wrapped(tiny_path)
    _randomise_b(model)
    adapter = lora.adapter_state(model)
    eng = _engine(tiny_path, tok, spec, dtype=torch.bfloat16)
    try:
        eng.load_weights(adapter, 1)
        name = "model.layers.0.self_attn.q_proj"
        a, b = lora_pairs(adapter)[name]
        base = load_policy(tiny_path).get_submodule(name).weight  # the float32 base
        want = (base + spec.scale * b @ a).to(torch.bfloat16)
        got = eng.model.get_submodule(name).weight
        # (rounded once, from the float32 sum: not the bfloat16 base plus a bfloat16 delta)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    finally:
        eng.close()


def test_the_engines_base_copy_is_the_weights_as_loaded_kept_on_the_host(tiny_path):
    """The merge's base: the target weights in the dtype they were loaded in (a bf16 model's copy is bf16, not a
    float32 copy twice its size), on the CPU, apart from the parameters the merges overwrite."""
    _, spec = _wrapped(tiny_path)
    model = load_policy(tiny_path).to(torch.bfloat16)
    merge = AdapterMerge(model, spec)
    assert merge.base and all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in merge.base.values())
    assert all(merge.base[n].data_ptr() != m.weight.data_ptr() for n, m in merge.modules.items())


def test_the_engine_process_takes_the_adapter_only(tiny, tiny_path):
    from relayrl.engine.process import ProcessEngine
    from relayrl.engine.spec import EngineSpec

    _, tok = tiny
    model, spec = _wrapped(tiny_path)
    adapter = lora.adapter_state(model)
    eng = ProcessEngine(EngineSpec(RolloutCfg(), tiny_path, tiny_path, "float32", threads=1, lora=spec), adapter)
    try:
        assert eng._shared.keys() == adapter.keys()  # the shared buffers: the adapter's tensors, nothing else
        _randomise_b(model)
        eng.load_weights(lora.adapter_state(model), 1)
        model.eval()
        r = _req(tok, "a")
        c = eng.generate([r])[0]
        assert set(c.versions) == {1}
        _check_logprobs(model, r, c)
        with pytest.raises(EngineError, match="not those it was started with"):
            eng.load_weights(copy.copy(load_policy(tiny_path).state_dict()), 2)
    finally:
        eng.close()


def test_the_continuous_batching_engine_samples_the_base_plus_the_adapter(tiny, tiny_path):
    """hf-cb, built from its spec as a run builds it (``build_local_engine``: the base in model.dtype for the
    adapter's float32 copy, then the cast), takes adapter-only updates too."""
    from relayrl.engine.spec import EngineSpec, build_local_engine

    _, tok = tiny
    model, spec = _wrapped(tiny_path)
    _randomise_b(model)
    r = RolloutCfg(engine="hf-cb", cb_num_blocks=64, cb_page_size=16, cb_max_batch_tokens=256, max_new_tokens=12)
    eng = build_local_engine(EngineSpec(r, tiny_path, tiny_path, "float32", lora=spec), tokenizer=tok)
    try:
        eng.load_weights(lora.adapter_state(model), 1)
        model.eval()
        req = _req(tok, "cb")
        c = eng.generate([req])[0]
        assert set(c.versions) == {1} and c.token_ids
        _check_logprobs(model, req, c)
    finally:
        eng.close()


def test_a_moved_base_is_found_from_the_runs_recorded_model_path(tiny_path, tmp_path):
    """An adapter checkpoint whose adapter_config.json names a base folder that is gone (the run moved, the
    package was installed elsewhere) takes its run's recorded model.path (state.json)."""
    import json

    model, spec = _wrapped(tiny_path)
    lora.write_adapter(tmp_path, lora.adapter_state(model), spec.adapter_config("/nowhere/base"))
    assert lora.read_adapter(tmp_path)[1] == "/nowhere/base"  # (no state.json: as written)
    (tmp_path / "state.json").write_text(json.dumps({"config": {"model": {"path": tiny_path}}}))
    got, base, weights = lora.read_adapter(tmp_path)
    assert base == tiny_path and got == spec and weights.keys() == lora.adapter_state(model).keys()
    assert lora.read_adapter(tiny_path) is None  # a whole model: no adapter


def test_the_no_grad_recomputes_run_without_the_adapters_dropout(tiny, tiny_path):
    """model.lora.dropout is a training regulariser: π_old and the alarm's rows are read as the engine samples,
    without it, even while the model is in training mode (a step's own mode)."""
    _, tok = tiny
    model, _ = _wrapped(tiny_path, dropout=0.5)
    _randomise_b(model)
    tr = Trainer(model, TrainerCfg(), AlgoCfg(kl_coef=0), 1.0, 10, 16)
    batch = _batch(tok)
    model.eval()
    want = tr.logprobs(batch)
    model.train()
    got = [tr.logprobs(batch) for _ in range(3)]
    assert model.training  # (left as it was)
    for g in got:
        torch.testing.assert_close(g, want, atol=1e-6, rtol=1e-6)


def test_an_adapter_with_per_module_alphas_is_refused_for_the_engines_and_merged_by_peft_elsewhere(tiny_path,
                                                                                                    tmp_path):
    """PEFT's alpha_pattern gives modules scales of their own; the engines apply one: such an adapter is refused
    in one line for `relayrl eval --checkpoint` (never sampled as another policy), and a teacher or judge made
    of it is PEFT's own merge."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    peft_model = get_peft_model(load_policy(tiny_path), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                                   alpha_pattern={"v_proj": 64}))
    _randomise_b(peft_model)
    peft_model.save_pretrained(tmp_path)
    with pytest.raises(ModelError, match=r"the adapter's alpha_pattern=\{'v_proj': 64\} is not what relayrl's engines "
                                         r"apply \(one scale lora_alpha / r = 2"):
        lora.read_adapter(tmp_path)
    merged = lora.load_model(str(tmp_path))
    want = copy.deepcopy(peft_model).merge_and_unload()
    for (k, a), b in zip(want.state_dict().items(), merged.state_dict().values()):
        torch.testing.assert_close(b, a, msg=lambda m: f"{k}: {m}")
