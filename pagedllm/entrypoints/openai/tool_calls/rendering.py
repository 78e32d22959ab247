"""Showing tools, tool calls and tool results to a model through its chat template.

A template that uses the ``tools`` variable (Llama 3.1, Qwen 2.5, Hermes, ...) renders
them itself: it gets the tools as the ``tools`` argument, and the messages as HF
templates expect them (an assistant's ``tool_calls[].function.arguments`` as an object,
a tool message's ``tool_call_id`` kept).

A template that does not (plain ChatML, e.g. SmolLM2) would drop them silently, so they
are written into the messages in the Hermes format, the one the ``hermes`` parser reads
back (``FALLBACK_PARSER``): the tools and the reply format in the system message,
each assistant call as a ``<tool_call>`` block in its content, and each tool result as a
``user`` message wrapping it in ``<tool_response>`` (as Hermes 2 Pro and Qwen 2.5
templates do; consecutive results share one message). Roles stay ones that every
template knows, and the model reads results where its training put them.
"""
from __future__ import annotations

import json
import re

from pagedllm.entrypoints.openai.tool_calls.hermes import CALL_END, CALL_START
from pagedllm.errors import InvalidParameterError

FALLBACK_PARSER = "hermes"

TOOLS_SYSTEM_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""

FALLBACK_NOTE = ("tools rendered into the system prompt as text (Hermes <tool_call> format) because the "
                 "model's chat template does not support tools")
HISTORY_NOTE = ("tool calls and results rendered into the messages as text (Hermes <tool_call> format) because "
                "the model's chat template does not support tools")

_TOOLS_IN_TEMPLATE = re.compile(r"(\{\{|\{%)[^}]*?\btools\b")


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether the Jinja ``chat_template`` reads the ``tools`` variable (found with
    jinja2's ``meta.find_undeclared_variables``; a template jinja2 cannot parse, e.g. one
    with transformers' ``{% generation %}`` tag, is searched with a regex instead)."""
    if not chat_template:
        return False
    try:
        import jinja2
        from jinja2 import meta
        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
        return "tools" in meta.find_undeclared_variables(env.parse(chat_template))
    except Exception:   # jinja2 missing, or a syntax it does not know
        return bool(_TOOLS_IN_TEMPLATE.search(chat_template))


def render_messages_for_template(messages: list[dict], tools: list[dict] | None,
                                 template_supports_tools: bool
                                 ) -> tuple[list[dict], list[dict] | None, str | None]:
    """Prepare a conversation and its tools for ``apply_chat_template``.

    Args:
        messages: OpenAI chat messages (content a string, text parts or null).
        tools: the checked tools (``request.validate_tools``), or None / ``[]``.
        template_supports_tools: see ``template_supports_tools``.

    Returns:
        (messages, tools to pass as the template's ``tools`` argument or None, note): the
        note is None, or, when tools or tool messages were written into the text (see the
        module doc), a short sentence saying so, for a response header and the log.
        The input is not modified. Messages that are not objects, or ``messages`` that is
        not an array, are passed on as they are, for ``normalize_chat_messages`` to refuse.

    Raises:
        InvalidParameterError(param="messages"): an assistant ``tool_calls`` that is not
            an array of ``{"id"?, "type": "function", "function": {"name": str,
            "arguments": str}}``; a tool message without a string ``tool_call_id``.
    """
    tools = tools or None
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return messages, tools if template_supports_tools else None, None
    out = [dict(m) for m in messages]
    for i, msg in enumerate(out):
        if msg.get("role") == "assistant" and msg.get("tool_calls") is not None:
            msg["tool_calls"] = [_check_call(i, j, tc) for j, tc in enumerate(_as_list(i, msg["tool_calls"]))]
        if msg.get("role") == "tool" and not isinstance(msg.get("tool_call_id"), str):
            raise InvalidParameterError("messages", f"messages[{i}].tool_call_id must be a string")
    if template_supports_tools:
        for msg in out:
            if msg.get("tool_calls"):
                msg["tool_calls"] = [{**tc, "function": {**tc["function"],
                                                         "arguments": _arguments_value(tc["function"]["arguments"])}}
                                     for tc in msg["tool_calls"]]
        return out, tools, None

    rewritten = False
    names_by_id = {}
    rendered: list[dict] = []
    for msg in out:
        role = msg.get("role")
        if role == "assistant" and msg.get("tool_calls"):
            rewritten = True
            blocks = []
            for tc in msg["tool_calls"]:
                names_by_id[tc.get("id")] = tc["function"]["name"]
                call = {"name": tc["function"]["name"], "arguments": _arguments_value(tc["function"]["arguments"])}
                blocks.append(f"{CALL_START}\n{json.dumps(call, ensure_ascii=False)}\n{CALL_END}")
            text = _text(msg.get("content"))
            msg = {k: v for k, v in msg.items() if k != "tool_calls"}
            msg["content"] = "\n".join(([text] if text else []) + blocks)
        elif role in ("tool", "function"):
            rewritten = True
            name = msg.get("name") or names_by_id.get(msg.get("tool_call_id"))
            result = {k: v for k, v in (("name", name), ("tool_call_id", msg.get("tool_call_id"))) if v}
            result["content"] = _text(msg.get("content"))
            block = f"<tool_response>\n{json.dumps(result, ensure_ascii=False)}\n</tool_response>"
            if rendered and rendered[-1].get("_tool_results"):
                rendered[-1]["content"] += "\n" + block
                continue
            msg = {"role": "user", "content": block, "_tool_results": True}
        rendered.append(msg)
    for msg in rendered:
        msg.pop("_tool_results", None)
    if tools:
        prompt = TOOLS_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if rendered and rendered[0].get("role") in ("system", "developer") and _text(rendered[0].get("content")):
            rendered[0] = {**rendered[0], "content": _text(rendered[0]["content"]) + "\n\n" + prompt}
        elif rendered and rendered[0].get("role") in ("system", "developer"):
            rendered[0] = {**rendered[0], "content": prompt}
        else:
            rendered.insert(0, {"role": "system", "content": prompt})
    return rendered, None, FALLBACK_NOTE if tools else HISTORY_NOTE if rewritten else None


def _as_list(i: int, tool_calls) -> list:
    if not isinstance(tool_calls, list):
        raise InvalidParameterError("messages", f"messages[{i}].tool_calls must be an array")
    return tool_calls


def _check_call(i: int, j: int, tc) -> dict:
    where = f"messages[{i}].tool_calls[{j}]"
    fn = tc.get("function") if isinstance(tc, dict) else None
    if (not isinstance(fn, dict) or tc.get("type", "function") != "function"
            or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str)):
        raise InvalidParameterError("messages", f'{where} must be {{"id": ..., "type": "function", "function": '
                                                '{"name": string, "arguments": string}}')
    return tc


def _arguments_value(arguments: str):
    """Arguments as the object HF templates expect; a string that is not a JSON object
    (a model's malformed arguments, echoed back by the client) is left as it is."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    return value if isinstance(value, dict) else arguments


def _text(content) -> str:
    """Message content as text: a string, or text parts joined; null is ``""``. Other
    shapes are left for ``normalize_chat_messages`` to refuse."""
    if content is None:
        return ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    return content
