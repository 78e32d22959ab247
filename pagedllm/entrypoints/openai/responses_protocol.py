"""The request body of OpenAI's Responses API (``POST /v1/responses``) and its reading as a
chat request: input items as chat messages, function tools in chat's shape, ``text.format``
as ``response_format``. Generation then goes through the chat path (``OpenAIServingChat.
start``), and a chat request's error is renamed to the field a Responses client sent.

Fields the server cannot honour (built-in tools, ``background``, ``include``, ``truncation:
"auto"``, reasoning summaries...) are refused naming them; unknown fields too (docs/api.md).
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, _Strict
from pagedllm.errors import InvalidParameterError, check_unicode_json

INPUT_ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text")
# keys an input item of each type may have (besides "type")
_ITEM_KEYS = {
    "message": ({"role", "content"}, {"id", "status"}),
    "function_call": ({"call_id", "name", "arguments"}, {"id", "status"}),
    "function_call_output": ({"call_id", "output"}, {"id", "status"}),
    "reasoning": (set(), {"id", "summary", "content", "encrypted_content", "status"}),
}
_FUNCTION_TOOL_KEYS = ("type", "name", "description", "parameters", "strict")
# a chat request's parameter -> the Responses field that carried it
_CHAT_NAMES = {"messages": "input", "prompt": "input", "max_completion_tokens": "max_output_tokens",
               "max_tokens": "max_output_tokens", "response_format": "text", "structured_outputs": "text",
               "chat_template_kwargs": "reasoning"}


class TextFormat(_Strict):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with ``name`` and ``schema``."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Strict):
    """``reasoning``: ``effort`` reaches the chat template as ``reasoning_effort``; summaries
    are refused (the server writes none)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesStreamOptions(_Strict):
    include_obfuscation: bool | None = None   # accepted and ignored (no obfuscation padding)


class ResponsesRequest(_Strict):
    """POST /v1/responses. ``max_output_tokens`` unset: up to the rest of max_model_len;
    ``store`` defaults to true (OpenAI's default)."""

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool = True
    previous_response_id: str | None = None
    reasoning: ReasoningConfig | None = None
    truncation: Literal["disabled", "auto"] | None = None
    # refused unless neutral (check_supported)
    background: bool | None = None
    include: list[str] | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    # accepted without effect on the output, as in chat
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    def check_supported(self) -> None:
        """Raises InvalidParameterError naming a field set to a value the server cannot honour."""
        if self.background:
            raise InvalidParameterError("background", "background mode is not supported; send the request and "
                                                      "wait for it (or stream it)")
        if self.include:
            raise InvalidParameterError("include", f"include {self.include[0]!r} is not supported: this server "
                                                   "produces no such output")
        if self.truncation == "auto":
            raise InvalidParameterError("truncation", 'truncation "auto" is not supported (a conversation over '
                                                      'the context length is a 400); send "disabled"')
        if self.max_tool_calls is not None:
            raise InvalidParameterError("max_tool_calls", "max_tool_calls is not supported (it limits built-in "
                                                          "tool calls, which this server does not run)")
        if self.top_logprobs:
            raise InvalidParameterError("top_logprobs", "top_logprobs is not supported by /v1/responses")
        r = self.reasoning
        if r is not None and (r.summary is not None or r.generate_summary is not None):
            raise InvalidParameterError("reasoning", "reasoning summaries are not supported (this server writes "
                                                     "none); leave reasoning.summary unset")
        if self.text is not None and self.text.verbosity not in (None, "medium"):
            raise InvalidParameterError("text", "text.verbosity is not supported (only \"medium\", the default)")
        if self.stream_options is not None and not self.stream:
            raise InvalidParameterError("stream_options", "stream_options is only allowed when stream is true")
        # OpenAI's limits: echoed and kept in the store, so bounded like the prompt is
        if self.metadata is not None:
            if len(self.metadata) > 16:
                raise InvalidParameterError("metadata", f"metadata has {len(self.metadata)} pairs; at most 16")
            for k, v in self.metadata.items():
                if len(k) > 64 or len(v) > 512:
                    raise InvalidParameterError("metadata", f"metadata key {k[:64]!r}: keys are at most 64 "
                                                            "characters and values at most 512")
        for name in ("user", "safety_identifier", "prompt_cache_key"):
            value = getattr(self, name)
            if value is not None and len(value) > 512:
                raise InvalidParameterError(name, f"{name} is {len(value)} characters; at most 512")
        for name in ("instructions", "metadata", "user", "text"):   # echoed in the response
            value = getattr(self, name)
            check_unicode_json(name, value.model_dump(by_alias=True) if name == "text" and value else value)

    def input_items(self) -> list[dict]:
        """``input`` as checked items (a string is one user message); ``type`` is always set.

        Raises:
            InvalidParameterError(param="input"): an item of another type or shape.
        """
        check_unicode_json("input", self.input)
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        if not self.input and self.previous_response_id is None:
            raise InvalidParameterError("input", "input must be a string or a non-empty array of items")
        return [_check_item(i, item) for i, item in enumerate(self.input)]

    def chat_tools(self) -> tuple[list[dict] | None, Any]:
        """(``tools`` in chat's shape or None, ``tool_choice`` in chat's shape or None).

        Raises:
            InvalidParameterError(param="tools" or "tool_choice"): a built-in tool (only
                function tools run here), or a shape chat has no counterpart for.
        """
        tools = None
        if self.tools is not None:
            tools = []
            for i, tool in enumerate(self.tools):
                kind = tool.get("type") if isinstance(tool, dict) else None
                if kind != "function":
                    raise InvalidParameterError(
                        "tools", f"tools[{i}] is a {kind!r} tool, which this server does not run: only function "
                                 'tools ({"type": "function", "name": ...}) are supported')
                extra = sorted(set(tool) - set(_FUNCTION_TOOL_KEYS))
                if extra:
                    raise InvalidParameterError("tools", f"tools[{i}] has unknown keys: {', '.join(extra)} "
                                                         f"(allowed: {', '.join(_FUNCTION_TOOL_KEYS)})")
                tools.append({"type": "function", "function": {k: tool[k] for k in _FUNCTION_TOOL_KEYS[1:]
                                                               if tool.get(k) is not None}})
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or set(choice) != {"type", "name"}:
                raise InvalidParameterError(
                    "tool_choice", f"tool_choice {json.dumps(choice)[:80]} is not supported: send \"none\", "
                                   '"auto", "required" or {"type": "function", "name": ...}')
            choice = {"type": "function", "function": {"name": choice["name"]}}
        return tools, choice

    def response_format(self) -> dict | None:
        """``text.format`` as chat's ``response_format``, or None for plain text.

        Raises:
            InvalidParameterError(param="text"): json_schema without ``name`` / ``schema``.
        """
        f = self.text.format if self.text is not None else None
        if f is None or f.type == "text":
            return None
        if f.type == "json_object":
            return {"type": "json_object"}
        if f.name is None or f.schema_ is None:
            raise InvalidParameterError("text", "text.format of type json_schema needs name and schema")
        return {"type": "json_schema", "json_schema": {"name": f.name, "schema": f.schema_, "strict": f.strict,
                                                       "description": f.description}}

    def to_chat_request(self, items: list[dict], num_previous: int) -> ChatCompletionRequest:
        """The chat request generating this response's output after the conversation
        ``items`` (the previous response's ``num_previous`` first, then this input).

        Raises:
            InvalidParameterError: see ``input_items``, ``chat_tools``, ``response_format``,
                ``conversation_messages``.
        """
        tools, choice = self.chat_tools()
        effort = self.reasoning.effort if self.reasoning is not None else None
        return ChatCompletionRequest.model_validate({
            "model": self.model, "messages": conversation_messages(items, self.instructions, num_previous),
            "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "user": self.user, "stream": self.stream, "tools": tools,
            "tool_choice": choice, "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": self.response_format(),
            "chat_template_kwargs": {"reasoning_effort": effort} if effort is not None else None})

    def echo(self) -> dict:
        """The request fields a response object repeats, defaults filled in."""
        fmt = self.text.format if self.text is not None else None
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "metadata": self.metadata or {}, "parallel_tool_calls": self.parallel_tool_calls is not False,
                "previous_response_id": self.previous_response_id,
                "reasoning": self.reasoning.model_dump() if self.reasoning is not None else None,
                "store": self.store, "temperature": 1.0 if self.temperature is None else self.temperature,
                "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
                "tool_choice": self.tool_choice if self.tool_choice is not None else "auto",
                "tools": self.tools or [], "top_p": 1.0 if self.top_p is None else self.top_p,
                "truncation": "disabled", "user": self.user, "background": False}


def chat_error_as_responses(e: InvalidParameterError) -> InvalidParameterError:
    """``e``, raised naming a chat request's field, naming the Responses field that carried it."""
    name = _CHAT_NAMES.get(e.param)
    msg = str(e)
    if name == "text":
        msg = msg.replace("response_format / structured_outputs", "text.format").replace("response_format",
                                                                                          "text.format")
    elif name is not None:
        msg = msg.replace(e.param, name)
    if e.param == "tools":
        msg = msg.replace(".function.", ".").replace(".function ", " ")
    return InvalidParameterError(name or e.param, msg) if msg != str(e) or name else e


def _check_item(i: int, item) -> dict:
    """One input item, checked (see ``input_items``); an item without ``type`` is a message."""
    where = f"input[{i}]"
    if not isinstance(item, dict):
        raise InvalidParameterError("input", f"{where} must be an object")
    kind = item.get("type", "message")
    if not isinstance(kind, str) or kind not in _ITEM_KEYS:
        raise InvalidParameterError("input", f"{where}.type {kind!r} is not supported (supported: "
                                             f"{', '.join(_ITEM_KEYS)})")
    required, optional = _ITEM_KEYS[kind]
    missing = sorted(required - set(item))
    extra = sorted(set(item) - required - optional - {"type"})
    if missing or extra:
        raise InvalidParameterError("input", f"{where} ({kind}) " + (f"needs {', '.join(missing)}" if missing
                                                                     else f"has unknown keys: {', '.join(extra)}"))
    item = {**item, "type": kind}
    if kind == "message":
        if item["role"] not in INPUT_ROLES:
            raise InvalidParameterError("input", f"{where}.role must be one of {', '.join(INPUT_ROLES)}; "
                                                 f"got {item['role']!r}")
        _text(item["content"], f"{where}.content")
    elif kind in ("function_call", "function_call_output"):
        keys = ("call_id", "name", "arguments") if kind == "function_call" else ("call_id",)
        for k in keys:
            if not isinstance(item[k], str):
                raise InvalidParameterError("input", f"{where}.{k} must be a string")
        if kind == "function_call_output":
            _text(item["output"], f"{where}.output")
    else:
        if item.get("encrypted_content") is not None:
            raise InvalidParameterError("input", f"{where}.encrypted_content cannot be read by this server")
        parts = item.get("content") or []
        if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                  for p in parts):
            raise InvalidParameterError("input", f"{where}.content must be an array of "
                                                 '{"type": "reasoning_text", "text": ...} parts')
    return item


def _text(content, where: str) -> str:
    """Text content: a string, or text parts (``input_text`` / ``output_text``) joined.

    Raises:
        InvalidParameterError(param="input"): another shape (images, files, audio).
    """
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in TEXT_PARTS
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise InvalidParameterError("input", f"{where} must be a string or an array of text parts "
                                         '({"type": "input_text", "text": ...}): this server reads text only')


def conversation_messages(items: list[dict], instructions: str | None, num_previous: int = 0) -> list[dict]:
    """Chat messages of checked ``items``: ``instructions`` first as a system message; a
    ``function_call`` joins the assistant message just before it (as a chat turn's
    ``tool_calls``); a ``function_call_output`` is a ``tool`` message; a ``reasoning``
    item's text becomes the next assistant message's ``reasoning_content``.

    Raises:
        InvalidParameterError(param="input"): a ``function_call_output`` whose ``call_id``
            no earlier ``function_call`` has (its index counted from ``num_previous``).
    """
    messages = [{"role": "system", "content": instructions}] if instructions else []
    calls: set[str] = set()
    reasoning = ""
    for i, item in enumerate(items):
        kind = item["type"]
        if kind == "reasoning":
            reasoning += "".join(p["text"] for p in item.get("content") or [])
            continue
        if kind == "function_call_output" or (kind == "message" and item["role"] != "assistant"):
            reasoning = ""   # a reasoning item belongs to the assistant turn right after it
        if kind == "function_call_output":
            if item["call_id"] not in calls:
                raise InvalidParameterError(
                    "input", f"input[{i - num_previous}] (function_call_output) has call_id {item['call_id']!r}, "
                             "which no function_call before it in the conversation has")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item["output"], "output")})
            continue
        if kind == "function_call":
            calls.add(item["call_id"])
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(call)
                continue
            msg = {"role": "assistant", "content": None, "tool_calls": [call]}
        else:
            msg = {"role": item["role"], "content": _text(item["content"], "content")}
        if msg["role"] == "assistant" and reasoning:
            msg["reasoning_content"], reasoning = reasoning, ""
        messages.append(msg)
    return messages
