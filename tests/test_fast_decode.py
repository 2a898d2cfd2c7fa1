"""relayrl's decoding forward (rollout.fast_decode): the model's logits, for every supported family."""

import pytest
import torch
import transformers

from relayrl.engine import fast_decode
from relayrl.engine.fast_decode import FastDecoder, check, fast_decoder, unsupported
from relayrl.engine.hf import HFEngine
from relayrl.records import GenRequest, SamplingParams

SMALL = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=256)


def _model(kind: str, **kw):
    torch.manual_seed(0)
    configs = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
               "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}
    return transformers.AutoModelForCausalLM.from_config(configs[kind](**{**SMALL, **kw})).eval()


@pytest.mark.parametrize("kind, kw", [
    ("llama", {"num_key_value_heads": 4}),
    ("llama", {"num_key_value_heads": 2, "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0,
               "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}}),  # grouped-query attention, llama3 RoPE
    ("mistral", {"num_key_value_heads": 2, "sliding_window": None}),
    ("qwen2", {"num_key_value_heads": 2}),  # q/k/v biases
    ("qwen3", {"num_key_value_heads": 2, "head_dim": 16}),  # q/k norms, a head size of its own
])
def test_logits_equal_the_models_for_each_family(kind, kw):
    model = _model(kind, **kw)
    assert unsupported(model) is None
    decoder = FastDecoder(model)
    assert check(decoder, atol=1e-5) is None
    # a longer run: left padding, G equal rows (prefilled once), the cache growing from 1 column of room
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (5, 9)]
    rows = [prompts[0]] * 3 + [prompts[1]] * 2
    n = max(map(len, rows))
    ids = torch.tensor([[0] * (n - len(r)) + r for r in rows])
    att = torch.tensor([[0] * (n - len(r)) + [1] * len(r) for r in rows])
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    logits, cache = decoder.prefill(ids, att, pos, n + 1)
    tokens = torch.randint(0, 97, (len(rows), 70), generator=g)
    full = torch.cat([ids, tokens], 1)
    full_att = torch.cat([att, torch.ones_like(tokens)], 1)
    with torch.no_grad():
        want = model(input_ids=full, attention_mask=full_att,
                     position_ids=(full_att.cumsum(-1) - 1).clamp(min=0)).logits[:, n - 1 :]
    got, rows_now = [logits], list(range(len(rows)))  # (rows_now[j]: the original row that row j holds)
    for t in range(70):
        if t in (30, 50):  # rows finish: an unpadded row moves into a padded row's slot, then back down
            order = cache.keep([0, 3, 4] if t == 30 else [1, 2])
            assert sorted(order) == ([0, 3, 4] if t == 30 else [1, 2])
            torch.testing.assert_close(torch.stack(got, 1), want[rows_now, : t + 1], atol=2e-5, rtol=1e-4)
            rows_now, got = [rows_now[i] for i in order], [x[order] for x in got]
        r = torch.tensor(rows_now)
        got.append(decoder.decode(tokens[r, t], pos[r, -1] + t + 1, cache))
    assert rows_now == [4, 3]
    torch.testing.assert_close(torch.stack(got, 1), want[rows_now], atol=2e-5, rtol=1e-4)


def test_what_it_does_not_decode():
    assert "sliding-window" in unsupported(_model("mistral", num_key_value_heads=2, sliding_window=16))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    assert "gpt2" in unsupported(gpt2)
    assert fast_decoder(gpt2) is None
    odd = _model("llama")
    odd.model.layers[0].self_attn.q_proj.bias = torch.nn.Parameter(torch.zeros(32))  # q biased, k and v not
    assert "bias" in unsupported(odd)


def test_a_model_it_does_not_reproduce_decodes_through_its_own_forward(monkeypatch):
    model = _model("llama")
    real = FastDecoder._norm
    monkeypatch.setattr(FastDecoder, "_norm", staticmethod(lambda norm, x: real(norm, x) * 1.5))
    with pytest.warns(UserWarning, match="rollout.fast_decode: decoding through the model's own forward"):
        assert fast_decoder(model) is None


def _requests(tok, n, temp):
    msgs = [[{"role": "user", "content": f"Add {a} {b}"}] for a, b in ((3, 4), (12, 9), (1, 100))]
    ids = [tok.apply_chat_template(m, add_generation_prompt=True)["input_ids"] for m in msgs]
    return [GenRequest(f"r{i}-{j}", list(ids[i]), SamplingParams(n, temp)) for i in range(3) for j in range(4)]


@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_the_engine_samples_what_it_sampled_with_the_models_forward(tiny, temp):
    """Same seed, same tokens: the forwards agree closely enough that sampling does not tell them apart."""
    model, tok = tiny
    out = {}
    for fast in (False, True):
        eng = HFEngine(model, tok, fast_decode=fast)
        assert (eng._fast is not None) == fast
        torch.manual_seed(5)
        out[fast] = [(c.token_ids, c.finish_reason) for c in eng.generate(_requests(tok, 40, temp))]
        eng.close()
    assert out[True] == out[False]


def test_new_weights_reach_the_fused_projections(tiny):
    """The fused q/k/v and gate/up weights are the modules' own storage: load_weights updates them."""
    model, tok = tiny
    from relayrl.models import load_policy

    other = load_policy(model.name_or_path)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.5 * torch.randn_like(p))
    greedy = {}
    for fast in (False, True):
        eng = HFEngine(load_policy(model.name_or_path), tok, fast_decode=fast)
        eng.load_weights(other.state_dict(), 1)
        greedy[fast] = [c.token_ids for c in eng.generate(_requests(tok, 24, 0.0))]
        eng.close()
    assert greedy[True] == greedy[False]


def test_the_config_switch(tiny_path):
    from relayrl.config import ConfigError, load_config
    from relayrl.models import load_tokenizer
    from relayrl.engine.spec import build_local_engine, engine_spec

    for on in (True, False):
        cfg = load_config(None, [f"model.path={tiny_path}", f"rollout.fast_decode={str(on).lower()}"])
        eng = build_local_engine(engine_spec(cfg.rollout, cfg.model.dtype, tiny_path, tiny_path, 0, 0, 0), tokenizer=load_tokenizer(tiny_path))
        assert (eng._fast is not None) == on
        eng.close()
    with pytest.raises(ConfigError, match="rollout.fast_decode"):
        load_config(None, [f"model.path={tiny_path}", "rollout.engine=hf-cb", "rollout.fast_decode=false"])
    assert fast_decode.SUPPORTED == ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral")
