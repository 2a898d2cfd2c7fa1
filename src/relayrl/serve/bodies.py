"""A request's body, read by the endpoint itself after the session key was checked (FastAPI would validate it
first, and a client without a key would learn the schema from the 400), and bounded before anything reads it:

- size: at most ``limit`` bytes (413), read as it streams in (a 10 MB message was tokenized whole on the
  episodes' event loop, > 2 GiB before its 400);
- JSON: invalid JSON, invalid UTF-8, an integer past Python's 4,300 digits or nesting too deep for the parser
  are a 400, never a 500;
- content: nesting past ``openai_format.MAX_DEPTH`` (tool parameters 900 deep made the chat template recurse)
  and lone surrogates (``"\\ud800"``: JSON can spell them, no tokenizer can encode them) anywhere are a 400
  naming where (``openai_format.json_problem``).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from relayrl.serve.openai_format import ApiError, json_problem


def body_limit(max_model_len: int | None) -> int:
    """Bytes a request may send: room for the model's whole context at 32 bytes a token (JSON-escaped text,
    token ids), and never less than 1 MiB."""
    return max(1 << 20, 32 * max_model_len) if max_model_len else 8 << 20


async def read_body(request: Request, cls: type[BaseModel], limit: int) -> Any:
    """The body as ``cls``, or an ``ApiError`` (413, 400) saying what is wrong with it."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    try:
        data = json.loads(b"".join(chunks))
    except json.JSONDecodeError as e:
        raise ApiError(400, f"body: the body is not valid JSON ({e.msg}: line {e.lineno} column {e.colno})",
                       param="body") from None
    except (ValueError, RecursionError) as e:  # not UTF-8; an integer of thousands of digits; [[[...]]]
        raise ApiError(400, f"body: the body is not valid JSON ({str(e).split(';')[0][:200]})", param="body") from None
    where = json_problem(data)
    if where is not None:
        raise ApiError(400, where[1], param=where[0] or "body")
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise invalid(e.errors(), skip=0) from None


def invalid(errors: list[dict], skip: int) -> ApiError:
    """A 400 for pydantic's (or FastAPI's) first error; ``skip``: leading parts of its location to leave out."""
    first = errors[0] if errors else {}
    where = ".".join(str(x) for x in first.get("loc", ())[skip:]) or "body"
    msg = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        where, msg = "body", f"the body is not valid JSON ({first.get('ctx', {}).get('error', msg)})"
    return ApiError(400, f"{where}: {msg}", param=where)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit:,} bytes (the model's context, at 32 bytes a "
                    "token, and at least 1 MiB)", code="request_too_large")
