"""Agents that see: an environment's step (or a tool) returns an image, the episode's later turns carry it, and the
trained tokens are exactly the ones the engine sampled from; an image is placed by its whole span of tokens, so an
image token the policy sampled is never taken for one; the endpoint takes ``image_url`` data URLs."""

import asyncio
import gzip
import json
import random

import pytest
import torch

import relayrl
from relayrl.demo import vlm_demo
from relayrl.demo.vision_model import build_tiny_vlm
from relayrl.envs.chat import next_turn_suffix, render_ids
from relayrl.models import images, load_policy, load_tokenizer, vision
from relayrl.models.prompts import encode_prompt

SCREENS = '''
import random

from relayrl.demo import vlm_demo
from relayrl.envs.base import Env, StepResult


class Screens(Env):
    """Answer one question on the prompt's image, then one on a new screenshot the step returns."""

    def __init__(self):
        self.rng, self.turn = random.Random(), 0

    async def step(self, text):
        self.turn += 1
        if self.turn == 1:
            image, side, _, self.answer = vlm_demo.example(self.rng)
            return StepResult([{"role": "user", "content": [{"type": "image", "image": image},
                                                            {"type": "text", "text": f"And the {side} one here?"}]}])
        return StepResult(reward=float(text.strip() == str(self.answer)), done=True)
'''


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return str(build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "m", seed=1))


def _image(seed: int) -> str:
    return images.to_ref(vlm_demo.example(random.Random(seed))[0], None, "test")


def test_an_environments_screenshot_is_in_the_next_turns_context_and_trained_as_sampled(tmp_path):
    (tmp_path / "screens.py").write_text(SCREENS)
    run = relayrl.Run(model={"path": "builtin:vlm-demo"}, data={"path": "builtin:vlm-demo", "eval_path": None},
                      env={"name": f"{tmp_path / 'screens.py'}:Screens", "max_turns": 2, "max_tokens": 200},
                      run={"output_dir": str(tmp_path), "name": "s", "steps": 2, "progress": False},
                      rollout={"max_new_tokens": 4, "prompts_per_step": 2, "group_size": 2})
    assert run.train()["steps"] == 2
    rows = [json.loads(x) for x in (run.dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["logprob_mismatch_max"] < 1e-5 and r["logprob_mismatch_tokens"] > 0 for r in rows)
    records = [json.loads(x) for f in sorted(run.dir.glob("rollouts/*.jsonl.gz")) for x in gzip.open(f, "rt")]
    two = [r for r in records if r["info"]["turns"] == 2]
    assert two, "no episode reached the screenshot's turn"
    image = json.loads((vlm_demo.SHIPPED / "config.json").read_text())["image_token_id"]
    assert "And the" in two[0]["turns"][0]["env"] and image in two[0]["response_ids"]  # (the screenshot's tokens)


def test_an_image_is_placed_by_its_span_never_on_an_image_token_the_policy_sampled(vlm):
    tok, model = load_tokenizer(vlm, "chat"), load_policy(vlm)
    first, second = _image(1), _image(2)
    messages = images.attach([{"role": "user", "content": f"{images.IMAGE}which?"}], [first])
    prompt = render_ids(tok, messages, True)
    assert prompt == encode_prompt(tok, [{"role": "user", "content": f"{images.IMAGE}which?"}], "chat", (first,))
    sampled = [5, model.config.image_token_id, 7]  # (the policy sampled an image token in its turn)
    turn = tok.decode(sampled)
    new = [images.with_images({"role": "user", "content": [{"type": "image_url", "image_url": {"url": second}},
                                                          {"type": "text", "text": "and?"}]}, "step")]
    assert new[0]["content"] == f"{images.IMAGE}and?" and new[0]["images"] == [second]
    suffix = next_turn_suffix(tok, messages + [{"role": "assistant", "content": turn}], new)
    ids = torch.tensor([prompt + sampled + [tok.eos_token_id] + suffix])
    with torch.no_grad():
        emb = vision.embed(model, ids, [(first, second)])
        span = vision.span(vision.processor_of(model), second)
        at = len(prompt) + len(sampled) + 1 + vision.find(suffix, span, 0)
        where = [at + k for k, x in enumerate(span) if x == model.config.image_token_id]
        torch.testing.assert_close(emb[0, where], vision.features(model, second))
        token = model.get_input_embeddings().weight[model.config.image_token_id]
        assert torch.equal(emb[0, len(prompt) + 1], token)  # the sampled one: a token, as the engine fed it
        with pytest.raises(vision.VisionError, match="not in its ids"):  # a context cut through its image
            vision.embed(model, ids[:, : where[3]], [(first, second)])


def test_a_clients_image_url_parts_are_the_episodes_images_turn_after_turn(vlm):
    """An OpenAI-SDK agent's requests (``image_url`` data URLs) extend one branch, its images in its context."""
    from types import SimpleNamespace

    from relayrl.records import Trajectory, context_images
    from relayrl.rollout.runner import EpisodeRunner
    from relayrl.serve.openai_format import canonical
    from relayrl.serve.sessions import Session, SessionTable
    from tests.test_episodes import PROMPT

    tok, model = load_tokenizer(vlm, "chat"), load_policy(vlm)
    runner = SimpleNamespace(tokenizer=tok, append=EpisodeRunner.append, engine=SimpleNamespace(version=0))
    s = Session("k", runner, Trajectory(PROMPT, "g", 0, []), None, True, 8, 4000, None, SessionTable())
    first, second = _image(1), _image(2)

    def user(ref, text):
        return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": ref}}, {"type": "text", "text": text}]}

    conv = canonical([user(first, "which?")])
    b, _ = s.chat_branch(conv, None)
    t = b.traj
    assert t.images == [first] and vision.find(t.prompt_ids, vision.span(vision.processor_of(tok), first), 0) is not None
    turn = tok("7", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    EpisodeRunner.append(t, turn, [0.0] * len(turn), [0] * len(turn), 1, 0)
    b.messages.append({"role": "assistant", "content": "7"})
    b.view, b.busy, b.turn = conv + canonical([{"role": "assistant", "content": "7"}]), False, 1
    again, _ = s.chat_branch(b.view + canonical([user(second, "and this?")]), None)
    assert again is b and context_images(t) == (first, second)
    with torch.no_grad():  # (both images found, by their spans, in the context the engine and the trainer feed)
        vision.embed(model, torch.tensor([t.prompt_ids + t.response_ids]), [context_images(t)])
    other, _ = s.chat_branch(conv[:0] + canonical([user(second, "which?")]), None)  # (another image: a new branch)
    assert other is not b and other.traj.images == [second]


def test_a_tool_that_returns_a_screenshot_returns_an_image_the_next_turn_sees(vlm):
    from relayrl.envs.base import ToolEnv

    shot = vlm_demo.example(random.Random(5))[0]

    def screenshot() -> object:
        """Take a screenshot."""
        return shot

    result = asyncio.run(ToolEnv([screenshot]).step('<tool_call>{"name": "screenshot", "arguments": {}}</tool_call>'))
    (message,) = [images.with_images(m, "tool") for m in result.messages]
    assert message["role"] == "tool" and message["content"] == images.IMAGE and len(message["images"]) == 1
    tok = load_tokenizer(vlm, "chat")
    suffix = next_turn_suffix(tok, [{"role": "user", "content": "look"}, {"role": "assistant", "content": "ok"}],
                              [message])
    assert vision.find(suffix, vision.span(vision.processor_of(tok), message["images"][0]), 0) is not None
