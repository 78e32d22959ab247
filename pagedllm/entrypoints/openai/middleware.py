"""ASGI middleware of the OpenAI server: API-key auth, request ids with one access-log
line per request, and a 500 for an unexpected error that keeps the connection open.
Plain ASGI callables, not ``BaseHTTPMiddleware``, so streams pass through unbuffered and a
client's disconnect still reaches the endpoint."""
from __future__ import annotations

import hmac
import json
import logging
import time
import uuid

from pagedllm.entrypoints.openai.errors import error_body

logger = logging.getLogger("pagedllm")
access_logger = logging.getLogger("pagedllm.access")


def _error(message: str, code: int, type_: str, extra_headers: list | None = None):
    body = json.dumps(error_body(message, None, code, type_), separators=(",", ":")).encode()   # as JSONResponse
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    return body, headers + (extra_headers or [])


class InternalErrorMiddleware:
    """Answers an exception nothing caught with a 500 in OpenAI's error shape (``type``
    ``internal_error``), logged with its traceback, and returns normally so the keep-alive
    connection survives (Starlette's own handler re-raises, and uvicorn then closes it). An
    exception after the response has started is re-raised."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watch(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as exc:
            if started:
                raise
            logger.exception("request failed: %s %s", scope.get("method"), scope.get("path"))
            body, headers = _error(f"internal error: {exc}", 500, "internal_error")
            await send({"type": "http.response.start", "status": 500, "headers": headers})
            await send({"type": "http.response.body", "body": body})


class ApiKeyMiddleware:
    """Bearer auth on every HTTP route except ``/health`` (and ``/metrics`` when
    ``metrics_without_auth``): scheme case-insensitive (RFC 9110, 11.1), or the key alone in
    ``x-api-key`` (Anthropic's header); compared in constant time. A missing or wrong key
    gets 401 in OpenAI's error shape with ``WWW-Authenticate: Bearer``.

    Raises:
        ValueError: an empty ``api_key``.
    """

    def __init__(self, app, api_key: str, metrics_without_auth: bool = False):
        if not api_key:
            raise ValueError("api_key must not be empty")
        self.app = app
        self.expected = api_key.encode()
        self.open_paths = {"/health"} | ({"/metrics"} if metrics_without_auth else set())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_paths or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        given = x_api_key = None   # the first of each header
        for k, v in scope.get("headers", ()):
            if k == b"authorization" and given is None:
                given = v
            elif k == b"x-api-key" and x_api_key is None:   # Anthropic's clients send the key so
                x_api_key = v
        scheme, _, key = (given or b"").partition(b" ")
        if ((scheme.lower() == b"bearer" and hmac.compare_digest(key.lstrip(b" "), self.expected))
                or (x_api_key is not None and hmac.compare_digest(x_api_key, self.expected))):
            return await self.app(scope, receive, send)
        body, headers = _error("Incorrect or missing API key: send 'Authorization: Bearer <key>' "
                               "(or 'x-api-key: <key>')", 401,
                               "AuthenticationError", [(b"www-authenticate", b"Bearer")])
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class RequestIdMiddleware:
    """Gives each HTTP request an id: the client's ``X-Request-Id`` (up to ``MAX_ID_LEN``
    printable ASCII characters) or a fresh uuid4 hex, in ``request.state.request_id`` and
    echoed in the response header. When the response ends, logs one ``pagedllm.access`` line
    (id, method, path, status, ``request.state.usage``, E2E seconds), then runs the callables
    in ``request.state.on_end``, however the response ended."""

    MAX_ID_LEN = 128

    def __init__(self, app):
        self.app = app

    @classmethod
    def _client_id(cls, scope) -> str | None:
        for k, v in scope.get("headers", ()):
            if k == b"x-request-id":
                try:
                    text = v.decode("ascii")
                except UnicodeDecodeError:
                    return None
                if 0 < len(text) <= cls.MAX_ID_LEN and text.isprintable():
                    return text
                return None
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = self._client_id(scope) or uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        t0 = time.monotonic()
        status = [500]
        logged = [False]

        def log():
            if logged[0]:
                return
            logged[0] = True
            u = state.get("usage") or {}
            ttft = u.get("ttft")
            access_logger.info(
                "%s %s %s %d prompt_tokens=%s output_tokens=%s ttft=%s e2e=%.3fs", rid, scope.get("method"),
                scope.get("path"), status[0], u.get("prompt_tokens", "-"), u.get("output_tokens", "-"),
                "-" if ttft is None else f"{ttft:.3f}s", time.monotonic() - t0)

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", rid.encode())]}
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                log()

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            log()   # a response cut short (disconnect, error) is logged too
            for fn in state.get("on_end", ()):
                fn()
