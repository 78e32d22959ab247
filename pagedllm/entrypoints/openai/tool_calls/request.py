"""Checking a chat request's tool fields: ``tools``, ``tool_choice``,
``parallel_tool_calls``, and the deprecated ``functions`` / ``function_call`` (refused
unless neutral: use ``tools``). A bad value raises ``InvalidParameterError`` naming the
top-level field, with the path inside it in the message. Rules: OpenAI's function tools
(https://platform.openai.com/docs/api-reference/chat/create#chat-create-tools)."""
from __future__ import annotations

import re
from dataclasses import dataclass

from pagedllm.errors import InvalidParameterError, check_unicode_json

TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
TOOL_CHOICE_MODES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolRequest:
    """The tool fields of a request, checked.

    Attributes:
        tools: ``[{"type": "function", "function": {"name", "description"?, "parameters",
            "strict"?}}]`` (``parameters`` defaults to ``EMPTY_PARAMETERS``); may be empty.
        tool_choice: ``"none"``, ``"auto"``, ``"required"``, or the forced function's name.
        parallel_tool_calls: whether the model may make several calls in one turn.
    """

    tools: list[dict]
    tool_choice: str | dict
    parallel_tool_calls: bool

    @property
    def named_function(self) -> str | None:
        """The function ``tool_choice`` forces, or None."""
        return self.tool_choice["function"]["name"] if isinstance(self.tool_choice, dict) else None


def validate_tools(tools) -> list[dict]:
    """Check ``tools``; None means ``[]``.

    Raises:
        InvalidParameterError(param="tools"): not an array of function tools; unknown keys; a
            name not matching ``^[a-zA-Z0-9_-]{1,64}$`` or repeated; a non-string description;
            parameters that are not an object schema; a non-boolean strict; nesting deeper
            than Python's recursion limit allows walking.
    """
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidParameterError("tools", "tools must be an array of tools")
    try:
        check_unicode_json("tools", tools)
    except RecursionError:   # JSON over HTTP cannot nest this deep; a Python caller's can
        raise InvalidParameterError("tools", "tools are nested too deeply") from None
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InvalidParameterError("tools", f"{where} must be an object")
        if tool.get("type") != "function":
            raise InvalidParameterError("tools", f'{where}.type must be "function" (got {tool.get("type")!r}): '
                                                 "only function tools are supported")
        _no_other_keys(tool, ("type", "function"), where)
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise InvalidParameterError("tools", f"{where}.function must be an object")
        _no_other_keys(fn, ("name", "description", "parameters", "strict"), f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise InvalidParameterError("tools", f"{where}.function.name must be 1 to 64 letters, digits, "
                                                 f"underscores or dashes (got {name!r})")
        if name in seen:
            raise InvalidParameterError("tools", f"{where}.function.name: {name!r} is given twice; "
                                                 "function names must be unique")
        seen.add(name)
        if not isinstance(fn.get("description", ""), str):
            raise InvalidParameterError("tools", f"{where}.function.description must be a string")
        params = fn.get("parameters")
        if params is None:
            params = dict(EMPTY_PARAMETERS)
        if not isinstance(params, dict):
            raise InvalidParameterError("tools", f"{where}.function.parameters must be a JSON Schema object")
        if params.get("type", "object") != "object":
            raise InvalidParameterError("tools", f"{where}.function.parameters must describe an object "
                                                 f'("type": "object"), got "type": {params["type"]!r}')
        if not isinstance(fn.get("strict", False), bool):
            raise InvalidParameterError("tools", f"{where}.function.strict must be a boolean")
        out.append({"type": "function", "function": {**fn, "parameters": params}})
    return out


def validate_tool_choice(tool_choice, tools: list[dict]) -> str | dict:
    """Check ``tool_choice`` against the checked ``tools``; None means ``"auto"`` with tools,
    else ``"none"``. Returns ``"none"``, ``"auto"``, ``"required"`` or ``{"type":
    "function", "function": {"name": X}}``.

    Raises:
        InvalidParameterError(param="tool_choice"): another value; ``"required"`` or a
            named function without tools; a named function not among the tools.
    """
    if tool_choice is None:
        return "auto" if tools else "none"
    names = [t["function"]["name"] for t in tools]
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICE_MODES:
            raise InvalidParameterError("tool_choice", f"tool_choice must be one of {', '.join(TOOL_CHOICE_MODES)} "
                                                       f"or a function, got {tool_choice!r}")
        if tool_choice == "required" and not tools:
            raise InvalidParameterError("tool_choice", 'tool_choice "required" needs tools')
        return tool_choice
    if (not isinstance(tool_choice, dict) or tool_choice.get("type") != "function"
            or not isinstance(tool_choice.get("function"), dict) or set(tool_choice) != {"type", "function"}
            or set(tool_choice["function"]) != {"name"}):
        raise InvalidParameterError("tool_choice", 'tool_choice must be "none", "auto", "required" or '
                                                   '{"type": "function", "function": {"name": ...}}')
    name = tool_choice["function"]["name"]
    if name not in names:
        raise InvalidParameterError("tool_choice", f"tool_choice names function {name!r}, which is not among "
                                                   f"the tools ({', '.join(names) or 'none given'})")
    return {"type": "function", "function": {"name": name}}


def validate_parallel_tool_calls(parallel_tool_calls) -> bool:
    """Check ``parallel_tool_calls``; None means True.

    Raises:
        InvalidParameterError(param="parallel_tool_calls"): not a boolean.
    """
    if parallel_tool_calls is None:
        return True
    if not isinstance(parallel_tool_calls, bool):
        raise InvalidParameterError("parallel_tool_calls", "parallel_tool_calls must be a boolean")
    return parallel_tool_calls


def refuse_legacy_functions(functions, function_call) -> None:
    """Refuse ``functions`` / ``function_call`` unless absent, ``[]`` or ``"none"``.

    Raises:
        InvalidParameterError(param="functions" or "function_call"): any other value.
    """
    if functions not in (None, []):
        raise InvalidParameterError("functions", "functions is deprecated and not supported; send the "
                                                 'functions as tools ([{"type": "function", "function": ...}])')
    if function_call not in (None, "none"):
        raise InvalidParameterError("function_call", "function_call is deprecated and not supported; "
                                                     "use tool_choice")


def validate_tool_request(tools=None, tool_choice=None, parallel_tool_calls=None,
                          functions=None, function_call=None) -> ToolRequest:
    """Check all tool fields of a request, in the order above.

    Raises:
        InvalidParameterError: naming the first bad field.
    """
    refuse_legacy_functions(functions, function_call)
    checked = validate_tools(tools)
    return ToolRequest(tools=checked, tool_choice=validate_tool_choice(tool_choice, checked),
                       parallel_tool_calls=validate_parallel_tool_calls(parallel_tool_calls))


def _no_other_keys(obj: dict, allowed: tuple[str, ...], where: str) -> None:
    extra = sorted(set(obj) - set(allowed))
    if extra:
        raise InvalidParameterError("tools", f"{where} has unknown keys: {', '.join(map(str, extra))} "
                                             f"(allowed: {', '.join(allowed)})")
