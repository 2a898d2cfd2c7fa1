"""Tool schemas from plain functions, parsing Hermes/Qwen tool calls, tool result messages."""

import pytest
from transformers.utils import DocstringParsingException

from relayrl.envs.tools import ToolCall, parse_tool_calls, tool_result_message, tool_schemas


def calculator(expression: str, precision: int, unit: str | None = None) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression, e.g. "12 * 34".
        precision: Digits after the decimal point.
        unit: An optional unit appended to the result.
    """
    return expression


def test_schema_from_type_hints_and_docstring():
    (schema,) = tool_schemas([calculator])
    assert schema["type"] == "function"
    fn = schema["function"]
    assert fn["name"] == "calculator"
    assert fn["description"] == "Evaluate an arithmetic expression."
    params = fn["parameters"]
    assert params["required"] == ["expression", "precision"]
    assert params["properties"]["expression"] == {"type": "string", "description": 'The expression, e.g. "12 * 34".'}
    assert params["properties"]["precision"] == {"type": "integer", "description": "Digits after the decimal point."}
    assert params["properties"]["unit"]["type"] == "string"
    assert params["properties"]["unit"]["nullable"] is True


def test_schema_errors():
    def undocumented(x: int) -> int:
        return x

    with pytest.raises(DocstringParsingException, match="undocumented"):
        tool_schemas([undocumented])
    with pytest.raises(ValueError, match="repeated: calculator"):
        tool_schemas([calculator, calculator])


def test_parse_one_and_two_calls_with_text_around():
    one = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2", "precision": 0}}\n</tool_call>'
    assert parse_tool_calls(one) == [ToolCall("calculator", {"expression": "2+2", "precision": 0})]
    two = (
        "Let me compute both.\n"
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>\nDone.'
    )
    assert parse_tool_calls(two) == [ToolCall("a", {"x": 1}), ToolCall("b", {})]


def test_malformed_calls_come_back_invalid():
    text = (
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}\n</tool_call>'  # a missing brace
        "<tool_call>\n[1, 2]\n</tool_call>"  # a list, not an object
        '<tool_call>\n{"arguments": {}}\n</tool_call>'  # no name
        '<tool_call>\n{"name": "b", "arguments": "x=1"}\n</tool_call>'  # arguments not an object
        '<tool_call>\n{"name": "c", "arguments": {'  # generation stopped inside the call
    )
    calls = parse_tool_calls(text)
    assert [c.name for c in calls] == ["", "", "", "b", ""]
    assert all(c.error for c in calls)
    assert calls[0].error.startswith("invalid JSON")
    assert "got list" in calls[1].error
    assert '"name"' in calls[2].error
    assert '"arguments"' in calls[3].error
    assert "unterminated" in calls[4].error


def test_no_calls():
    assert parse_tool_calls("The answer is 4.") == []
    assert parse_tool_calls("") == []


def test_tool_result_message():
    msg = tool_result_message(ToolCall("calculator", {"expression": "2+2"}), "4")
    assert msg == {"role": "tool", "name": "calculator", "content": "4"}
