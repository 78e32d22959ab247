"""Tool calls by constrained decoding (vLLM's scheme): for a named function the output
*is* its arguments object; for ``"required"`` it is a JSON array of ``{"name",
"parameters"}`` objects, one ``anyOf`` alternative per tool (at most one element when
``parallel_tool_calls`` is False). ``"none"`` and ``"auto"`` need no schema."""
from __future__ import annotations

import copy
import json

from pagedllm.entrypoints.openai.tool_calls.calls import ToolCall, new_tool_call_id
from pagedllm.entrypoints.openai.tool_calls.request import EMPTY_PARAMETERS


class ConstrainedOutputError(ValueError):
    """A constrained output that is not an instance of its schema (e.g. cut by ``max_tokens``)."""


def parameters_schema(tool: dict) -> dict:
    """A tool's ``parameters`` schema; ``{"type": "object", "properties": {}}`` when it
    has none or an empty one."""
    return tool["function"].get("parameters") or dict(EMPTY_PARAMETERS)


def tool_choice_json_schema(tools: list[dict], tool_choice: str | dict,
                            parallel_tool_calls: bool = True) -> dict | None:
    """The JSON schema forcing the calls ``tool_choice`` asks for (see the module doc), or None
    for ``"none"`` and ``"auto"``. For ``"required"`` each tool's schema sits inside the array's
    ``anyOf``, so its local references (``#``, ``#/$defs/...``, ``#/definitions/...``,
    ``#/properties/...``) are re-rooted there and resolve as they did in the tool alone;
    two tools may define one ``$defs`` name differently.

    Raises:
        ValueError: ``tool_choice`` names a function that is not among ``tools``.
    """
    if tool_choice in ("none", "auto"):
        return None
    if isinstance(tool_choice, dict):
        return parameters_schema(_tool(tools, tool_choice["function"]["name"]))
    alternatives = []
    for i, tool in enumerate(tools):
        root = f"#/items/anyOf/{i}/properties/parameters"
        params = _rerooted(parameters_schema(tool), root)
        alternatives.append({"properties": {"name": {"type": "string", "const": tool["function"]["name"]},
                                            "parameters": params},
                             "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1,
              "items": {"type": "object", "anyOf": alternatives}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


# Keywords whose values are instances, not schemas (a "$ref" key inside them is data), and
# those whose values map names (which may be any string, "const" too) to schemas.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
                            "dependencies"})


def _rerooted(schema, root: str):
    """A copy of ``schema`` with every local ``$ref`` (``#`` or ``#/<pointer>``) prefixed by the
    JSON pointer ``root`` (``#/...``), where the schema will sit in a larger document."""
    if isinstance(schema, list):
        return [_rerooted(v, root) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = root + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = copy.deepcopy(value)
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):
            out[key] = {name: _rerooted(sub, root) for name, sub in value.items()}
        else:
            out[key] = _rerooted(value, root)
    return out


def parse_constrained_output(text: str, tools: list[dict], tool_choice: str | dict) -> list[ToolCall]:
    """The calls in an output made under ``tool_choice_json_schema(tools, tool_choice)``,
    arguments re-serialised compactly (non-ASCII kept). Only the shape is checked.

    Raises:
        ConstrainedOutputError: not JSON of the expected shape, or an unknown function.
        ValueError: ``tool_choice`` is ``"none"`` or ``"auto"``.
    """
    if tool_choice in ("none", "auto"):
        raise ValueError(f'tool_choice {tool_choice!r} is not constrained; use a ToolParser')
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConstrainedOutputError(f"the constrained output is not valid JSON: {e}") from None
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        if not isinstance(value, dict):
            raise ConstrainedOutputError(f"the arguments of {name} must be a JSON object")
        return [ToolCall(new_tool_call_id(), name, _compact(value))]
    if not isinstance(value, list) or not value:
        raise ConstrainedOutputError("the constrained output must be a non-empty JSON array of calls")
    names = {t["function"]["name"] for t in tools}
    calls = []
    for i, item in enumerate(value):
        if (not isinstance(item, dict) or item.get("name") not in names
                or not isinstance(item.get("parameters"), dict)):
            raise ConstrainedOutputError(f"call {i} of the constrained output is not {{\"name\": one of "
                                         f"{', '.join(sorted(names))}, \"parameters\": {{...}}}}")
        calls.append(ToolCall(new_tool_call_id(), item["name"], _compact(item["parameters"])))
    return calls


def _tool(tools: list[dict], name: str) -> dict:
    for tool in tools:
        if tool["function"]["name"] == name:
            return tool
    raise ValueError(f"tool_choice names {name!r}, which is not among the tools")


def _compact(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
