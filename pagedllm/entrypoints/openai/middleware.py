"""ASGI middleware of the OpenAI server: API-key auth, request ids with one access-log
line per request, and a 500 for an unexpected error that keeps the connection open.

Both are plain ASGI callables rather than Starlette's ``BaseHTTPMiddleware``, so that a
streamed response passes through untouched (no buffering, and a client's disconnect still
reaches the endpoint).
"""
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
    body = json.dumps(error_body(message, None, code, type_)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    return body, headers + (extra_headers or [])


class InternalErrorMiddleware:
    """Answers an exception no endpoint or handler caught with a 500 in OpenAI's error shape
    (``{"error": {"message": "internal error: ...", "type": "internal_error", ...}}``),
    logged with its traceback, and returns normally. Starlette's own last-resort handler
    re-raises after answering, so that uvicorn logs the error and then closes the
    connection: a client's next request on that keep-alive connection failed too. An
    exception after the response has started (a stream; endpoints send their own error
    event there) is re-raised: that response cannot be completed.
    """

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
    """Bearer auth (``Authorization: Bearer KEY``) on every HTTP route except ``/health``
    (and ``/metrics`` when ``metrics_without_auth``). The scheme is matched without regard
    to case and may be followed by several spaces (RFC 9110, section 11.1); the key exactly,
    in constant time (``hmac.compare_digest``). A missing or wrong key gets 401 in OpenAI's
    error shape, with ``WWW-Authenticate: Bearer``.

    Args:
        app: the ASGI app; api_key: the key (non-empty); metrics_without_auth: serve
            ``/metrics`` without it (for a Prometheus scraper).

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
        given = b""
        for k, v in scope.get("headers", ()):
            if k == b"authorization":
                given = v
                break
        scheme, _, key = given.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(key.lstrip(b" "), self.expected):
            return await self.app(scope, receive, send)
        body, headers = _error("Incorrect or missing API key: send 'Authorization: Bearer <key>'", 401,
                               "AuthenticationError", [(b"www-authenticate", b"Bearer")])
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class RequestIdMiddleware:
    """Gives each HTTP request an id: the client's ``X-Request-Id`` if it sent one (up to
    ``MAX_ID_LEN`` printable ASCII characters), else a fresh uuid4 hex. The id is stored in
    ``scope["state"]["request_id"]`` (``request.state.request_id`` in an endpoint) and
    echoed in the response's ``X-Request-Id`` header.

    When the response ends (its last body chunk, for a stream too), one line is logged on
    the ``pagedllm.access`` logger: id, method, path, status, and what the endpoint put in
    ``request.state.usage`` (prompt and output tokens, TTFT in seconds), and E2E seconds.
    Then the callables an endpoint appended to ``request.state.on_end`` run (e.g. to
    release the request's engine id), however the response ended.
    """

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
