"""Tools as plain Python functions: their OpenAI schemas, parsing calls, returning results.

A tool is a function with type hints and a Google-style docstring (``Args:`` section); its
schema comes from ``transformers.utils.get_json_schema``, the same one ``apply_chat_template``
builds when given the function. Calls are parsed from the Hermes/Qwen format the chat templates
render: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, several per turn.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers.utils import get_json_schema

# a call runs to its closing tag, or to the end of the text when generation stopped inside it
_TOOL_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call. ``error`` is None for a well-formed call, else why it is invalid."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def tool_schemas(tools: Sequence[Callable]) -> list[dict]:
    """OpenAI function schemas of ``tools``; a missing hint or docstring raises, naming the function.

    Two tools with the same name are rejected: a call could not tell them apart.
    """
    schemas = [get_json_schema(fn) for fn in tools]
    names = [s["function"]["name"] for s in schemas]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"tool names must be unique; repeated: {', '.join(duplicates)}")
    return schemas


def _parse_one(body: str, closed: bool) -> ToolCall:
    """A ToolCall from the text between the tags; never raises."""
    if not closed:
        return ToolCall("", error="unterminated <tool_call> (no </tool_call>)")
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall("", error=f"invalid JSON in <tool_call>: {e}")
    if not isinstance(obj, dict):
        return ToolCall("", error=f"a tool call must be a JSON object, got {type(obj).__name__}")
    name, arguments = obj.get("name"), obj.get("arguments", {})
    if not isinstance(name, str) or not name:
        return ToolCall("", error='a tool call needs a "name" string')
    if not isinstance(arguments, dict):
        return ToolCall(name, error=f'"arguments" must be a JSON object, got {type(arguments).__name__}')
    return ToolCall(name, arguments)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>...</tool_call>`` in ``text``, in order; malformed ones come back invalid."""
    return [_parse_one(m.group(1), bool(m.group(2))) for m in _TOOL_CALL.finditer(text)]


def tool_result_message(call: ToolCall, content) -> dict:
    """The OpenAI-style message that returns ``content`` (a result or an error; an image a tool returned, as an
    image part: a vision-language policy sees it, ``models.images``) for ``call``."""
    if is_image(content):
        content = [{"type": "image", "image": content}]
    return {"role": "tool", "name": call.name, "content": content}


def is_image(value) -> bool:
    """A PIL image (what a tool returns for a screenshot)."""
    return hasattr(value, "save") and hasattr(value, "size") and hasattr(value, "mode")
