"""The Hermes tool-call format (vLLM's ``--tool-call-parser hermes``; Hermes 2 Pro,
Qwen 2.5/3, and ``rendering``'s fallback prompt): ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`` blocks; other non-blank text is content. ``<tool_call>`` may be a
special token: detokenize with ``skip_special_tokens=False``."""
from __future__ import annotations

from pagedllm.entrypoints.openai.tool_calls.call_object import Read
from pagedllm.entrypoints.openai.tool_calls.json_scan import WHITESPACE
from pagedllm.entrypoints.openai.tool_calls.parser import ToolParser

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"


class HermesToolParser(ToolParser):
    """``<tool_call>`` JSON blocks (see the module doc and ``ToolParser``)."""

    name = "hermes"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._where = "outside"    # outside | object | close
        self._close = ""           # the part of CALL_END (and whitespace) read so far

    def _step(self, c: str) -> None:
        if self._where == "outside":
            raw = self._hold_outside(c, CALL_START)
            if raw is not None:
                self._start_call(raw)
                self._where = "object"
        elif self._where == "object":
            if self._feed_call(c) is Read.DONE:
                self._where, self._close = "close", ""
        else:   # after the object: whitespace, then CALL_END
            tag = self._close.lstrip(WHITESPACE)
            if (c in WHITESPACE and not tag) or CALL_END.startswith(tag + c):
                self._close += c
                if tag + c == CALL_END:
                    self._where = "outside"
            else:
                self._fail(self._close + c)

    def _end(self) -> None:
        if self._where == "outside":
            self._end_outside()
        else:   # an unterminated call
            self._fail(self._close if self._where == "close" else "")
