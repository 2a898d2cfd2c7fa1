"""The model-family conformance suite: for every family of ``tests/families.py`` (tiny random models built from
their configs), the trainer's numbers under each memory feature equal the plain forward's, and the engine's
log-probs of its own samples equal the trainer's. docs/reference/families.md is the table these cells make."""

import copy

import pytest
import torch

from relayrl.config import AlgoCfg, TrainerCfg
from relayrl.demo import model as demo_model
from relayrl.train.head_transform import LogitMap, probe
from relayrl.train.trainer import Trainer
from tests.families import FAMILIES, build
from tests.test_shared_prefix import _groups

SCALED = {"granite": LogitMap(0.25), "granitemoe": LogitMap(0.25), "cohere2": LogitMap(0.25),
          "falcon_h1": LogitMap(0.5), "gemma2": LogitMap(1.0, 3.0), "gemma3": LogitMap(1.0, 5.0)}


@pytest.fixture(scope="module")
def tok():
    return demo_model.build_tokenizer(demo_model.RECIPE["seed"], 300)


def _trainer(model, **trainer):
    cfg = TrainerCfg(**{"micro_batch_tokens": 64, "share_prefix": False, **trainer})
    return Trainer(model, cfg, AlgoCfg(kl_coef=0.1, entropy_coef=0.01), 0.8, 10, 16, top_k=40, top_p=0.95)


def _pass(model, batch, **trainer):
    """(π_old log-probs, the loss's sums, the gradient) of one accumulate with ``trainer`` settings."""
    tr = _trainer(model, **trainer)
    old = tr.logprobs(batch)
    ref = tr.logprobs(batch, tr.ref)
    model.zero_grad()
    model.train()
    sums = tr.accumulate(batch, old + 0.05 * batch.loss_mask, ref, batch.loss_mask.sum().item(), batch.size)
    return old, sums, [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_map_after_the_head_is_found_from_the_model(family, tok):
    assert probe(build(family, tok)) == SCALED.get(family, LogitMap())


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_head_equals_whole_logits(family, tok):
    """The chunked LM head (the default, trainer.logprob_chunk_tokens) against whole logits: log-probs,
    entropy, loss and every gradient, on families that scale or softcap their logits after the head too."""
    model = build(family, tok)
    batch = _groups(tok)
    (o0, s0, g0), (o1, s1, g1) = (_pass(copy.deepcopy(model), batch, logprob_chunk_tokens=c) for c in (0, 7))
    assert o0.abs().max() > 1.0  # (logits large enough that a missed map would show)
    torch.testing.assert_close(o1, o0, atol=1e-5, rtol=1e-4)
    for k in ("loss", "kl", "entropy"):
        assert s1[k] == pytest.approx(s0[k], rel=1e-4, abs=1e-6), k
    assert sum(g.abs().sum() for g in g1) > 0
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_head_under_bf16_equals_whole_logits(family, tok):
    """trainer.bf16 (the float32 head under bfloat16 autocast): chunked against whole logits, Gemma's softcap
    included (it was refused under bf16 even with whole logits)."""
    model = build(family, tok)
    batch = _groups(tok)
    out = []
    for c in (0, 7):
        with torch.autocast("cpu", torch.bfloat16):
            out.append(_pass(copy.deepcopy(model), batch, logprob_chunk_tokens=c, bf16=True))
    (o0, s0, g0), (o1, s1, g1) = out
    torch.testing.assert_close(o1, o0, atol=2e-3, rtol=1e-2)
    assert s1["loss"] == pytest.approx(s0["loss"], rel=1e-2, abs=2e-3)
    a, b = torch.cat([g.flatten() for g in g0]), torch.cat([g.flatten() for g in g1])
    assert (b - a).norm() <= 1e-2 * a.norm()  # (bfloat16's rounding: the whole gradient, not each element)


def _hooked(tok, hook):
    model = build("llama", tok)
    model.register_forward_hook(hook)
    return model


def _set_logits(fn):
    def hook(module, args, out):
        out.logits = fn(module, out.logits)
        return out
    return hook


@pytest.mark.parametrize("fn, why", [
    (lambda m, x: x + 0.01 * x * x, "is not a scale or a softcap"),
    (lambda m, x: x * torch.arange(1, x.shape[1] + 1, dtype=x.dtype)[:, None], "is not a scale or a softcap"),
    (lambda m, x: x * m.model.norm.weight[0], "depends on trainable parameters"),
    (lambda m, x: x[..., :-3], "changes the logits' shape"),
])
def test_a_map_it_cannot_reproduce_is_refused_in_one_line(tok, fn, why):
    from relayrl.models import ModelError

    model = _hooked(tok, _set_logits(fn))
    with pytest.raises(ModelError, match=why) as e:
        _trainer(model, logprob_chunk_tokens=7)
    assert "set trainer.logprob_chunk_tokens=0" in str(e.value) and "\n" not in str(e.value)
    _trainer(_hooked(tok, _set_logits(fn)), logprob_chunk_tokens=0)  # (whole logits: the model's own)


def test_a_teacher_whose_head_map_it_cannot_reproduce_is_refused_without_the_trainers_advice(tok, monkeypatch):
    from relayrl.models import ModelError
    from relayrl.rewards.teachers import LocalTeacher
    from relayrl.train import lora

    monkeypatch.setattr(lora, "load_model", lambda *a, **k: _hooked(tok, _set_logits(lambda m, x: x + 0.01 * x * x)))
    with pytest.raises(ModelError, match=r"teacher.path=t: .*is not a scale or a softcap\); a teacher's log-probs") as e:
        LocalTeacher("t", "teacher.path", device="cpu")
    assert "logprob_chunk_tokens" not in str(e.value) and "\n" not in str(e.value)


def test_the_start_up_check_refuses_a_head_that_is_not_reproduced(tok, monkeypatch):
    """Belt and braces: should the probe find a wrong map, the first comparison with the model's own logits
    refuses the chunked head (never wrong numbers)."""
    from relayrl.models import ModelError
    from relayrl.train import logprobs

    monkeypatch.setattr(logprobs, "probe", lambda model: LogitMap(1.0))
    with pytest.raises(ModelError, match="chunked head's log-probs differ from GraniteForCausalLM's own"):
        _trainer(build("granite", tok), logprob_chunk_tokens=7)


# -- the engine's log-probs of its own samples, every memory feature, LoRA, checkpoints -------------------

T, TOP_K, TOP_P = 0.8, 40, 0.95


def _sampled_batch(model, tok, fast_decode=True, adapter=None, adapter_state=None):
    """Groups of the hf engine's own samples of ``model`` (its decoding forward where it supports the family,
    else the model's), as a training batch with the engine's behaviour log-probs."""
    from relayrl.engine.hf import HFEngine
    from relayrl.records import FinishReason, GenRequest, Prompt, SamplingParams, Trajectory
    from relayrl.train.batch import build_batch

    eng = HFEngine(copy.deepcopy(model), tok, fast_decode=fast_decode, adapter=adapter)
    if adapter_state is not None:
        eng.load_weights(adapter_state, 1)
    trajs, group = [], []
    try:
        prompts = ["Sum mod 10: a=3 b=4 c=5", "Add 1 2", "x"]
        reqs = []
        for k, text in enumerate(prompts):
            ids = list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)["input_ids"])
            reqs += [GenRequest(f"g{k}/{i}", ids, SamplingParams(12, T, TOP_P, TOP_K, seed=7 * k + i)) for i in range(3)]
        for r, c in zip(reqs, eng.generate(reqs)):
            k = int(r.request_id[1])
            trajs.append(Trajectory(Prompt(f"p{k}", [], "3"), f"g{k}", 0, r.prompt_ids, c.token_ids, c.logprobs,
                                    c.versions, FinishReason.STOP))
            group.append(k)
    finally:
        eng.close()
    g = torch.Generator().manual_seed(1)
    return build_batch(trajs, torch.randn(len(trajs), generator=g), tok.pad_token_id, group=torch.tensor(group))


def _reader(model, **trainer):
    cfg = TrainerCfg(**{"micro_batch_tokens": 64, **trainer})
    return Trainer(model, cfg, AlgoCfg(kl_coef=0.0), T, 10, 16, top_k=TOP_K, top_p=TOP_P)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_engine_samples_with_the_log_probs_the_trainer_reads(family, tok):
    """The hf engine's behaviour log-probs of its own samples (T=0.8, top-k 40, top-p 0.95) are the trainer's,
    with the trainer's defaults (chunked head, shared prefixes)."""
    model = build(family, tok)
    batch = _sampled_batch(model, tok)
    trained = _reader(copy.deepcopy(model)).logprobs(batch)
    m = batch.loss_mask.bool()
    assert m.sum() > 10
    torch.testing.assert_close(trained[m], batch.behav_logp[m], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_engines_cache_keeps_the_rows_it_selects(family, tok):
    """Rows that finish or are aborted leave the engine's batch (``models.select_rows``): the next token's logits
    of the rows kept equal a fresh forward's, for attention caches and for hybrids' recurrent states (Qwen3-Next's
    and Qwen3.5's Gated DeltaNet, Nemotron-H's Mamba-2: their cache layers had no row selection at all)."""
    from relayrl.models import select_rows

    model = build(family, tok)
    ids = torch.randint(0, len(tok) - 20, (3, 7), generator=torch.Generator().manual_seed(1))
    nxt = torch.randint(0, len(tok) - 20, (2, 1), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
        select_rows(cache, torch.tensor([0, 2]), 3)
        kept = model(input_ids=nxt, past_key_values=cache, use_cache=True).logits[:, -1]
        fresh = model(input_ids=torch.cat([ids[[0, 2]], nxt], 1)).logits[:, -1]
    torch.testing.assert_close(kept, fresh, atol=1e-4, rtol=1e-4)


FEATURES = {
    "checkpointing": {"gradient_checkpointing": "on"},
    "packing": {"pack": True, "share_prefix": False},
    "shared prefixes": {"share_prefix": True},
    "all": {"gradient_checkpointing": "on", "pack": True, "share_prefix": False, "logprob_chunk_tokens": 5},
}


# what a family cannot do, found from the model when the trainer starts (one line), or switched off with a line
PACKING_REFUSED = {"falcon_h1": "a recurrent state", "gpt_oss": "attention sinks", "qwen3_next": "a recurrent state",
                   "qwen3_5": "a recurrent state", "nemotron_h": "a recurrent state"}
LORA_REFUSED = {"deepseek_v3": ("mixture of experts' fused weights", ["q_a_proj", "kv_a_proj_with_mqa", "o_proj"]),
                "qwen3_next": ("mixture of experts' fused weights", ["q_proj", "k_proj", "v_proj", "o_proj"])}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_memory_feature_gives_the_plain_forward_s_numbers(family, tok):
    """π_old, the loss and every gradient under checkpointing, packing, shared prefixes (and all of them with a
    chunked head) against the plain forward (whole logits, no feature); packing refused in one line where the
    model's packed rows are not its padded ones."""
    from relayrl.models import ModelError

    model = build(family, tok)
    batch = _groups(tok)
    plain = _pass(copy.deepcopy(model), batch, logprob_chunk_tokens=0)
    for name, feature in FEATURES.items():
        if feature.get("pack") and family in PACKING_REFUSED:
            with pytest.raises(ModelError, match="trainer.pack: .* differ from its padded rows'.*set trainer.pack=false"):
                _pass(copy.deepcopy(model), batch, **feature)
            continue
        o, s, g = _pass(copy.deepcopy(model), batch, **{"logprob_chunk_tokens": 0, **feature})
        torch.testing.assert_close(o, plain[0], atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
        assert s["loss"] == pytest.approx(plain[1]["loss"], rel=1e-4, abs=1e-6), name
        for a, b in zip(plain[2], g):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_step_trains_and_the_checkpoint_loads(family, tok, tmp_path):
    from transformers import AutoModelForCausalLM

    model = build(family, tok)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _reader(model, lr=1e-2, warmup_steps=0).step(_groups(tok))
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert len(changed) >= len(before) // 2
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, len(tok), (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model.eval()(input_ids=ids).logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_the_engine_samples_the_adapted_policy_and_its_merge_is_peft_s(family, tok):
    """An all-linear adapter (B made non-zero): the engine's merged weights are PEFT's merge_and_unload, and its
    samples' log-probs are the trainer's through PEFT's wrapper."""
    from relayrl.config import LoraCfg
    from relayrl.engine.adapter import AdapterMerge
    from relayrl.train import lora

    from relayrl.models import ModelError

    base = build(family, tok)
    torch.manual_seed(3)
    if family in LORA_REFUSED:
        why, targets = LORA_REFUSED[family]
        with pytest.raises(ModelError, match=why):
            lora.wrap(copy.deepcopy(base), LoraCfg(r=4))
        policy, spec = lora.wrap(copy.deepcopy(base), LoraCfg(r=4, targets=targets))
    else:
        policy, spec = lora.wrap(copy.deepcopy(base), LoraCfg(r=4))
    # only the adapter trains (Falcon-H1's and Nemotron-H's all-linear wrap, retried without the Mamba layers PEFT
    # refuses, left every base weight trainable: the trainer moved weights the engines never got)
    assert [n for n, p in policy.named_parameters() if p.requires_grad and "lora_" not in n] == []
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    state = lora.adapter_state(policy)
    engine_model = copy.deepcopy(base)
    merge = AdapterMerge(engine_model, spec)
    merge.apply(state)
    merged = copy.deepcopy(policy).merge_and_unload()
    for (k, a), b in zip(merged.state_dict().items(), engine_model.state_dict().values()):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5, msg=lambda m: f"{k}: {m}")
    batch = _sampled_batch(merged, tok)
    trained = _reader(policy).logprobs(batch)
    m = batch.loss_mask.bool()
    torch.testing.assert_close(trained[m], batch.behav_logp[m], atol=2e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("family, lora", [("qwen3_next", 0), ("qwen3_5", 0), ("nemotron_h", 0), ("qwen3_5", 8),
                                          ("qwen3_next", 8), ("nemotron_h", 8)])
def test_a_hybrid_linear_attention_model_trains_two_steps_by_default(family, lora, tok, tmp_path):
    """Qwen3-Next, Qwen3.5 and Nemotron-H as a user brings them (a from_pretrained folder): `relayrl train` with the
    defaults runs 2 steps (the engine's cache of their recurrent states, shared prefixes switched off with a line,
    the sampling alarm quiet); an adapter where PEFT can put one, refused in one line where it cannot."""
    from relayrl.models import ModelError
    from relayrl.run.api import Run

    model = build(family, tok, head_scale=1.0)
    tok.chat_template = demo_model.build_tokenizer(demo_model.RECIPE["seed"], 300).chat_template
    model.save_pretrained(tmp_path / family)
    tok.save_pretrained(tmp_path / family)
    run = Run(model={"path": str(tmp_path / family), "lora": {"r": lora}},
              run={"steps": 2, "output_dir": str(tmp_path / "runs"), "progress": False, "name": "r"},
              rollout={"max_new_tokens": 16, "prompts_per_step": 2, "group_size": 4}, eval={"size": 4})
    if family in LORA_REFUSED and lora:
        with pytest.raises(ModelError, match=LORA_REFUSED[family][0]):
            run.train()
        return
    summary = run.train()
    assert summary["steps"] == 2 and summary["eval_accuracy_after"] is not None
