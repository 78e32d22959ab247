"""OpenAI tool calling, in pure functions and per-request objects (no engine state):
``request`` (checks the tool fields), ``rendering`` (tools for the chat template),
``registry`` and its parsers (calls read from generated text, whole or streamed),
``constrained`` (the schema of a forced call), ``calls`` (the values)."""
from pagedllm.entrypoints.openai.tool_calls.calls import ExtractedToolCalls, ToolCall, new_tool_call_id
from pagedllm.entrypoints.openai.tool_calls.constrained import (ConstrainedOutputError, parse_constrained_output,
                                                                tool_choice_json_schema)
from pagedllm.entrypoints.openai.tool_calls.parser import ToolParser
from pagedllm.entrypoints.openai.tool_calls.registry import TOOL_PARSERS, get_tool_parser
from pagedllm.entrypoints.openai.tool_calls.rendering import (FALLBACK_PARSER, render_messages_for_template,
                                                              template_supports_tools)
from pagedllm.entrypoints.openai.tool_calls.request import (ToolRequest, refuse_legacy_functions,
                                                            validate_parallel_tool_calls, validate_tool_choice,
                                                            validate_tool_request, validate_tools)

__all__ = [
    "ConstrainedOutputError", "ExtractedToolCalls", "FALLBACK_PARSER", "TOOL_PARSERS", "ToolCall", "ToolParser",
    "ToolRequest", "get_tool_parser", "new_tool_call_id", "parse_constrained_output", "refuse_legacy_functions",
    "render_messages_for_template", "template_supports_tools", "tool_choice_json_schema",
    "validate_parallel_tool_calls", "validate_tool_choice", "validate_tool_request", "validate_tools",
]
