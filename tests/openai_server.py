"""A small OpenAI-compatible HTTP server on loopback for the tests of teachers and judges (relayrl's clients
talk to it over real HTTP: ``relayrl.rewards.remote``). It serves a real model (a transformers causal LM):

    GET  /v1/models             the model's id
    POST /v1/completions        token ids (or text) as the prompt, ``echo`` + ``logprobs``: the prompt's log-probs
                                as vLLM returns them (the first None), then one generated token
    POST /v1/chat/completions   a reply: the model's greedy generation, or ``reply(text)`` where given (a judge
                                whose verdicts a test decides)

and misbehaves on demand: the first ``fail_first`` requests get HTTP ``fail_status`` (or every one after the first
``fail_after``), each request waits
``delay_s``, ``bad_echo`` returns one log-prob too few. ``requests`` counts what arrived, ``max_waiting`` the
most requests in flight at once (with ``delay_s``)."""


import asyncio
import socket
import threading
import time

import torch


class Server:
    def __init__(self, model=None, tokenizer=None, name: str = "test-model", reply=None, fail_first: int = 0,
                 fail_status: int = 503, delay_s: float = 0.0, bad_echo: bool = False, key: str | None = None,
                 fail_after: int | None = None):
        self.model, self.tokenizer, self.name, self.reply = model, tokenizer, name, reply
        self.fail_first, self.fail_status, self.delay_s, self.bad_echo, self.key = (fail_first, fail_status, delay_s,
                                                                                     bad_echo, key)
        self.fail_after = fail_after  # (requests after the first fail_after fail: a server that breaks mid-run)
        self.requests = self.waiting = self.max_waiting = 0
        self._lock = threading.Lock()
        self.app = self._app()

    def _app(self):
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse

        app = FastAPI()

        async def gate(request: Request):
            with self._lock:
                self.requests += 1
                n = self.requests
            if self.key is not None and request.headers.get("authorization") != f"Bearer {self.key}":
                return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
            if self.delay_s:
                with self._lock:
                    self.waiting += 1
                    self.max_waiting = max(self.max_waiting, self.waiting)  # (requests in flight at once)
                await asyncio.sleep(self.delay_s)
                with self._lock:
                    self.waiting -= 1
            if n <= self.fail_first or (self.fail_after is not None and n > self.fail_after):
                return JSONResponse({"error": {"message": "try later"}}, status_code=self.fail_status)
            return None

        @app.get("/v1/models")
        async def models(request: Request):
            return {"object": "list", "data": [{"id": self.name, "object": "model"}]}

        @app.post("/v1/completions")
        async def completions(request: Request):
            if (bad := await gate(request)) is not None:
                return bad
            body = await request.json()
            ids = body["prompt"] if isinstance(body["prompt"], list) else self.tokenizer(body["prompt"])["input_ids"]
            with torch.no_grad():
                logits = self.model(input_ids=torch.tensor([ids])).logits[0].float()
            lp = torch.log_softmax(logits, -1)
            prompt_lps = [None] + [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]
            nxt = int(lp[-1].argmax())
            out = prompt_lps + [lp[-1, nxt].item()] if body.get("echo") else [lp[-1, nxt].item()]
            if self.bad_echo:
                out = out[:-2]
            return {"object": "text_completion", "model": self.name,
                    "choices": [{"index": 0, "text": "", "finish_reason": "length",
                                 "logprobs": {"token_logprobs": out,  # (each token's text, as vLLM gives it)
                                              "tokens": [self.tokenizer.decode([i]) if self.tokenizer else str(i)
                                                         for i in ids + [nxt]]}}]}

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            if (bad := await gate(request)) is not None:
                return bad
            body = await request.json()
            text = body["messages"][-1]["content"]
            if self.reply is not None:
                content = self.reply(text)
            else:
                ids = self.tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True)["input_ids"]
                out = self.model.generate(torch.tensor([ids]), max_new_tokens=body.get("max_tokens", 16),
                                          do_sample=False)
                content = self.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
            return {"object": "chat.completion", "model": self.name,
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": content}}]}

        return app

    def __enter__(self) -> str:
        import uvicorn

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.port}/v1"

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
