"""The Llama 3.x JSON tool-call format (vLLM's ``--tool-call-parser llama3_json``)::

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

The whole completion is the calls (optional whitespace and ``<|python_tag|>``, then call
objects separated by ``;``); one that does not start so is content, one that starts so and
does not continue so is malformed (``ToolParser``)."""
from __future__ import annotations

from pagedllm.entrypoints.openai.tool_calls.call_object import Read
from pagedllm.entrypoints.openai.tool_calls.json_scan import WHITESPACE
from pagedllm.entrypoints.openai.tool_calls.parser import ToolParser

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    """JSON call objects separated by ``;`` (see the module doc and ``ToolParser``)."""

    name = "llama3_json"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._where = "start"     # start | object | between
        self._between = ""        # text after a call object (whitespace and one ";")

    def _step(self, c: str) -> None:
        if self._where == "start":
            self._held += c
            head = self._held.lstrip(WHITESPACE)
            if head.startswith(PYTHON_TAG):
                head = head[len(PYTHON_TAG):].lstrip(WHITESPACE)
            if not head or PYTHON_TAG.startswith(head):
                return
            raw, self._held = self._held, ""
            if head == "{":
                self._start_call(raw[:-1])
                self._where = "object"
                self._feed_call(c)
            else:   # not a call: the whole completion is content
                self._send_content(raw)
                self._passthrough = True
        elif self._where == "object":
            if self._feed_call(c) is Read.DONE:
                self._where, self._between = "between", ""
        elif c in WHITESPACE or (c == ";" and ";" not in self._between):
            self._between += c
        elif c == "{" and ";" in self._between:
            self._start_call(self._between)
            self._where = "object"
            self._feed_call(c)
        else:
            self._fail(self._between + c)

    def _end(self) -> None:
        if self._where == "start":
            self._end_outside()
        elif self._where == "object":
            self._fail("")
        elif ";" in self._between:   # a separator with no call after it
            self._fail(self._between)
