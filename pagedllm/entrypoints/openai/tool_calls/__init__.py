"""OpenAI tool calling, in pure functions and per-request objects (no engine state):

- ``registry`` (``hermes``, ``llama3_json``, on ``parser``, ``call_object``,
  ``json_scan``): calls read from the generated text, whole or streamed.
- ``calls``: the values (``ToolCall``, ``ExtractedToolCalls``, call ids).
"""
from pagedllm.entrypoints.openai.tool_calls.calls import ExtractedToolCalls, ToolCall, new_tool_call_id
from pagedllm.entrypoints.openai.tool_calls.parser import ToolParser
from pagedllm.entrypoints.openai.tool_calls.registry import TOOL_PARSERS, get_tool_parser

__all__ = [
    "ExtractedToolCalls", "TOOL_PARSERS", "ToolCall", "ToolParser", "get_tool_parser", "new_tool_call_id",
]
