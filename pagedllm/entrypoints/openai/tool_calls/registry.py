"""Tool-call parsers by name, as vLLM's ``--tool-call-parser`` option names them."""
from __future__ import annotations

from pagedllm.entrypoints.openai.tool_calls.hermes import HermesToolParser
from pagedllm.entrypoints.openai.tool_calls.llama3_json import Llama3JsonToolParser
from pagedllm.entrypoints.openai.tool_calls.parser import ToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser)}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class called ``name``; make one instance per request.

    Raises:
        ValueError: an unknown name (the message names ``--tool-call-parser`` and the known ones).
    """
    try:
        return TOOL_PARSERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"--tool-call-parser: unknown parser {name!r}; "
                         f"known: {', '.join(sorted(TOOL_PARSERS))}") from None
