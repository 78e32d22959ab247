"""Anthropic Messages API request bodies (pydantic, strict; an unknown field is refused by
name) and their conversion to the chat request the chat pipeline renders and samples:
system + messages -> chat messages (``tool_use`` -> the assistant's ``tool_calls``,
``tool_result`` -> a ``tool`` message), tools -> function tools, ``tool_choice`` auto / any /
tool / none -> auto / required / a named function / none. A bad block raises
``InvalidParameterError`` naming ``messages`` (or ``system``, ``tools``, ``tool_choice``) with
the path inside it in the message. Rules: https://docs.anthropic.com/en/api/messages."""
from __future__ import annotations

import json
import re
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.errors import InvalidParameterError, check_unicode_json

TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")
# Keys a block may carry besides its own: cache_control is accepted without effect (prefix
# caching is automatic), as are a text block's citations (the model never sees them).
_BLOCK_KEYS = {"text": ("text", "citations"), "tool_use": ("id", "name", "input"),
               "tool_result": ("tool_use_id", "content", "is_error"), "thinking": ("thinking", "signature"),
               "redacted_thinking": ("data",)}
# An earlier assistant turn's thinking is accepted and left out of the prompt, as Anthropic's
# API strips it from the context.
THINKING_BLOCKS = ("thinking", "redacted_thinking")


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class MessageParam(_Body):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class ToolParam(_Body):
    """A client tool (``type`` "custom" or absent; server tools are refused)."""

    type: Literal["custom"] | None = None
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None   # accepted: forced calls follow input_schema by grammar; auto calls are parsed


class ToolChoiceParam(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingParam(_Body):
    """``budget_tokens`` and ``display`` are accepted; the parser splits what the model thinks."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: str | None = None


class MetadataParam(_Body):
    user_id: str | None = None


class MessagesChatRequest(ChatCompletionRequest):
    """A Messages request as the chat pipeline takes it; its errors name the Messages fields."""

    TOOL_SCHEMA: ClassVar[str] = "tools[].input_schema"

    def api_param_names(self) -> dict[str, str]:
        return {"prompt": "messages", "stop": "stop_sequences", "parallel_tool_calls": "tool_choice"}


class CountTokensRequest(_Body):
    """``POST /v1/messages/count_tokens``: what ``POST /v1/messages`` would render."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None

    @property
    def thinking_enabled(self) -> bool:
        return self.thinking is not None and self.thinking.type != "disabled"

    def sampling_fields(self) -> dict:
        """The chat request's generation fields (none: only the prompt is rendered)."""
        return {}

    def to_chat_request(self) -> MessagesChatRequest:
        """The equivalent chat request.

        Raises:
            InvalidParameterError: a bad block, tool or tool choice (see the module doc).
        """
        tools = chat_tools(self.tools)
        choice, parallel = chat_tool_choice(self.tool_choice, [t["function"]["name"] for t in tools])
        # thinking given: the template's enable_thinking (Qwen3-style templates) follows it
        kwargs = None if self.thinking is None else {"enable_thinking": self.thinking_enabled}
        return MessagesChatRequest.model_validate({
            "model": self.model, "messages": chat_messages(self.system, self.messages),
            "tools": tools or None, "tool_choice": choice, "parallel_tool_calls": parallel,
            "chat_template_kwargs": kwargs, **self.sampling_fields()})


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``. ``metadata.user_id`` is logged; ``service_tier`` and a top-level
    ``cache_control`` are accepted without effect (prefix caching is automatic)."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = False
    metadata: MetadataParam | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    cache_control: dict[str, Any] | None = None

    def sampling_fields(self) -> dict:
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "stop": self.stop_sequences, "stream": bool(self.stream),
                "user": self.metadata.user_id if self.metadata else None}


def chat_tools(tools: list[ToolParam] | None) -> list[dict]:
    """OpenAI function tools of ``tools``.

    Raises:
        InvalidParameterError(param="tools"): a name not matching ``^[a-zA-Z0-9_-]{1,64}$``
            or repeated; an ``input_schema`` that does not describe an object.
    """
    out, seen = [], set()
    for i, t in enumerate(tools or ()):
        if not TOOL_NAME.fullmatch(t.name):
            raise InvalidParameterError("tools", f"tools[{i}].name must be 1 to 64 letters, digits, underscores "
                                                 f"or dashes (got {t.name!r})")
        if t.name in seen:
            raise InvalidParameterError("tools", f"tools[{i}].name: {t.name!r} is given twice; tool names must "
                                                 "be unique")
        seen.add(t.name)
        if t.input_schema.get("type") != "object":
            raise InvalidParameterError("tools", f'tools[{i}].input_schema must describe an object ("type": '
                                                 f'"object"), got "type": {t.input_schema.get("type")!r}')
        fn = {"name": t.name, "parameters": t.input_schema}
        if t.description is not None:
            fn["description"] = t.description
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: ToolChoiceParam | None, names: list[str]) -> tuple[str | dict | None, bool | None]:
    """(OpenAI ``tool_choice``, ``parallel_tool_calls``) of ``choice``; None: the default.

    Raises:
        InvalidParameterError(param="tool_choice"): "any" or "tool" without tools; "tool"
            without a name or naming no tool; a name with another type.
    """
    if choice is None:
        return None, None
    parallel = None if choice.disable_parallel_tool_use is None else not choice.disable_parallel_tool_use
    if choice.type != "tool":
        if choice.name is not None:
            raise InvalidParameterError("tool_choice", 'tool_choice.name goes only with type "tool"')
        if choice.type == "any" and not names:
            raise InvalidParameterError("tool_choice", 'tool_choice "any" needs tools')
        return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel
    if choice.name is None:
        raise InvalidParameterError("tool_choice", 'tool_choice of type "tool" needs the tool\'s name')
    if choice.name not in names:
        raise InvalidParameterError("tool_choice", f"tool_choice names tool {choice.name!r}, which is not among "
                                                   f"the tools ({', '.join(names) or 'none given'})")
    return {"type": "function", "function": {"name": choice.name}}, parallel


def chat_messages(system: str | list[dict] | None, messages: list[MessageParam]) -> list[dict]:
    """The chat conversation of ``system`` and ``messages`` (text as text parts).

    Raises:
        InvalidParameterError: param ``system`` for a system block that is not a text block;
            ``messages`` for an unknown block type or key, a block in the wrong role, a
            ``tool_result`` whose ``tool_use_id`` matches no earlier ``tool_use``, an empty
            content array, or a last message that is not the user's.
    """
    out: list[dict] = []
    if isinstance(system, str) and system:
        check_unicode_json("system", system, "system")
        out.append({"role": "system", "content": [{"type": "text", "text": system}]})
    elif isinstance(system, list) and system:
        out.append({"role": "system", "content": [_text(b, f"system[{j}]", "system") for j, b in enumerate(system)]})
    call_ids: set[str] = set()
    for i, m in enumerate(messages):
        if isinstance(m.content, str):
            blocks = [{"type": "text", "text": m.content}]
        elif not m.content:
            raise InvalidParameterError("messages", f"messages[{i}].content must not be an empty array")
        else:
            blocks = m.content
        if m.role == "assistant":
            out.append(_assistant(i, blocks, call_ids))
        else:
            out += _user(i, blocks, call_ids)
    if messages[-1].role != "user":
        raise InvalidParameterError("messages", f"messages[{len(messages) - 1}]: the last message must have role "
                                                "user (continuing an assistant message, prefill, is not supported)")
    return out


def _kind(block, where: str) -> str:
    if not isinstance(block, dict):
        raise InvalidParameterError("messages", f"{where} must be an object")
    kind = block.get("type")
    if kind not in BLOCK_TYPES:
        raise InvalidParameterError("messages", f"{where}: content blocks of type {kind!r} are not supported "
                                                f"(only {', '.join(BLOCK_TYPES)})")
    extra = sorted(set(block) - {"type", "cache_control", *_BLOCK_KEYS[kind]})
    if extra:
        raise InvalidParameterError("messages", f"{where} has unknown keys: {', '.join(map(str, extra))}")
    check_unicode_json("messages", block, where)
    return kind


def _text(block, where: str, param: str) -> dict:
    """A text block's chat text part."""
    if not isinstance(block, dict) or block.get("type") != "text":
        raise InvalidParameterError(param, f'{where} must be a text block ({{"type": "text", "text": ...}})')
    extra = sorted(set(block) - {"type", "cache_control", *_BLOCK_KEYS["text"]})
    if extra:
        raise InvalidParameterError(param, f"{where} has unknown keys: {', '.join(map(str, extra))}")
    if not isinstance(block.get("text"), str):
        raise InvalidParameterError(param, f"{where}.text must be a string")
    check_unicode_json(param, block["text"], f"{where}.text")
    return {"type": "text", "text": block["text"]}


def _assistant(i: int, blocks: list, call_ids: set[str]) -> dict:
    texts, calls = [], []
    for j, b in enumerate(blocks):
        where = f"messages[{i}].content[{j}]"
        kind = _kind(b, where)
        if kind == "text":
            texts.append(_text(b, where, "messages"))
        elif kind in THINKING_BLOCKS:
            continue
        elif kind == "tool_use":
            if not isinstance(b.get("id"), str) or not b["id"]:
                raise InvalidParameterError("messages", f"{where}.id must be a non-empty string")
            if not isinstance(b.get("name"), str) or not b["name"]:
                raise InvalidParameterError("messages", f"{where}.name must be a non-empty string")
            if not isinstance(b.get("input"), dict):
                raise InvalidParameterError("messages", f"{where}.input must be an object")
            call_ids.add(b["id"])
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b["input"], ensure_ascii=False)}})
        else:
            raise InvalidParameterError("messages", f"{where}: a tool_result block belongs in a user message")
    msg = {"role": "assistant", "content": texts or None}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _user(i: int, blocks: list, call_ids: set[str]) -> list[dict]:
    """A user turn: its tool results as ``tool`` messages, its text as user messages, in order."""
    out, texts = [], []
    for j, b in enumerate(blocks):
        where = f"messages[{i}].content[{j}]"
        kind = _kind(b, where)
        if kind == "text":
            texts.append(_text(b, where, "messages"))
            continue
        if kind == "tool_use" or kind in THINKING_BLOCKS:
            raise InvalidParameterError("messages", f"{where}: a {kind} block belongs in an assistant message")
        if texts:
            out.append({"role": "user", "content": texts})
            texts = []
        tid = b.get("tool_use_id")
        if not isinstance(tid, str) or tid not in call_ids:
            raise InvalidParameterError("messages", f"{where}.tool_use_id {tid!r} matches no tool_use block of an "
                                                    "earlier assistant message")
        content = b.get("content", "")
        if isinstance(content, list):
            content = "".join(_text(p, f"{where}.content[{k}]", "messages")["text"] for k, p in enumerate(content))
        elif not isinstance(content, str):
            raise InvalidParameterError("messages", f"{where}.content must be a string or an array of text blocks")
        is_error = b.get("is_error")
        if is_error is not None and not isinstance(is_error, bool):
            raise InvalidParameterError("messages", f"{where}.is_error must be a boolean")
        out.append({"role": "tool", "tool_call_id": tid, "content": f"Error: {content}" if is_error else content})
    if texts:
        out.append({"role": "user", "content": texts})
    return out
