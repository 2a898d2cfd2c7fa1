"""OpenAI's wire format, in and out: request bodies (validated by pydantic), the conversation as the
chat template renders it, responses, streamed chunks and errors.

Assistant turns reach the template as the text the policy wrote, tool calls included in relayrl's
Hermes/Qwen form (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, what
``relayrl.envs.tools.parse_tool_calls`` reads): a turn the endpoint sampled goes back as the exact
text it sampled (``Session`` swaps it in), a turn the client wrote itself is written in that form.
Tool results become ``{"role": "tool", "name": <the called tool>, "content": ...}`` as in a
``ToolEnv`` episode. ``developer`` messages are system messages.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from relayrl.envs.tools import parse_tool_calls
from relayrl.models import images


class ApiError(Exception):
    """An error the client caused: answered as OpenAI's ``{"error": {...}}`` with ``status``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Body(BaseModel):
    # fields OpenAI has and relayrl does not use are accepted and ignored (SDKs send some of them)
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None

    def stops(self) -> list[str]:
        s = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(s) > 4 or any(not x for x in s):
            raise ApiError(400, "stop: at most 4 non-empty strings", param="stop")
        return s

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class ChatRequest(_Body):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    logprobs: bool = False


class CompletionRequest(_Body):
    prompt: str | list[int]
    logprobs: int | None = None


class GenerateRequest(BaseModel):
    """vLLM's token route (``POST /inference/v1/generate``), as verifiers' training client sends it."""

    model_config = ConfigDict(extra="allow")

    model: str
    token_ids: list[int] = Field(min_length=1)
    sampling_params: dict[str, Any] = Field(default_factory=dict)


MAX_DEPTH = 64  # levels of JSON a request may nest; a tool's parameter schema takes a handful


def json_problem(data: Any) -> tuple[str, str] | None:
    """(where, message) of the first value nested past ``MAX_DEPTH`` or text with a lone surrogate; None if none."""
    stack = [(data, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            return path, f"{path or 'body'}: nested deeper than {MAX_DEPTH} levels"
        if isinstance(value, dict):
            for k, v in value.items():
                if bad := _surrogate(k):
                    return path, f"{path or 'body'}: a key with invalid Unicode: {bad}"
                stack.append((v, f"{path}.{k}" if path else str(k), depth + 1))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))
        elif isinstance(value, str) and (bad := _surrogate(value)):
            return path, f"{path or 'body'}: invalid Unicode: {bad}"
    return None


def _surrogate(text: str) -> str | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"a lone surrogate at character {e.start + 1} (no tokenizer can encode it)"
    return None


# ------------------------------------------------------------------------------- messages in


def _content(content: Any, where: str) -> tuple[str, list[str]]:
    """A message's content as text (a string, or a list of text and image parts) and its images' references: each
    ``image_url`` part a ``data:image`` URL, its place in the text an ``<image>`` marker (``models.images``)."""
    if content is None:
        return "", []
    if isinstance(content, str):
        return content, []
    if isinstance(content, list):
        out, refs = [], []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind in ("text", "input_text", "output_text"):
                out.append(str(part.get("text", "")))
            elif kind == "image_url":
                refs.append(_image(part.get("image_url"), f"{where}[{i}].image_url"))
                out.append(images.IMAGE)
            else:
                raise ApiError(400, f"{where}: content parts are text or image_url, got a {kind!r} part", param=where)
        return "".join(out), refs
    raise ApiError(400, f"{where}: content must be a string or a list of text and image_url parts", param=where)


def _image(value: Any, where: str) -> str:
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url.startswith("data:"):
        why = ("a remote URL: nothing is fetched from the network" if isinstance(url, str) and url.startswith(
            ("http://", "https://")) else "not a data URL")
        raise ApiError(400, f"{where}: {str(url)[:60]!r} is {why}; send the image as data:image/<format>;base64,...",
                       param=where)
    try:
        return images.to_ref(url, None, where)
    except images.ImageError as e:
        raise ApiError(400, str(e), param=where) from None


def call_text(name: str, arguments: dict) -> str:
    """A tool call as the policy writes it (relayrl's parser reads it back)."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}</tool_call>"


def _arguments(raw: Any, where: str) -> dict:
    if isinstance(raw, dict):
        return raw
    if raw is not None and not isinstance(raw, str):
        raise ApiError(400, f"{where}: arguments must be a JSON object or its text, got {type(raw).__name__}",
                       param=where)
    try:
        value = json.loads(raw) if isinstance(raw, str) and raw.strip() else {}
    except json.JSONDecodeError as e:
        raise ApiError(400, f"{where}: arguments are not valid JSON: {e.msg}", param=where) from None
    except (ValueError, RecursionError) as e:  # an integer of thousands of digits; [[[...]]] past the parser
        raise ApiError(400, f"{where}: arguments are not valid JSON: {str(e).split(';')[0][:200]}",
                       param=where) from None
    if not isinstance(value, dict):
        raise ApiError(400, f"{where}: arguments must be a JSON object", param=where)
    if problem := json_problem(value):  # (the body's own check saw only a string)
        raise ApiError(400, f"{where}: {problem[1]}", param=where)
    return value


def same(a: list[dict], b: list[dict]) -> bool:
    """Two canonical conversations say the same thing, however the client spelled them (ids, None or
    "", JSON spacing of arguments, whitespace around a streamed text)."""
    return len(a) == len(b) and all(_key(x) == _key(y) for x, y in zip(a, b))


def _key(m: dict) -> tuple:
    return m["role"], m["content"].strip(), m.get("tool_calls"), m.get("name"), tuple(m.get("images") or ())


def canonical(messages: list[dict]) -> list[dict]:
    """The conversation as data: roles, texts, tool calls as (name, arguments), tool results with the
    name of the tool called (by ``tool_call_id``); ``same`` compares them."""
    out, names = [], {}
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"{where} must be an object", param=where)
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise ApiError(400, f"{where}: unknown role {role!r:.40}", param=f"{where}.role")
        text, refs = _content(m.get("content"), f"{where}.content")
        item: dict = {"role": role, "content": text, **({"images": refs} if refs else {})}
        for field in ("name", "tool_call_id"):  # (looked up in a dict and rendered by the template: text only)
            if m.get(field) is not None and not isinstance(m[field], str):
                raise ApiError(400, f"{where}.{field} must be a string", param=f"{where}.{field}")
        if role == "assistant" and m.get("tool_calls") is not None and not isinstance(m["tool_calls"], list):
            raise ApiError(400, f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
        if role == "assistant" and m.get("tool_calls"):
            calls = []
            for j, c in enumerate(m["tool_calls"]):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ApiError(400, f"{where}.tool_calls[{j}]: needs function.name", param=f"{where}.tool_calls")
                if c.get("id") is not None and not isinstance(c["id"], str):
                    raise ApiError(400, f"{where}.tool_calls[{j}].id must be a string", param=f"{where}.tool_calls")
                args = _arguments(fn.get("arguments"), f"{where}.tool_calls[{j}].function.arguments")
                calls.append((fn["name"], args))
                names[c.get("id")] = fn["name"]
            item["tool_calls"] = calls
        if role == "tool":
            item["name"] = m.get("name") or names.get(m.get("tool_call_id")) or ""
        out.append(item)
    return out


def template_message(m: dict) -> dict:
    """A canonical message as the chat template renders it (tool calls written as the policy writes them)."""
    if m["role"] == "assistant" and m.get("tool_calls"):
        calls = "".join(call_text(name, args) for name, args in m["tool_calls"])
        return {"role": "assistant", "content": (m["content"] + calls) if m["content"] else calls}
    seen = {"images": m["images"]} if m.get("images") else {}  # (a client's images: models.vision renders them)
    if m["role"] == "tool":
        return {"role": "tool", "name": m["name"], "content": m["content"], **seen}
    return {"role": m["role"], "content": m["content"], **seen}


def template_tools(tools: list[dict] | None) -> list[dict] | None:
    """The request's function tools, as the chat template takes them; other kinds are refused."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise ApiError(400, f"tools[{i}]: only function tools are supported", param="tools")
        out.append({"type": "function", "function": t["function"]})
    return out


# ------------------------------------------------------------------------------ responses out


def split_tool_calls(text: str, known: set[str] | None) -> tuple[str, list[dict], int]:
    """(content, OpenAI tool calls, malformed or unknown calls) of an assistant turn's text, read by
    relayrl's parser. A call it cannot read, or one naming a tool the request did not offer, stays
    in the content as the model wrote it."""
    calls, bad, kept, at = [], 0, [], 0
    for m in _TOOL_CALL.finditer(text):
        (c,) = parse_tool_calls(m.group(0))
        if c.error or (known is not None and c.name not in known):
            bad += 1
            continue
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}})
        kept.append(text[at:m.start()])
        at = m.end()
    if not calls:
        return text, [], bad
    return ("".join(kept) + text[at:]).strip(), calls, bad


_TOOL_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)  # as relayrl.envs.tools reads them


FINISH = {"stop": "stop", "length": "length", "aborted": "stop"}


def chat_response(rid: str, model: str, content: str, calls: list[dict], finish: str, usage: dict,
                  logprobs: list[dict] | None) -> dict:
    message = {"role": "assistant", "content": content or (None if calls else ""),
               **({"tool_calls": calls} if calls else {})}
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if calls else finish,
                         "logprobs": {"content": logprobs} if logprobs is not None else None}],
            "usage": usage}


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None = None, usage: dict | None = None) -> str:
    body = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}] if delta is not None else []}
    if usage is not None:
        body["usage"] = usage
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def completion_response(rid: str, model: str, text: str, finish: str, usage: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}], "usage": usage}


def completion_chunk(rid: str, model: str, text: str, finish: str | None = None) -> str:
    body = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def settled(text: str) -> str:
    """What of a reply still being generated is final: its text less a trailing incomplete character
    (a token that ends inside a multi-byte UTF-8 character decodes to U+FFFD until the next arrives)."""
    return text.rstrip("\ufffd")


def visible_prefix(text: str) -> str:
    """What of a turn still being generated can be streamed as content: the settled text before a tool
    call (or before what may be the start of one's tag)."""
    text = settled(text)
    cut = text.find("<tool_call>")
    if cut >= 0:
        return text[:cut]
    for k in range(min(len(text), len("<tool_call>") - 1), 0, -1):
        if "<tool_call>".startswith(text[-k:]):
            return text[:-k]
    return text


Role = Literal["system", "user", "assistant", "tool"]
