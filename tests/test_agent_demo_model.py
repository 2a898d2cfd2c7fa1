"""The agent demo: the calculator tool, the chat template with a tool role, the shipped weights
and the built-in datasets."""

import json

import pytest

from relayrl.demo import agent_task
from relayrl.demo.agent_model import CHAT_TEMPLATE, RECIPE, SHIPPED, agent_demo_model_path
from relayrl.demo.agent_task import calculator


@pytest.mark.parametrize("expression, result", [
    ("47*86", "4042"),
    (" 11 * 99 ", "1089"),
    ("(2+3)*4", "20"),
    ("7 - 10", "-3"),
    ("-(3)", "-3"),
    ("10/4", "2.5"),
    ("10/2", "5"),  # an integral float prints without ".0"
    ("7//2", "3"),
    ("-7 % 3", "2"),
    ("2**10", "1024"),
    ("2**-1", "0.5"),
    ("1.5*2", "3"),
    ("0.25+0.5", "0.75"),
])
def test_calculator_computes(expression, result):
    assert calculator(expression) == result


@pytest.mark.parametrize("expression, message", [
    ("", "empty expression"),
    ("1+", "invalid expression '1\\+'"),
    ("x + 1", "unsupported names"),
    ("abs(-3)", "unsupported function calls"),
    ("(1).real", "unsupported attributes"),
    ("__import__('os')", "unsupported function calls"),
    ("'a' * 3", "unsupported value 'a'"),
    ("True + 1", "unsupported value True"),
    ("[1, 2]", "unsupported syntax List"),
    ("1 < 2", "unsupported syntax Compare"),
    ("1/0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("9**9**9", "result too large"),
    ("10**5000", "result too large"),
    ("2.0**5000", "result too large"),
    ("(-8)**0.5", "not a real number"),
    ("1" * 2000, "expression too long"),
])
def test_calculator_rejects(expression, message):
    with pytest.raises(ValueError, match=message):
        calculator(expression)


def test_calculator_schema():
    from transformers.utils import get_json_schema

    fn = get_json_schema(calculator)["function"]
    assert fn["name"] == "calculator"
    assert fn["parameters"]["required"] == ["expression"]
    assert fn["parameters"]["properties"]["expression"]["type"] == "string"
    assert fn["parameters"]["properties"]["expression"]["description"]


def test_reference_episode_is_a_parsable_call():
    from relayrl.envs.tools import parse_tool_calls

    user, call, tool, answer = agent_task.episode(47, 86, use_tool=True)
    assert user["content"] == "Compute 47*86."
    assert call["content"] == '<tool_call>{"name": "calculator", "arguments": {"expression": "47*86"}}</tool_call>'
    (parsed,) = parse_tool_calls(call["content"])
    assert parsed.error is None and parsed.name == "calculator"
    assert calculator(**parsed.arguments) == tool["content"] == "4042"
    assert answer["content"] == "\\boxed{4042}"
    assert [m["role"] for m in agent_task.episode(47, 86, use_tool=False)] == ["user", "assistant"]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SHIPPED)


def _render(tok, messages, gen):
    return tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)


def test_template_renders_roles(tokenizer):
    assert tokenizer.chat_template == CHAT_TEMPLATE
    messages = [{"role": "system", "content": "S"}] + agent_task.episode(47, 86, use_tool=True)
    assert _render(tokenizer, messages, False) == (
        '<|system|>S<|user|>Compute 47*86.<|assistant|><tool_call>{"name": "calculator", "arguments": '
        '{"expression": "47*86"}}</tool_call><|end|><|tool|>4042<|assistant|>\\boxed{4042}<|end|>')
    assert _render(tokenizer, messages[:3], True).endswith("<|end|><|assistant|>")
    assert _render(tokenizer, messages[:4], True).endswith("<|end|><|tool|>4042<|assistant|>")
    # the template ignores tools= (a model this small cannot read a schema)
    with_tools = tokenizer.apply_chat_template(messages, tools=[calculator], tokenize=False)
    assert with_tools == _render(tokenizer, messages, False)


def test_template_renders_earlier_turns_identically(tokenizer):
    from relayrl.envs.chat import render_ids

    messages = agent_task.episode(47, 86, use_tool=True) + [{"role": "user", "content": "again?"},
                                                            {"role": "assistant", "content": "\\boxed{1}"}]
    for k in range(1, len(messages)):
        for gen in (False, True):
            shorter = render_ids(tokenizer, messages[:k], add_generation_prompt=gen)
            longer = render_ids(tokenizer, messages[: k + 1], add_generation_prompt=False)
            if gen and messages[k]["role"] != "assistant":
                continue  # the generation prompt is the next assistant header only
            assert longer[: len(shorter)] == shorter
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    assert tokenizer.eos_token_id == end and tokenizer.pad_token_id != end
    assert tokenizer.padding_side == "left"


def test_sft_labels_cover_assistant_turns_only(tokenizer):
    from relayrl.demo.agent_model import encode_conversation

    ids, labels = encode_conversation(tokenizer, agent_task.episode(47, 86, use_tool=True))
    trained = tokenizer.decode([t for t in labels if t != -100])
    assert trained == ('<tool_call>{"name": "calculator", "arguments": {"expression": "47*86"}}</tool_call>'
                       '<|end|>\\boxed{4042}<|end|>')
    _, undecided = encode_conversation(tokenizer, agent_task.episode(47, 86, use_tool=True), decide=False)
    assert sum(t != -100 for t in undecided) == sum(t != -100 for t in labels) - 1


def test_shipped_weights_load_and_match_the_recipe():
    from transformers import AutoModelForCausalLM

    assert agent_demo_model_path(log=lambda *_: None) == SHIPPED
    assert json.loads((SHIPPED / "relayrl_recipe.json").read_text()) == RECIPE
    model = AutoModelForCausalLM.from_pretrained(SHIPPED)
    assert 1.5e6 < sum(p.numel() for p in model.parameters()) < 5e6


def test_builtin_agent_model_and_datasets():
    from relayrl.data.datasets import DataError, load_prompts
    from relayrl.models import ModelError, resolve_model_path

    assert resolve_model_path("builtin:agent-demo", log=lambda *_: None) == str(SHIPPED)
    with pytest.raises(ModelError, match="builtin:agent-demo"):
        resolve_model_path("builtin:nope")
    train = load_prompts("builtin:agent-demo")
    evals = load_prompts("builtin:agent-demo-eval")
    assert (len(train), len(evals)) == (4000, 200)
    for p in train[:50] + evals[:50]:
        a, b = map(int, p.messages[-1]["content"].removeprefix("Compute ").removesuffix(".").split("*"))
        assert 11 <= a <= 99 and 11 <= b <= 99 and p.answer == str(a * b)
    prompts = lambda ps: {p.messages[-1]["content"] for p in ps}  # noqa: E731
    assert len(prompts(train)) == 4000 and len(prompts(evals)) == 200  # no repeats within a split
    assert not prompts(train) & prompts(evals)
    assert not {p.id for p in train} & {p.id for p in evals}
    with pytest.raises(DataError, match="builtin:agent-demo-eval"):
        load_prompts("builtin:nope")


def test_warm_start_corpus_avoids_the_eval_pairs():
    held = set(agent_task._pairs("eval"))
    assert len(held) == agent_task.HELDOUT
    for conv in agent_task.corpus(2000, seed=5):
        a, b = map(int, conv[0]["content"][len("Compute "):-1].split("*"))
        assert (a, b) not in held
