"""The values a tool-call parser produces: one call (``ToolCall``), a parsed completion
(``ExtractedToolCalls``), and OpenAI-style call ids."""
from __future__ import annotations

import secrets
import string
from dataclasses import dataclass, field

_ID_ALPHABET = string.ascii_letters + string.digits


def new_tool_call_id() -> str:
    """A fresh id as OpenAI's: ``"call_"`` + 24 random letters and digits (from
    ``secrets``, so ids of concurrent requests do not repeat)."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(frozen=True)
class ToolCall:
    """One function call of a completion.

    Attributes:
        id: the call id (``"call_..."``), which the client echoes as a tool message's
            ``tool_call_id``.
        name: the function name the model wrote.
        arguments: the arguments as a JSON text (an object), as OpenAI's
            ``function.arguments``: a string, not a parsed value.
    """

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        """The call as an element of a chat message's ``tool_calls``."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ExtractedToolCalls:
    """A whole completion split into tool calls and content.

    Attributes:
        tools_called: True when ``tool_calls`` is non-empty.
        tool_calls: the calls in the order the model wrote them.
        content: the text that is not a call (None when there is none); the whole text
            when ``tools_called`` is False.
    """

    tools_called: bool
    tool_calls: list[ToolCall] = field(default_factory=list)
    content: str | None = None
