"""Errors in Anthropic's shape (https://docs.anthropic.com/en/api/errors) on the Messages
routes: ``{"type": "error", "error": {"type", "message"}}``. The server's handlers, its auth
and its last-resort 500 answer in OpenAI's shape; ``AnthropicErrorShape`` rewrites those
answers on paths under ``/v1/messages`` only, so every error there has Anthropic's shape and
the OpenAI routes keep theirs. A started stream ends with an ``error`` event instead."""
from __future__ import annotations

import json

from pagedllm.errors import EngineDeadError, ServerShuttingDownError

PREFIX = "/v1/messages"
# Anthropic's error type of an HTTP status; another 4xx is invalid_request_error, 5xx api_error.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               529: "overloaded_error"}


def error_body(message: str, type_: str) -> dict:
    """Anthropic's error shape."""
    return {"type": "error", "error": {"type": type_, "message": message}}


def from_openai(body: dict, status: int, retry_after: bool) -> dict:
    """Anthropic's error body for an OpenAI error body ``{"error": {"message", "param", ...}}``
    answered with ``status``: the message names ``param`` (prefixed when it does not already);
    a 503 with ``Retry-After`` (the server at capacity) is ``overloaded_error``."""
    err = body["error"]
    message, param = str(err.get("message", "")), err.get("param")
    if param and param not in message:
        message = f"{param}: {message}"
    if status == 503 and retry_after:
        return error_body(message, "overloaded_error")
    return error_body(message, ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error"))


def stream_error_body(e: BaseException) -> dict:
    """The body of a failed stream's ``error`` event: ``overloaded_error`` when the server is
    shutting down (retry elsewhere), else ``api_error``."""
    if isinstance(e, ServerShuttingDownError):
        return error_body(str(e), "overloaded_error")
    if isinstance(e, EngineDeadError):
        return error_body(f"the engine has died: {e}", "api_error")
    return error_body(str(e), "api_error")


def _is_messages_path(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


class AnthropicErrorShape:
    """ASGI middleware: on paths under ``/v1/messages``, a response with status >= 400 whose
    JSON body has OpenAI's error shape is sent in Anthropic's (``from_openai``); everything
    else passes through unbuffered."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not _is_messages_path(scope.get("path", "")):
            return await self.app(scope, receive, send)
        start: dict | None = None
        chunks: list[bytes] = []

        async def rewrite(message):
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message
                return
            if start is None:
                return await send(message)
            if message["type"] != "http.response.body":
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = b"".join(chunks)
            headers = list(start.get("headers", ()))
            try:
                parsed = json.loads(body)
                if not (isinstance(parsed, dict) and isinstance(parsed.get("error"), dict)):
                    raise ValueError("not OpenAI's error shape")
            except ValueError:
                pass
            else:
                retry = any(k.lower() == b"retry-after" for k, _ in headers)
                body = json.dumps(from_openai(parsed, start["status"], retry), ensure_ascii=True,
                                  separators=(",", ":")).encode()
                headers = [(k, v) for k, v in headers if k.lower() not in (b"content-length", b"content-type")]
                headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, rewrite)
