"""The OpenAI-compatible HTTP endpoint: FastAPI routes served by uvicorn on the episodes' own event
loop (the loop the engine's async front and every episode run on: a request is one more coroutine
there, with no thread hop between the HTTP handler and the engine).

    GET  /v1/models                   the policy (``serve.model_name``), with vLLM's ``max_model_len``
    POST /v1/chat/completions         messages, tools/tool_calls, temperature/max_tokens/stop, stream
    POST /v1/completions              a text (or token-id) prompt
    POST /inference/v1/generate       token ids in, token ids and log-probs out (vLLM's route, which
                                      verifiers' training client speaks)

Each route is also served under ``/sessions/<key>``, the session's own base URL; otherwise the
session is the API key (``Authorization: Bearer <key>``, which keeps it out of URLs that proxies
log). Every route needs an open session's key, ``/v1/models`` too. The endpoint speaks plain HTTP: a
``serve.host`` other than loopback is warned about at start. Errors are OpenAI's ``{"error": {...}}``
with a 4xx status for whatever the client got wrong (a malformed body, an unknown model, a key
that expired with its episode); an unexpected exception in a handler is a 500 for that request and
never reaches the run. A body is read only after its key is checked, and bounded (``serve.bodies``: its
size, 413; its JSON's nesting and Unicode, 400). Requests handled at once are bounded (``serve.max_requests``:
more get 429, which OpenAI clients retry), and so are open connections (``serve.max_connections``: one more is
closed at once; one that sends no request is closed after ``Endpoint.FIRST_REQUEST_S``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import resource
import socket
import uuid
import warnings

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from relayrl.engine.base import EngineError
from relayrl.envs.chat import TemplateMismatch
from relayrl.serve import openai_format as oa
from relayrl.serve.bodies import body_limit, invalid, read_body
from relayrl.serve.openai_format import ApiError, ChatRequest, CompletionRequest, GenerateRequest
from relayrl.serve.sessions import Session, SessionTable

log = logging.getLogger("relayrl.serve")


def build_app(table: SessionTable, model: str, max_model_len: int | None, max_requests: int,
              roles: tuple[str, ...] = ()) -> FastAPI:
    """The endpoint's app: the policy as ``model``, and with ``roles`` (env.roles) each role's policy as
    ``<model>/<role>`` (one LoRA adapter per role under model.lora.per_role, where the bare ``model`` names none)."""
    app = FastAPI(title="relayrl endpoint", openapi_url=None, docs_url=None, redoc_url=None)
    app.add_middleware(Bounded, limit=max_requests)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, e: RequestValidationError):
        return _error(invalid(e.errors(), skip=1))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):  # (404 no such route, 405): OpenAI's shape too
        return _error(ApiError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):
        log.exception("relayrl endpoint: %s %s failed", request.method, request.url.path)
        return _error(ApiError(500, f"internal error: {type(e).__name__}", type="server_error"))

    names = {model: None, **{f"{model}/{r}": r for r in roles}}  # model name -> the role it plays (None: any)
    cards = {n: {"id": n, "object": "model", "created": 0, "owned_by": "relayrl", "max_model_len": max_model_len}
             for n in names}
    served = ", ".join(f"`{n}`" for n in names)

    limit = body_limit(max_model_len)

    def session(request: Request) -> Session:
        """The open session the request names (its base URL's key, else its bearer key)."""
        key = request.path_params.get("key")
        if key is None:
            auth = request.headers.get("authorization", "")
            key = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        return table.get(key)

    async def asked(request: Request, cls):
        """(session, body, role): the key is checked first, so a client without one learns nothing of the
        endpoint, not its schema (a 400 for its body), not even its model; then the body (``serve.bodies``), and
        the role its model names."""
        s = session(request)
        body = await read_body(request, cls, limit)
        if body.model not in names:
            raise ApiError(404, f"The model `{body.model:.100}` does not exist (this endpoint serves {served})",
                           code="model_not_found", param="model")
        role = names[body.model]
        if role is None and getattr(s.runner, "per_role_adapters", False):
            raise ApiError(400, f"each role has a policy of its own here (model.lora.per_role): name one of "
                           f"{', '.join(f'`{n}`' for n, r in names.items() if r)}", param="model")
        return s, body, role

    for prefix in ("", "/sessions/{key}"):
        @app.get(prefix + "/v1/models")
        async def models(request: Request):
            session(request)
            return JSONResponse({"object": "list", "data": list(cards.values())})

        @app.get(prefix + "/v1/models/{name:path}")
        async def one_model(name: str, request: Request):
            session(request)
            if name not in cards:
                raise ApiError(404, f"The model `{name:.100}` does not exist", code="model_not_found")
            return JSONResponse(cards[name])

        @app.post(prefix + "/v1/chat/completions")
        async def chat(request: Request):
            return await _chat(*await asked(request, ChatRequest))

        @app.post(prefix + "/v1/completions")
        async def completions(request: Request):
            return await _completion(*await asked(request, CompletionRequest))

        @app.post(prefix + "/inference/v1/generate")
        async def generate(request: Request):
            return await _generate(*await asked(request, GenerateRequest))

    return app


class Bounded:
    """At most ``limit`` requests handled at once; more are answered 429 at once (a plain ASGI
    middleware: starlette's ``BaseHTTPMiddleware`` costs a task group per request)."""

    def __init__(self, app, limit: int):
        self.app, self.limit, self.busy = app, limit, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.busy >= self.limit:
            e = ApiError(429, f"more than serve.max_requests={self.limit} requests at once; retry",
                         type="rate_limit_error", code="rate_limit_exceeded")
            return await _error(e)(scope, receive, send)
        self.busy += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.busy -= 1


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _client_sampling(body) -> dict:
    return {"temperature": body.temperature, "top_p": body.top_p, "top_k": getattr(body, "top_k", None)}


async def _run(s: Session, undo, work):
    """``work()`` (a coroutine: one reply) as a task the session can cancel when its episode ends;
    a reply that does not come undoes what the request added to its branch."""
    task = asyncio.get_running_loop().create_task(work())
    s.track(task)
    try:
        return await task
    except asyncio.CancelledError:
        undo()
        if asyncio.current_task().cancelling():  # this handler itself is being cancelled
            raise
        raise ApiError(409, "the session's episode ended while this request was generating",
                       code="session_expired") from None
    except (EngineError, TemplateMismatch) as e:
        undo()
        s.fatal = s.fatal or e  # the episode (and the run) stops with it
        raise ApiError(500, f"{type(e).__name__}: {e}", type="server_error") from None
    except BaseException:
        undo()
        raise


async def _chat(s: Session, body: ChatRequest, role: str | None):
    model = body.model
    conv = oa.canonical(body.messages)
    tools = oa.template_tools(body.tools)
    known = {t["function"].get("name") for t in tools} if tools else None
    stops = body.stops()
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    s.enter()
    try:
        b, undo = s.chat_branch(conv, tools, role)
    except TemplateMismatch as e:  # the template cannot extend the conversation: the run stops, as with an env
        s.leave()
        s.fatal = s.fatal or e
        raise ApiError(500, f"TemplateMismatch: {e}", type="server_error") from None
    except BaseException:
        s.leave()
        raise

    def reply(turn) -> dict:
        content, calls, _ = oa.split_tool_calls(turn.text, known)
        return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}

    def done(turn) -> tuple[dict, dict]:
        message = reply(turn)
        s.replied(b, turn, message, known)
        lp = [{"token": s.tok.decode([i]), "logprob": p, "bytes": None, "top_logprobs": []}
              for i, p in zip(turn.token_ids, turn.logprobs)] if body.logprobs else None
        out = oa.chat_response(rid, model, message["content"] or "", message.get("tool_calls", []), turn.finish,
                               oa.usage(turn.prompt_tokens, len(turn.token_ids)), lp)
        return message, out

    if not body.stream:
        try:
            turn = await _run(s, undo, lambda: s.generate(b, body.limit(), _client_sampling(body), stops))
            return JSONResponse(done(turn)[1])
        finally:
            s.leave()

    queue: asyncio.Queue = asyncio.Queue()
    sent = [0]

    def grew(text: str) -> None:
        visible = oa.visible_prefix(text)
        if len(visible) > sent[0]:
            queue.put_nowait(oa.chat_chunk(rid, model, {"content": visible[sent[0]:]}))
            sent[0] = len(visible)

    async def work():
        try:
            turn = await _run(s, undo, lambda: s.generate(b, body.limit(), _client_sampling(body), stops, on_text=grew))
            message, out = done(turn)
            content = message["content"] or ""
            tail = content[sent[0]:] if len(content) > sent[0] else ""
            delta = {**({"content": tail} if tail else {}),
                     **({"tool_calls": [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]}
                        if message.get("tool_calls") else {})}
            queue.put_nowait(oa.chat_chunk(rid, model, delta, out["choices"][0]["finish_reason"]))
            if (body.stream_options or {}).get("include_usage"):
                queue.put_nowait(oa.chat_chunk(rid, model, None, usage=out["usage"]))
        except Exception as e:  # noqa: BLE001 - the stream ends with the error, as OpenAI's does
            queue.put_nowait(_error_event(e))
        finally:
            s.leave()
            queue.put_nowait(None)

    return _sse(work, queue, first=oa.chat_chunk(rid, model, {"role": "assistant", "content": ""}))


async def _completion(s: Session, body: CompletionRequest, role: str | None):
    model = body.model
    stops = body.stops()
    rid = f"cmpl-{uuid.uuid4().hex}"
    if isinstance(body.prompt, list):
        _check_ids(body.prompt, s.tok, "prompt")
    s.enter()
    try:
        b, undo = s.token_branch(body.prompt, role) if isinstance(body.prompt, list) else \
            s.text_branch(body.prompt, role)
    except BaseException:
        s.leave()
        raise
    if not body.stream:
        try:
            turn = await _run(s, undo, lambda: s.generate(b, body.limit() or 16, _client_sampling(body), stops))
            s.replied(b, turn, None, None)
            return JSONResponse(oa.completion_response(rid, model, turn.text, turn.finish,
                                                       oa.usage(turn.prompt_tokens, len(turn.token_ids))))
        finally:
            s.leave()
    queue: asyncio.Queue = asyncio.Queue()
    sent = [0]

    def grew(text: str) -> None:
        text = oa.settled(text)
        if len(text) > sent[0]:
            queue.put_nowait(oa.completion_chunk(rid, model, text[sent[0]:]))
            sent[0] = len(text)

    async def work():
        try:
            turn = await _run(s, undo, lambda: s.generate(b, body.limit() or 16, _client_sampling(body), stops,
                                                          on_text=grew))
            s.replied(b, turn, None, None)
            queue.put_nowait(oa.completion_chunk(rid, model, turn.text[sent[0]:], turn.finish))
        except Exception as e:  # noqa: BLE001 - the stream ends with the error, as OpenAI's does
            queue.put_nowait(_error_event(e))
        finally:
            s.leave()
            queue.put_nowait(None)

    return _sse(work, queue)


async def _generate(s: Session, body: GenerateRequest, role: str | None):
    """vLLM's token route: the prompt's token ids in; the sampled ids, their log-probs (as
    ``token_id:N`` entries) and the finish reason out."""
    _check_ids(body.token_ids, s.tok, "token_ids")
    sp = body.sampling_params
    want = sp.get("max_tokens")
    if want is not None and (not isinstance(want, int) or isinstance(want, bool) or want < 1):
        raise ApiError(400, "sampling_params.max_tokens must be a positive integer", param="sampling_params.max_tokens")
    stop_ids = sp.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in stop_ids):
        raise ApiError(400, "sampling_params.stop_token_ids must be a list of integers", param="sampling_params")
    s.enter()
    try:
        b, undo = s.token_branch(body.token_ids, role)
        prompt_ids = b.traj.prompt_ids + b.traj.response_ids
        turn = await _run(s, undo, lambda: s.generate(b, want, sp, (), set(stop_ids)))
        s.replied(b, turn, None, None)
    finally:
        s.leave()
    return JSONResponse({"request_id": f"gen-{uuid.uuid4().hex}", "prompt_token_ids": prompt_ids,
                         "choices": [{"index": 0, "token_ids": turn.token_ids, "finish_reason": turn.finish,
                                      "logprobs": {"content": [{"token": f"token_id:{i}", "logprob": p}
                                                               for i, p in zip(turn.token_ids, turn.logprobs)]}}],
                         "usage": oa.usage(len(prompt_ids), len(turn.token_ids))})


def _check_ids(ids: list[int], tok, param: str) -> None:
    n = len(tok)
    bad = next((i for i in ids if not 0 <= i < n), None)
    if bad is not None:
        raise ApiError(400, f"{param}: token id {bad} is outside the vocabulary (0..{n - 1})", param=param)


def _error_event(e: Exception) -> str:
    if not isinstance(e, ApiError):
        log.exception("relayrl endpoint: a streamed reply failed")
        e = ApiError(500, f"internal error: {type(e).__name__}", type="server_error")
    return f"data: {json.dumps(e.body())}\n\n"


def _sse(work, queue: asyncio.Queue, first: str | None = None) -> StreamingResponse:
    """Server-sent events that ``work`` (started now, so its session's bookkeeping ends with it
    whatever the client does) puts on ``queue``, then None."""
    task = asyncio.get_running_loop().create_task(work())

    async def events():
        try:
            if first:
                yield first
            while (item := await queue.get()) is not None:
                yield item
            yield "data: [DONE]\n\n"
        finally:
            if not task.done():  # the client went away: its generation stops
                task.cancel()

    return StreamingResponse(events(), media_type="text/event-stream")


class Endpoint:
    """The app served by uvicorn on the running loop, at ``host`` on ``port`` (0: a free one)."""

    FIRST_REQUEST_S = 5.0  # a connection that sends no request within this is closed

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, max_connections: int = 1024):
        import uvicorn

        _raise_fd_limit(max_connections)
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as e:
            self.sock.close()
            raise ValueError(f"serve.host={host} serve.port={port}: cannot listen there: {e.strerror or e}") from None
        self.host, self.port = host, self.sock.getsockname()[1]
        if not ipaddress.ip_address(self.sock.getsockname()[0]).is_loopback:
            warnings.warn(f"serve.host={host}: the endpoint listens beyond this machine over plain HTTP: session keys "
                          "and every prompt and reply cross the network unencrypted (keep 127.0.0.1, or put a TLS "
                          "proxy in front)", stacklevel=2)
        config = uvicorn.Config(app, log_config=None, log_level="warning", access_log=False, lifespan="off",
                                backlog=2048, timeout_keep_alive=30, http=_protocol(max_connections))
        self.server = uvicorn.Server(config)
        self.task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()
                raise RuntimeError("the endpoint stopped as it started")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            try:
                await asyncio.wait_for(self.task, 5)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                pass
        self.sock.close()


def _protocol(most: int):
    """uvicorn's HTTP protocol, keeping at most ``most`` connections (one more is closed at once: a
    connection error, which OpenAI clients retry) and closing one that sends no request within
    ``Endpoint.FIRST_REQUEST_S``: uvicorn times a connection out only after a response, so 1,000 connections
    that never ask would otherwise hold their places for as long as they stay open. (uvicorn's own
    ``limit_concurrency`` counts them too, and answers every later request with a plain-text 503.)"""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class Protocol(AutoHTTPProtocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.server_state.connections) > most:
                transport.close()
                return
            self.timeout_keep_alive_task = self.loop.call_later(Endpoint.FIRST_REQUEST_S,
                                                                self.timeout_keep_alive_handler)

    return Protocol


def _raise_fd_limit(connections: int) -> None:
    """Room for ``connections`` sockets (and the run's own files) under the soft file limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = connections + 1024
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))
