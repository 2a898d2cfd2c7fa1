"""Calls to an OpenAI-compatible server (a teacher's or a judge's): JSON over HTTP with a deadline, retried with
exponential backoff where the failure is transient (no connection, a reset, HTTP 408, 409, 429, 5xx), and an
API key read from an environment variable the configuration names, sent as a bearer token and never written
anywhere (messages name the variable, not its value). The standard library's client: no dependency, and the
callers run it on worker threads.
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.request

TRANSIENT_STATUS = (408, 409, 429, 500, 502, 503, 504)


class RemoteError(RuntimeError):
    """A call that failed after its retries: ``transient`` says whether another try might have worked."""

    def __init__(self, message: str, transient: bool = False):
        super().__init__(message)
        self.transient = transient


def api_key(env: str | None, field: str) -> str | None:
    """The key in environment variable ``env`` (None: no key); a variable named but unset is an error naming it."""
    if env is None:
        return None
    value = os.environ.get(env)
    if not value:
        raise ValueError(f"{field}={env}: the environment variable {env} is not set")
    return value


def _request(url: str, body: dict | None, key: str | None, timeout: float) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        detail = e.read()[:300].decode("utf-8", "replace").strip()
        raise RemoteError(f"HTTP {e.code} from {url}: {detail or e.reason}", e.code in TRANSIENT_STATUS) from None
    except (urllib.error.URLError, socket.timeout, ConnectionError, TimeoutError) as e:
        reason = getattr(e, "reason", e)
        raise RemoteError(f"{url}: {type(reason).__name__}: {reason}", True) from None
    try:
        return json.loads(raw)
    except ValueError:
        raise RemoteError(f"{url}: the reply is not JSON: {raw[:200]!r}") from None


def call(url: str, body: dict | None = None, key: str | None = None, timeout: float = 60.0, retries: int = 3,
         backoff: float = 0.5) -> dict:
    """POST ``body`` (None: GET) to ``url``; the reply's JSON. Transient failures are retried ``retries`` times,
    waiting ``backoff`` × 2^k seconds; a ``RemoteError`` after the last, or at once for another failure."""
    for k in range(retries + 1):
        try:
            return _request(url, body, key, timeout)
        except RemoteError as e:
            if not e.transient or k == retries:
                if k:
                    e.args = (f"{e.args[0]} (after {k + 1} tries)",)
                raise
        time.sleep(backoff * 2**k)
    raise AssertionError("unreachable")


def served_models(base_url: str, key: str | None, field: str, timeout: float = 10.0) -> list[str]:
    """The model ids a server lists at ``base_url``/models: the start-up check that it answers (one line
    naming ``field`` and the URL where it does not)."""
    from relayrl.models import ModelError

    try:
        reply = call(base_url.rstrip("/") + "/models", None, key, timeout, retries=1)
    except RemoteError as e:
        raise ModelError(f"{field}={base_url!r}: the server does not answer: {e}") from None
    ids = [m.get("id") for m in reply.get("data", []) if isinstance(m, dict)] if isinstance(reply, dict) else []
    if not ids:
        raise ModelError(f"{field}={base_url!r}: GET /models lists no model (an OpenAI-compatible server lists "
                         "what it serves)")
    return ids
