"""The values a tool-call parser produces: one call (``ToolCall``), a parsed completion
(``ExtractedToolCalls``), and OpenAI-style call ids."""
from __future__ import annotations

import secrets
import string
from dataclasses import dataclass, field

_ID_ALPHABET = string.ascii_letters + string.digits


def new_tool_call_id() -> str:
    """A fresh OpenAI-style id: ``"call_"`` + 24 random letters and digits (``secrets``)."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(frozen=True)
class ToolCall:
    """One function call of a completion.

    Attributes:
        id: the call id (``"call_..."``), echoed by the client as ``tool_call_id``.
        name: the function name the model wrote.
        arguments: the arguments as a JSON text (an object), as OpenAI's ``function.arguments``.
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
    """A whole completion split into tool calls (in the model's order; ``tools_called`` when
    any) and ``content`` (the rest, None when empty; the whole text when no call)."""

    tools_called: bool
    tool_calls: list[ToolCall] = field(default_factory=list)
    content: str | None = None
