"""LoRA on a mixture of experts' experts (``model.lora.experts``): PEFT's ``target_parameters`` on the fused expert
tensors, one B·A per expert; the hf engine merges them as PEFT does, the trainer trains them (routes replayed), a
run's engine samples the adapted policy and its checkpoint is PEFT's."""

import copy
import json

import pytest
import torch

from relayrl.config import AlgoCfg, TrainerCfg, load_config
from relayrl.config.sections import LoraCfg
from relayrl.engine.adapter import AdapterMerge
from relayrl.lora_weights import expert_params
from relayrl.models import ModelError
from relayrl.train import lora
from relayrl.train.batch import build_batch
from relayrl.train.trainer import Trainer
from tests.families import build
from tests.test_moe import _moe, _sampled, tok  # noqa: F401 - tok: a fixture


ATTENTION = {"deepseek_v3": ["q_a_proj", "kv_a_proj_with_mqa", "o_proj"]}  # (its MLP names PEFT maps onto experts)


def _adapted(model, r=2, seed=0):
    """``model`` wrapped with experts adapted, its B's random (a trained adapter, not the zero one)."""
    targets = ATTENTION.get(model.config.model_type, "all-linear")
    wrapped, spec = lora.wrap(model, LoraCfg(r=r, experts=True, targets=targets))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in wrapped.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return wrapped, spec


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"])  # (gpt_oss stores its experts [E, in, out])
def test_the_engine_merges_expert_adapters_as_peft_does(tok, family):
    """The engine's merge of the adapter's tensors (PEFT's saved names, nested "base_layer." included) gives PEFT's
    merge_and_unload's logits; the naming rule for two tensors on one module is PEFT's own."""
    torch.manual_seed(0)
    base = build(family, tok, head_scale=1.0).float()
    engine_model, plain = copy.deepcopy(base), copy.deepcopy(base)
    wrapped, spec = _adapted(base)
    assert set(spec.parameters) == {"experts.gate_up_proj", "experts.down_proj"}
    assert spec.adapter_config("b")["target_parameters"] == list(spec.parameters)
    sd = lora.adapter_state(wrapped)
    saved = {k.removeprefix("base_model.model.").rpartition(".lora_")[0] for k in sd if ".experts." in k}
    assert saved == set(expert_params(engine_model, spec.parameters))  # (the rule matches PEFT's names)
    x = torch.randint(3, base.config.vocab_size, (2, 12))
    with torch.no_grad():
        want = wrapped(x).logits
        merge = AdapterMerge(engine_model, spec)
        merge.apply(sd)
        got = engine_model(x).logits
        assert (plain(x).logits - want).abs().max() > 1e-2  # (the adapter changes the policy)
        assert (got - want).abs().max() < 1e-4
        merge.apply(sd)  # (again: from the base copy, never applied twice)
        assert (engine_model(x).logits - want).abs().max() < 1e-4
        assert (wrapped.merge_and_unload()(x).logits - got).abs().max() < 1e-4


def test_an_expert_adapter_of_the_wrong_shape_is_refused(tok):
    base = build("qwen3_moe", tok, head_scale=1.0).float()
    engine_model = copy.deepcopy(base)
    wrapped, spec = _adapted(base)
    sd = lora.adapter_state(wrapped)
    k = next(k for k in sd if ".experts.lora_A" in k)
    merge = AdapterMerge(engine_model, spec)
    from relayrl.engine.base import EngineError

    with pytest.raises(EngineError, match="do not fit its weight"):
        merge.apply({**sd, k: sd[k][:-1]})
    with pytest.raises(EngineError, match="targets without an update"):
        merge.apply({n: t for n, t in sd.items() if ".experts." not in n})


def test_expert_adapters_train_under_replayed_routes(tok):
    """A trainer step on a wrapped qwen3_moe with r3: the experts' adapters and the attention's get gradients; the
    base's experts and routers stay frozen."""
    model = _moe("qwen3_moe", tok)
    trajs = _sampled(model, tok, rows=4)
    wrapped, _ = lora.wrap(model, LoraCfg(r=4, experts=True))
    batch = build_batch(trajs, torch.linspace(-1, 1, len(trajs)), tok.pad_token_id)
    tr = Trainer(wrapped, TrainerCfg(), AlgoCfg(routing_replay="r3", kl_coef=0), 1.0, 10, 16)
    before = {n: p.detach().clone() for n, p in wrapped.named_parameters() if p.requires_grad}
    m = tr.step(batch)
    assert "moe/routing_diff" in m and m["grad_norm"] > 0
    moved = {n for n, p in wrapped.named_parameters() if n in before and not torch.equal(p, before[n])}
    assert any(".experts.lora_B" in n for n in moved) and any("q_proj.lora_B" in n for n in moved)  # (B: A's gradient is 0 while B is)
    assert all("lora_" in n for n in before)  # (only adapters train)
    tr.close()


def test_expert_adapters_are_refused_where_they_cannot_run(tok):
    with pytest.raises(ModelError, match="no fused experts"):
        lora.wrap(build("llama", tok), LoraCfg(r=2, experts=True))
    with pytest.raises(ModelError, match="PEFT rewrites this model's MLP targets"):
        lora.wrap(build("deepseek_v3", tok), LoraCfg(r=2, experts=True))  # (all-linear: its dense MLPs' names)
    with pytest.raises(ModelError, match="dropout"):
        lora.wrap(build("qwen3_moe", tok), LoraCfg(r=2, experts=True, dropout=0.1))
    with pytest.raises(ValueError, match="model.lora.experts=true needs rollout.engine=hf or hf-cb"):
        load_config(None, ["model.lora.r=4", "model.lora.experts=true", "rollout.engine=vllm"])
    with pytest.raises(ValueError, match="trainer.fsdp"):
        load_config(None, ["model.lora.r=4", "model.lora.experts=true", "trainer.fsdp=true"])


@pytest.mark.slow
def test_a_run_trains_expert_adapters_its_engine_samples_them_and_peft_loads_the_checkpoint(tok, tmp_path):
    """``relayrl train model.lora.experts=true`` on a tiny qwen3_moe (float32 engine, r3): each step's engine samples
    the trained adapter (log-prob mismatch < 1e-3 after the adapters moved: an engine without the experts' merge
    is off by more); the checkpoint is PEFT's (target_parameters), PeftModel.from_pretrained gives the trainer's
    policy, and the run resumes."""
    from peft import PeftModel

    from relayrl.run.loop import train
    from tests.test_e2e import EASY

    path = tmp_path / "moe"
    _moe("qwen3_moe", tok).save_pretrained(path)
    tok.save_pretrained(path)
    args = [*EASY, f"model.path={path}", f"run.output_dir={tmp_path}", "run.steps=3", "run.name=x",
            "algo.routing_replay=r3", "model.lora.r=4", "model.lora.experts=true", "trainer.lr=2e-2"]
    train(load_config(None, args))
    run = tmp_path / "x"
    m = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(m) == 3 and all(x["logprob_mismatch_mean"] < 1e-3 for x in m), [x["logprob_mismatch_mean"] for x in m]
    ckpt = run / "checkpoints" / "step_000003"
    conf = json.loads((ckpt / "adapter_config.json").read_text())
    assert sorted(conf["target_parameters"]) == ["experts.down_proj", "experts.gate_up_proj"]
    from transformers import AutoModelForCausalLM

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), str(ckpt))
    x = torch.randint(3, 200, (1, 10))
    with torch.no_grad():
        moved = (peft_model(x).logits - AutoModelForCausalLM.from_pretrained(path)(x).logits).abs().max()
    assert moved > 1e-3  # (the experts' adapters trained and PEFT applies them)
    train(load_config(None, [*args[:-4], "run.steps=4", *args[-3:]]), resume=True)
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 4
