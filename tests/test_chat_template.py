"""Token-in, token-out conformance per chat template: a conversation built turn by turn from the
engine's own tokens plus template suffixes equals what the template renders for the whole
conversation; a template that re-renders earlier turns fails closed."""

import contextlib
import threading
import time

import pytest

from relayrl.engine.base import Engine
from relayrl.envs.base import Env, StepResult
from relayrl.envs.chat import TemplateMismatch, next_turn_suffix, render_ids
from relayrl.rollout.runner import EpisodeLimits, EpisodeRunner
from relayrl.records import Completion, FinishReason, Prompt, SamplingParams, Trajectory

CHATML = (  # Qwen2.5's shape: every turn ends "<|im_end|>\n", tool results go in a user turn
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'tool' -%}"
    "{{ '<|im_start|>user\n<tool_response>\n' + m['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)
# renders an earlier assistant turn without its content once a later one exists (as templates that
# drop earlier reasoning do)
FORGETFUL = CHATML.replace("'\n' + m['content'] + '<|im_end|>", "'\n' + (m['content'] if m['role'] != 'assistant' "
                                                                 "or loop.last else '') + '<|im_end|>")
assert FORGETFUL != CHATML


@pytest.fixture()
def demo_tokenizer(tiny):
    return tiny[1]


@pytest.fixture()
def chatml_tokenizer(tiny_path):
    from relayrl.models import load_tokenizer

    tok = load_tokenizer(tiny_path)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    tok.eos_token = "<|im_end|>"
    return tok


def _engine_turn(tok, history, reply) -> list[int]:
    """What an engine emits for ``reply``: the template's tokens for the assistant turn, up to and
    including the end-of-turn token (where generation stops; a separator after it is not emitted)."""
    start = len(render_ids(tok, history, add_generation_prompt=True))
    turn = render_ids(tok, history + [{"role": "assistant", "content": reply}], add_generation_prompt=False)[start:]
    return turn[: turn.index(tok.eos_token_id) + 1]


CONVERSATION = [
    [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "a=3 b=4 c=5"}],
    ("call add(3, 4)", [{"role": "tool", "content": "7"}]),
    ("call add(7, 5)", [{"role": "tool", "content": "12"}, {"role": "user", "content": "mod 10?"}]),
    ("\\boxed{2}", []),
]


@pytest.mark.parametrize("template", ["demo", "chatml"])
def test_turns_concatenate_to_the_template_rendering(template, demo_tokenizer, chatml_tokenizer):
    tok = demo_tokenizer if template == "demo" else chatml_tokenizer
    observe = "tool" if template == "chatml" else "user"  # the demo template has no tool role
    messages = list(CONVERSATION[0])
    context = render_ids(tok, messages, add_generation_prompt=True)
    masks = [0] * len(context)
    for reply, new in CONVERSATION[1:]:
        engine = _engine_turn(tok, messages, reply)
        context, masks = context + engine, masks + [1] * len(engine)
        messages = messages + [{"role": "assistant", "content": reply}]
        new = [{**m, "role": observe if m["role"] == "tool" else m["role"]} for m in new]
        if not new:
            break
        suffix = next_turn_suffix(tok, messages, new)
        assert suffix, "a new turn always adds tokens"
        context, masks, messages = context + suffix, masks + [0] * len(suffix), messages + new
    full = render_ids(tok, messages, add_generation_prompt=False)
    assert context == full[: len(context)] and len(full) - len(context) <= 1  # at most the separator after the end
    assert sum(masks) == sum(len(_engine_turn(tok, messages[: i], m["content"])) for i, m in enumerate(messages)
                             if m["role"] == "assistant")
    if template == "chatml":  # the "\n" after <|im_end|> the engine never emits is a template token
        first_suffix = next_turn_suffix(tok, CONVERSATION[0] + [{"role": "assistant", "content": "call add(3, 4)"}],
                                        [{"role": "tool", "content": "7"}])
        assert tok.decode(first_suffix).startswith("\n<|im_start|>user")


class TurnsEngine(Engine):
    """Answers the i-th request with ``turns[i]`` (token ids, the end-of-turn token included), whole."""

    def __init__(self, turns: list[list[int]]):
        self.turns, self.live, self.lock = list(turns), {}, threading.Lock()

    @property
    def version(self):
        return 0

    def submit(self, requests):
        with self.lock:
            for r in requests:
                self.live[r.request_id] = self.turns.pop(0)

    def get(self, timeout=None):
        time.sleep(0.001)
        with self.lock:
            live, self.live = self.live, {}
        return [Completion(rid, ids, [-0.1] * len(ids), [0] * len(ids), FinishReason.STOP) for rid, ids in live.items()]

    def abort(self, ids):
        pass

    @contextlib.contextmanager
    def pause(self):
        yield

    def load_weights(self, state_dict, version):
        pass

    def num_pending(self):
        return len(self.live)


@pytest.mark.parametrize("template", ["demo", "chatml"])
def test_the_suffix_does_not_depend_on_how_the_engine_spelled_its_turn(template, demo_tokenizer, chatml_tokenizer):
    """A policy may emit its turn in other tokens than the tokenizer's own (BPE pieces one by one):
    the suffix comes from the template alone, so the context stays the engine's tokens + suffix.
    The spelled turn goes through a real episode; the expected context is the template's rendering
    of the whole conversation with that turn's canonical tokens swapped for the spelled ones."""
    tok = demo_tokenizer if template == "demo" else chatml_tokenizer
    observe = "tool" if template == "chatml" else "user"
    reply, answer = "call add(3, 4)", "\\boxed{7}"
    canonical = tok(reply, add_special_tokens=False)["input_ids"]
    spelled = [i for ch in reply for i in tok(ch, add_special_tokens=False)["input_ids"]]
    assert spelled != canonical and tok.decode(spelled) == tok.decode(canonical) == reply
    eos = tok.eos_token_id

    class Calc(Env):
        async def reset(self, prompt):
            return list(CONVERSATION[0])

        async def step(self, text):
            if text == reply:
                return StepResult([{"role": observe, "content": "7"}])
            return StepResult(reward=float(text == answer), done=True)

    engine = TurnsEngine([spelled + [eos], tok(answer, add_special_tokens=False)["input_ids"] + [eos]])
    runner = EpisodeRunner(engine, tok, Calc, EpisodeLimits(4, 4000), lambda text, p: (0.0, False))
    try:
        t = Trajectory(Prompt("p", []), "g", 0, [])
        runner.run(runner.episode(t, SamplingParams(100)))
    finally:
        runner.close()
    assert t.reward == 1.0 and t.info["turns"] == 2, t.info

    prompt = render_ids(tok, CONVERSATION[0], add_generation_prompt=True)
    full = render_ids(tok, CONVERSATION[0] + [{"role": "assistant", "content": reply}, {"role": observe, "content": "7"},
                                              {"role": "assistant", "content": answer}], add_generation_prompt=False)
    assert full[: len(prompt) + len(canonical)] == prompt + canonical  # the rendering spells the turn canonically
    expected = prompt + spelled + full[len(prompt) + len(canonical):]
    context = t.prompt_ids + t.response_ids
    assert context[-1] == eos and context == expected[: len(context)] and len(expected) - len(context) <= 1
    assert t.response_ids[: len(spelled) + 1] == spelled + [eos] and t.mask[: len(spelled) + 1] == [1] * (len(spelled) + 1)


def test_a_template_that_re_renders_earlier_turns_fails_closed(chatml_tokenizer):
    tok = chatml_tokenizer
    messages = list(CONVERSATION[0]) + [{"role": "assistant", "content": "call add(3, 4)"}]
    assert next_turn_suffix(tok, messages, [{"role": "tool", "content": "7"}])  # consistent template: fine
    tok.chat_template = FORGETFUL
    later = messages + [{"role": "tool", "content": "7"}, {"role": "assistant", "content": "x"}]
    with pytest.raises(TemplateMismatch, match="first difference at token"):
        next_turn_suffix(tok, later, [{"role": "user", "content": "y"}])


def test_a_template_without_the_end_of_turn_token_fails_closed(chatml_tokenizer):
    tok = chatml_tokenizer
    tok.chat_template = CHATML.replace("'<|im_end|>\n'", "'\n'")
    with pytest.raises(TemplateMismatch, match="end-of-turn token"):
        next_turn_suffix(tok, CONVERSATION[0] + [{"role": "assistant", "content": "hi"}], [{"role": "user", "content": "y"}])
