"""Tool calling for one chat request: the tools shown to the model, the constraint that
``tool_choice`` "required" or a named function puts on its output, and the calls read
back from it, whole or as OpenAI's streamed deltas.

Modes (``none``, forced, ``auto`` with ``--tool-call-parser``), their streaming and
``parallel_tool_calls: false`` (at most one call, in every mode): docs/notes/entrypoints.md.
"""
from __future__ import annotations

import logging

from pagedllm.entrypoints.openai.tool_calls import (FALLBACK_PARSER, ConstrainedOutputError, ExtractedToolCalls,
                                                    ToolCall, get_tool_parser, parse_constrained_output,
                                                    render_messages_for_template, template_supports_tools,
                                                    tool_choice_json_schema, validate_tool_request)
from pagedllm.errors import InvalidParameterError
from pagedllm.outputs import CompletionOutput
from pagedllm.sampling_params import StructuredOutputsParams

logger = logging.getLogger("pagedllm")


def render_chat_tools(messages: list[dict], tools: list[dict] | None, template: str | None
                      ) -> tuple[list[dict], list[dict] | None, str | None, bool]:
    """(messages, the template's ``tools`` argument or None, ``render_messages_for_template``'s
    note or None, whether the template shows tools itself) for ``messages`` and the checked
    ``tools``, as both ``/v1/chat/completions`` and ``/tokenize`` render them.

    Raises:
        InvalidParameterError(param="messages"): a malformed tool turn.
    """
    has_tool_turns = any(isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool")
                         for m in messages)
    if not tools and not has_tool_turns:
        return messages, None, None, True
    supports = template_supports_tools(template)
    messages, tools_kw, note = render_messages_for_template(messages, tools or None, supports)
    return messages, tools_kw, note, supports


class ChatTools:
    """Args:
        body: the ``ChatCompletionRequest``; engine: the ``AsyncLLM``;
        enable_auto_tool_choice / tool_call_parser: the server's flags.

    Raises:
        InvalidParameterError: bad ``tools`` / ``tool_choice`` / ``parallel_tool_calls``,
            ``functions`` / ``function_call``, "auto" with tools without
            ``--enable-auto-tool-choice``, ``response_format`` with a forced call.
    """

    def __init__(self, body, engine, enable_auto_tool_choice: bool, tool_call_parser: str | None):
        self.req = validate_tool_request(body.tools, body.tool_choice, body.parallel_tool_calls,
                                         body.functions, body.function_call)
        self.body = body
        self.engine = engine
        choice = self.req.tool_choice
        self.mode = "constrained" if (choice == "required" or isinstance(choice, dict)) else choice
        if self.mode == "auto" and self.req.tools and not enable_auto_tool_choice:
            raise InvalidParameterError(
                "tool_choice", '"auto" tool choice needs the server to run with --enable-auto-tool-choice and '
                               '--tool-call-parser; send tool_choice "required", a named function or "none"')
        self.parser_name = tool_call_parser
        self.note: str | None = None
        self._streams: dict[int, _AutoStream] = {}
        self._constrained_text: dict[int, str] = {}
        self._streamed_calls: set[int] = set()

    # -- before generation ------------------------------------------------------------
    def render(self, messages: list[dict]) -> tuple[list[dict], list[dict] | None]:
        """(messages, tools for the template's ``tools`` variable or None)."""
        template = self.body.chat_template or getattr(self.engine.tokenizer, "chat_template", None)
        messages, tools_kw, note, supports = render_chat_tools(messages, self.req.tools, template)
        if note:
            self.note = note
            logger.info("%s", note)
        if not supports:
            self.parser_name = FALLBACK_PARSER   # the text fallback asks for Hermes' format
        return messages, tools_kw

    def constraint(self) -> StructuredOutputsParams | None:
        """The structured-output constraint of a forced call, else None."""
        if self.mode != "constrained":
            return None
        rf = self.body.response_format
        if self.body.structured_outputs is not None or (rf is not None and rf.type != "text"):
            raise InvalidParameterError("response_format", "response_format / structured_outputs cannot be "
                                                           f"combined with tool_choice {self._choice_name()}")
        schema = tool_choice_json_schema(self.req.tools, self.req.tool_choice, self.req.parallel_tool_calls)
        return StructuredOutputsParams(json=schema)

    def _choice_name(self) -> str:
        c = self.req.tool_choice
        return f"naming {c['function']['name']!r}" if isinstance(c, dict) else f'"{c}"'

    def _reads_calls(self) -> bool:
        return bool(self.req.tools) and self.mode in ("auto", "constrained")

    # -- after generation ---------------------------------------------------------------
    def message(self, c: CompletionOutput) -> tuple[dict, str | None]:
        """The assistant message of a whole completion and its finish reason."""
        if not self._reads_calls():
            return {"role": "assistant", "content": c.text}, c.finish_reason
        if self.mode == "constrained":
            calls = self._constrained_calls(c)
            if calls is None:
                return {"role": "assistant", "content": c.text}, c.finish_reason
            return self._calls_message(None, self._allowed(calls)), "tool_calls"
        got = self._auto_calls(c.text)
        if got is None:
            return {"role": "assistant", "content": c.text}, c.finish_reason
        return self._calls_message(got.content, self._allowed(got.tool_calls)), "tool_calls"

    def _allowed(self, calls: list[ToolCall]) -> list[ToolCall]:
        if self.req.parallel_tool_calls or len(calls) <= 1:
            return calls
        logger.info("parallel_tool_calls is false: %d further tool call(s) left out", len(calls) - 1)
        return calls[:1]

    def _auto_calls(self, text: str) -> ExtractedToolCalls | None:
        """The calls parser P reads in a whole ``text`` (``ExtractedToolCalls``), or None: no
        call, a malformed one, or an undeclared function (then the text is content)."""
        got = get_tool_parser(self.parser_name)().extract_tool_calls(text)
        if not got.tools_called:
            return None
        declared = {t["function"]["name"] for t in self.req.tools}
        unknown = sorted({t.name for t in got.tool_calls} - declared)
        if unknown:
            logger.info("tool call to undeclared function(s) %s returned as content", ", ".join(unknown))
            return None
        return got

    def _constrained_calls(self, c: CompletionOutput) -> list[ToolCall] | None:
        """The forced calls, or None when the output was cut before the JSON closed."""
        if c.finish_reason != "stop":
            return None
        try:
            return parse_constrained_output(c.text, self.req.tools, self.req.tool_choice)
        except ConstrainedOutputError as e:
            logger.warning("constrained tool-call output did not parse: %s", e)
            return None

    @staticmethod
    def _call_deltas(calls: list[ToolCall]) -> list[dict]:
        """Whole calls as streamed deltas: id and name, then the arguments in one fragment."""
        out = []
        for i, t in enumerate(calls):
            out.append({"tool_calls": [{"index": i, "id": t.id, "type": "function",
                                        "function": {"name": t.name, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": i, "function": {"arguments": t.arguments}}]})
        return out

    @staticmethod
    def _calls_message(content: str | None, calls: list[ToolCall]) -> dict:
        return {"role": "assistant", "content": content, "tool_calls": [t.to_openai() for t in calls]}

    def stream(self, index: int, delta_text: str, done: bool) -> list[dict]:
        """The chat deltas of sequence ``index``'s next piece of text (``done``: its last)."""
        if not self._reads_calls():
            return [{"content": delta_text}] if delta_text else []
        if self.mode == "constrained":
            text = self._constrained_text.get(index, "") + delta_text
            self._constrained_text[index] = text
            if not done:
                return []
            try:
                calls = parse_constrained_output(text, self.req.tools, self.req.tool_choice)
            except ConstrainedOutputError:   # cut by max_tokens before the JSON closed
                return [{"content": text}] if text else []
            self._streamed_calls.add(index)
            return self._call_deltas(self._allowed(calls))
        st = self._streams.get(index)
        if st is None:
            st = self._streams[index] = _AutoStream(get_tool_parser(self.parser_name)())
        st.text += delta_text
        out: list[dict] = []
        if not st.holding:
            got = st.parser.extract_streaming(delta_text) if delta_text else []
            if done:
                got += st.parser.finish()
            for d in got:
                if "content" not in d:
                    st.holding = True      # a call began: the rest waits for the end
                    break
                out.append(d)
                st.sent += d["content"]
        if not done or not st.holding:
            return out
        st.result = self._auto_calls(st.text)
        if st.result is None:              # not calls after all: the held text is content
            rest = st.text[len(st.sent):]
            return out + ([{"content": rest}] if rest else [])
        out += self._call_deltas(self._allowed(st.result.tool_calls))
        rest = (st.result.content or "")[len(st.sent):]
        return out + ([{"content": rest}] if rest else [])

    def finish_reason(self, c: CompletionOutput) -> str | None:
        """A streamed sequence's finish reason: ``tool_calls`` when it made calls."""
        if not self._reads_calls():
            return c.finish_reason
        if self.mode == "constrained":
            made = c.index in self._streamed_calls
            return "tool_calls" if made and c.finish_reason == "stop" else c.finish_reason
        st = self._streams.get(c.index)
        return "tool_calls" if st is not None and st.result is not None else c.finish_reason


class _AutoStream:
    """One streamed sequence under ``tool_choice`` "auto" (text so far, what was sent, calls)."""

    def __init__(self, parser):
        self.parser = parser
        self.text = ""
        self.sent = ""
        self.holding = False
        self.result = None
