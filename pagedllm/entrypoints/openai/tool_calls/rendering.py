"""Showing tools, tool calls and tool results to a model through its chat template.

A template that reads ``tools`` gets them as its argument, and the messages as HF templates
expect them. A template that does not (plain ChatML) gets them written into the messages in
the Hermes format the ``hermes`` parser reads back (``FALLBACK_PARSER``). Details:
docs/notes/entrypoints.md.
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
    """Whether the Jinja ``chat_template`` reads the ``tools`` variable (jinja2's
    ``meta.find_undeclared_variables``; a regex for a template jinja2 cannot parse)."""
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
    """Prepare a conversation and its tools for ``apply_chat_template``; the input is not
    modified, and non-object messages pass through for ``normalize_chat_messages`` to refuse.

    Args:
        messages: OpenAI chat messages (content a string, text parts or null).
        tools: the checked tools (``request.validate_tools``), or None / ``[]``.
        template_supports_tools: see ``template_supports_tools``.

    Returns:
        (messages, the template's ``tools`` argument or None, note): note is None, or a short
        sentence for a response header and the log when tools were written into the text.

    Raises:
        InvalidParameterError(param="messages"): a malformed assistant ``tool_calls``; a tool
            message without a string ``tool_call_id``, or with one that no earlier assistant
            message's ``tool_calls`` has.
    """
    tools = tools or None
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return messages, tools if template_supports_tools else None, None
    out = [dict(m) for m in messages]
    call_ids: set = set()   # the ids of the calls so far: a tool message answers one of them
    for i, msg in enumerate(out):
        if msg.get("role") == "assistant" and msg.get("tool_calls") is not None:
            msg["tool_calls"] = [_check_call(i, j, tc) for j, tc in enumerate(_as_list(i, msg["tool_calls"]))]
            call_ids.update(tc.get("id") for tc in msg["tool_calls"])
        if msg.get("role") == "tool":
            if not isinstance(msg.get("tool_call_id"), str):
                raise InvalidParameterError("messages", f"messages[{i}].tool_call_id must be a string")
            if msg["tool_call_id"] not in call_ids:   # as OpenAI, and as Responses and Messages here
                raise InvalidParameterError("messages", f"messages[{i}].tool_call_id {msg['tool_call_id']!r} "
                                                        "matches no tool_calls[].id of an earlier assistant message")
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
            or not isinstance(tc.get("id", ""), str)
            or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str)):
        raise InvalidParameterError("messages", f'{where} must be {{"id": string, "type": "function", "function": '
                                                '{"name": string, "arguments": string}}')
    return tc


def _arguments_value(arguments: str):
    """Arguments as the object HF templates expect; a non-object string is left as it is."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    return value if isinstance(value, dict) else arguments


def _text(content) -> str:
    """Message content as text (text parts joined; null is ``""``); other shapes unchanged."""
    if content is None:
        return ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    return content
