"""The four APIs ``bench serve`` speaks, one class each: ``completions`` and ``chat``
(OpenAI), ``responses`` (OpenAI's Responses API) and ``messages`` (Anthropic's Messages
API). Each owns its path, its request body built from the dataset's payload (a prompt for
completions, a chat message list for the other three), and its reading of a stream event or
a whole JSON answer: generated text, usage, the error it carries (and its status-like
code, which decides whether the client retries), the answer's end (``finished``) and the
stream's.

Usage is read into one shape, :class:`Usage` (prompt, output and cached prompt tokens), so
runs through different APIs compare token for token; Messages' ``input_tokens`` exclude the
cached tokens, so its prompt is ``input_tokens + cache_read_input_tokens +
cache_creation_input_tokens``. Chat messages map to Responses' ``instructions`` + ``input``
message items and to Messages' ``system`` + ``messages``, text unchanged, so a server that
renders all three through one chat template sees the same prompt tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .serve_options import BenchConfig

__all__ = ["ENDPOINT_TYPES", "CHAT_KINDS", "Usage", "Event", "Endpoint", "endpoint", "error_message",
           "error_status"]

#: Every ``--endpoint-type`` besides ``auto``.
ENDPOINT_TYPES = ("completions", "chat", "responses", "messages")
#: The endpoint types whose payload is a chat message list.
CHAT_KINDS = ("chat", "responses", "messages")


@dataclass
class Usage:
    """Token counts of one answer, None where the server did not report them."""

    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None


@dataclass
class Event:
    """What one stream event carries: ``text`` generated (answer or reasoning), ``usage``
    (the API's raw usage fields, merged over the stream's events), ``error`` (the server's
    message), ``error_code`` (with an error: its HTTP-like status, :func:`error_status`;
    None: the error names none, taken as the server's fault), ``started`` (the event belongs
    to the answer), ``finished`` (the answer is complete: a ``finish_reason``, Responses'
    ``response.completed`` / ``response.incomplete``, Messages' ``stop_reason`` or
    ``message_stop``), ``done`` (the stream's last)."""

    text: str = ""
    usage: dict | None = None
    error: str | None = None
    error_code: int | None = None
    started: bool = False
    finished: bool = False
    done: bool = False


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _message_of(err: Any) -> str:
    """The message of an error object (``{"message": ...}``) or the object as text."""
    if isinstance(err, dict) and err.get("message") is not None:
        return str(err["message"])
    return str(err)


#: HTTP-like statuses of named error codes and types: OpenAI's (``code`` / ``type``), the
#: Responses API's event codes, Anthropic's ``error.type`` and pagedllm's own stream errors.
_NAMED_STATUS = {
    "invalid_request_error": 400, "invalid_prompt": 400, "context_length_exceeded": 400, "bad_request": 400,
    "authentication_error": 401, "invalid_api_key": 401, "permission_error": 403, "not_found_error": 404,
    "model_not_found": 404, "request_too_large": 413, "rate_limit_error": 429, "rate_limit_exceeded": 429,
    "api_error": 500, "server_error": 500, "internal_error": 500, "service_unavailable": 503,
    "overloaded_error": 529,
}


def error_status(err: Any) -> int | None:
    """The HTTP-like status of an error object: its ``code`` when that is a number (or a
    numeric string), else its named ``code`` or ``type`` looked up (Anthropic's
    ``overloaded_error`` 529 and ``api_error`` 500, ``rate_limit_error`` 429,
    ``invalid_request_error`` 400, OpenAI's ``server_error`` 500, ...); None when it names
    no status this table knows (the client then takes it as the server's fault)."""
    if not isinstance(err, dict):
        return None
    code = err.get("code")
    if isinstance(code, int) and not isinstance(code, bool):
        return code
    if isinstance(code, str) and code.strip().isdigit():
        return int(code)
    for name in (code, err.get("type")):
        if isinstance(name, str) and name in _NAMED_STATUS:
            return _NAMED_STATUS[name]
    return None


def error_message(text: str) -> str:
    """The message of an HTTP error body: ``error.message`` of OpenAI's shape
    (``{"error": {"message"}}``) and of Anthropic's (``{"type": "error", "error": {"type",
    "message"}}``), else the body's text; at most 200 characters."""
    try:
        obj = json.loads(text)
    except ValueError:
        return text.strip()[:200]
    if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
        return _message_of(obj["error"])[:200]
    return text.strip()[:200]


class Endpoint:
    """The OpenAI shape shared by completions and chat (``choices``, ``usage`` with
    ``prompt_tokens``, ``completion_tokens``, ``prompt_tokens_details.cached_tokens``)."""

    kind = "completions"
    path = "/v1/completions"

    def body(self, cfg: "BenchConfig", payload: Any, max_tokens: int) -> dict:
        """The streamed request JSON for ``payload`` under ``cfg`` (model, temperature; chat
        and completions also ``stream_options`` and ``ignore_eos``); ``--extra-body`` is
        merged by the caller. Raises ``ValueError`` for messages this API cannot carry."""
        b: dict = {"model": cfg.model, "max_tokens": int(max_tokens), "stream": True, "temperature": cfg.temperature}
        if self.kind == "chat":
            b["messages"] = payload
        else:
            b["prompt"] = payload
        if cfg.stream_usage:
            b["stream_options"] = {"include_usage": True}
        if cfg.ignore_eos:
            b["ignore_eos"] = True
        return b

    def event(self, obj: dict) -> Event:
        """One ``data:`` object of the stream."""
        if obj.get("error"):
            return Event(error=_message_of(obj["error"]), error_code=error_status(obj["error"]))
        parts = []
        finished = False
        for c in obj.get("choices") or []:
            if not isinstance(c, dict):
                continue
            finished = finished or bool(c.get("finish_reason"))
            t = c.get("text")
            if t is None:
                delta = c.get("delta") or {}
                t = (delta.get("content") or "") + (delta.get("reasoning_content") or delta.get("reasoning") or "")
            if t:
                parts.append(t)
        usage = obj.get("usage") if isinstance(obj.get("usage"), dict) else None
        return Event(text="".join(parts), usage=usage, started=bool(obj.get("choices")), finished=finished)

    def whole(self, obj: dict) -> tuple[str, dict | None]:
        """(text, raw usage) of a whole JSON answer (a server that ignored ``stream``)."""
        text = "".join(c.get("text") or (c.get("message") or {}).get("content") or ""
                       for c in obj.get("choices") or [] if isinstance(c, dict))
        return text, obj.get("usage") if isinstance(obj.get("usage"), dict) else None

    # the usage object's keys: prompt tokens, output tokens, the details holding cached_tokens
    _USAGE_KEYS = ("prompt_tokens", "completion_tokens", "prompt_tokens_details")

    def usage(self, raw: dict | None) -> Usage:
        """The counts of a raw usage object."""
        raw = raw or {}
        prompt, output, details_key = self._USAGE_KEYS
        details = raw.get(details_key) or {}
        return Usage(_int(raw.get(prompt)), _int(raw.get(output)),
                     _int(details.get("cached_tokens")) if isinstance(details, dict) else None)


class ChatEndpoint(Endpoint):
    kind = "chat"
    path = "/v1/chat/completions"


def _split_system(messages: list[dict], kind: str) -> tuple[str | None, list[dict]]:
    """(the leading system message's text, the other messages); a system message elsewhere
    or a role other than system, user and assistant raises ``ValueError`` naming ``kind``."""
    system = None
    rest = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "system" and i == 0:
            system = m.get("content")
        elif role in ("user", "assistant"):
            rest.append({"role": role, "content": m.get("content")})
        else:
            raise ValueError(f"--endpoint-type {kind}: message {i} has role {role!r}; only a leading system "
                             "message, then user and assistant messages, map to this API")
    return system, rest


class ResponsesEndpoint(Endpoint):
    """``/v1/responses``: the system message as ``instructions``, the others as ``message``
    input items; ``max_output_tokens``; ``store: false`` (nothing kept on the server).
    Text from ``response.output_text.delta`` (and ``response.reasoning_text.delta``); usage
    from ``response.completed`` / ``response.incomplete``, which also finish the answer and
    end the stream; errors from an ``error`` event (its ``code``) or ``response.failed`` (its
    ``response.error.code``)."""

    kind = "responses"
    path = "/v1/responses"
    _TEXT = ("response.output_text.delta", "response.reasoning_text.delta")
    _END = ("response.completed", "response.incomplete")

    def body(self, cfg: "BenchConfig", payload: Any, max_tokens: int) -> dict:
        system, rest = _split_system(payload, self.kind)
        b: dict = {"model": cfg.model, "input": [{"type": "message", **m} for m in rest],
                   "max_output_tokens": int(max_tokens), "stream": True, "store": False,
                   "temperature": cfg.temperature}
        if system is not None:
            b["instructions"] = system
        return b

    def event(self, obj: dict) -> Event:
        t = obj.get("type")
        if t == "error":
            err = obj.get("error") if isinstance(obj.get("error"), dict) else obj
            return Event(error=_message_of(err), error_code=error_status(err))
        if t == "response.failed":
            err = (obj.get("response") or {}).get("error")
            return Event(error=_message_of(err or "response.failed"), error_code=error_status(err))
        if t in self._TEXT:
            return Event(text=str(obj.get("delta") or ""), started=True)
        if t in self._END:
            usage = (obj.get("response") or {}).get("usage")
            return Event(usage=usage if isinstance(usage, dict) else None, started=True, finished=True, done=True)
        return Event(started=isinstance(t, str))

    def whole(self, obj: dict) -> tuple[str, dict | None]:
        text = "".join(p.get("text") or "" for item in obj.get("output") or [] if isinstance(item, dict)
                       and item.get("type") == "message" for p in item.get("content") or [] if isinstance(p, dict))
        return text, obj.get("usage") if isinstance(obj.get("usage"), dict) else None

    _USAGE_KEYS = ("input_tokens", "output_tokens", "input_tokens_details")


class MessagesEndpoint(Endpoint):
    """``/v1/messages`` (Anthropic): the system message as ``system``, the others as
    ``messages`` with string content; ``max_tokens``. Text from ``content_block_delta``
    (``text_delta``, ``thinking_delta``); usage from ``message_start`` (input and cache
    fields; its ``output_tokens`` is a placeholder and dropped) updated by ``message_delta``;
    a ``message_delta`` with a ``stop_reason`` finishes the answer and ``message_stop`` ends
    the stream; errors from an ``error`` event, whose ``error.type`` gives the status
    (``overloaded_error`` and ``api_error`` the server's, retried; ``invalid_request_error`` the
    request's)."""

    kind = "messages"
    path = "/v1/messages"

    def body(self, cfg: "BenchConfig", payload: Any, max_tokens: int) -> dict:
        system, rest = _split_system(payload, self.kind)
        b: dict = {"model": cfg.model, "max_tokens": int(max_tokens), "stream": True,
                   "temperature": cfg.temperature, "messages": rest}
        if system is not None:
            b["system"] = system
        return b

    def event(self, obj: dict) -> Event:
        t = obj.get("type")
        if t == "error" or obj.get("error"):
            err = obj.get("error") or obj
            return Event(error=_message_of(err), error_code=error_status(err))
        if t == "message_start":
            usage = dict((obj.get("message") or {}).get("usage") or {})
            usage.pop("output_tokens", None)
            return Event(usage=usage, started=True)
        if t == "content_block_delta":
            d = obj.get("delta") or {}
            return Event(text=str(d.get("text") or d.get("thinking") or ""), started=True)
        if t == "message_delta":
            usage = obj.get("usage")
            stop = (obj.get("delta") or {}).get("stop_reason") if isinstance(obj.get("delta"), dict) else None
            return Event(usage=usage if isinstance(usage, dict) else None, started=True, finished=bool(stop))
        return Event(started=isinstance(t, str), finished=t == "message_stop", done=t == "message_stop")

    def whole(self, obj: dict) -> tuple[str, dict | None]:
        text = "".join(b.get("text") or "" for b in obj.get("content") or []
                       if isinstance(b, dict) and b.get("type") == "text")
        return text, obj.get("usage") if isinstance(obj.get("usage"), dict) else None

    def usage(self, raw: dict | None) -> Usage:
        raw = raw or {}
        parts = [_int(raw.get(k)) for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")]
        prompt = None if parts[0] is None else sum(p or 0 for p in parts)
        return Usage(prompt, _int(raw.get("output_tokens")), parts[1])


_ENDPOINTS = {e.kind: e for e in (Endpoint(), ChatEndpoint(), ResponsesEndpoint(), MessagesEndpoint())}


def endpoint(kind: str) -> Endpoint:
    """The API of endpoint type ``kind`` (one of ``ENDPOINT_TYPES``); ``KeyError`` otherwise."""
    return _ENDPOINTS[kind]
