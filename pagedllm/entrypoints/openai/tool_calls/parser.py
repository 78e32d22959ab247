"""The tool-call parser interface and the streaming machinery the formats share.

A ``ToolParser`` (one per request) turns a completion's text, as it is generated, into
OpenAI chat deltas: content, or calls (id and name first, then argument fragments).
Subclasses only say where calls start and end. Text is read a character at a time, so the
output does not depend on how it was cut into deltas.

Malformed calls: non-streaming is all or nothing (all content, ``tools_called`` False,
never raises); streaming cannot take back what it sent, so a call that fails after its
name was sent stays sent and the rest goes out as content. Details:
docs/notes/entrypoints.md.
"""
from __future__ import annotations

from typing import Callable, ClassVar

from pagedllm.entrypoints.openai.tool_calls.call_object import CallObjectReader, Read
from pagedllm.entrypoints.openai.tool_calls.calls import ExtractedToolCalls, ToolCall, new_tool_call_id
from pagedllm.entrypoints.openai.tool_calls.json_scan import WHITESPACE


class _StreamedCall:
    def __init__(self, call_id: str, name: str):
        self.id, self.name, self.arguments = call_id, name, ""


class ToolParser:
    """Base class: one instance per request and stream.

    Args:
        new_id: makes tool call ids (default ``new_tool_call_id``).

    Attributes:
        malformed: the text so far had a malformed call.
    """

    name: ClassVar[str] = ""

    def __init__(self, new_id: Callable[[], str] = new_tool_call_id):
        self._new_id = new_id
        self._out: list[dict] = []
        self._calls: list[_StreamedCall] = []
        self._content: list[str] = []
        self.malformed = False
        self._passthrough = False
        self._finished = False
        self._held = ""           # text outside calls not sent yet (whitespace, a partial marker)
        self._block_raw = ""      # the current call's text so far, from its held whitespace on
        self._reader: CallObjectReader | None = None
        self._header_sent = False

    # ---- public API ---------------------------------------------------------------

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """Split a whole ``text`` into calls and content (all or nothing), with a fresh parser."""
        p = type(self)(new_id=self._new_id)
        p.extract_streaming(text)
        p.finish()
        if p.malformed or not p._calls:
            return ExtractedToolCalls(tools_called=False, tool_calls=[], content=text)
        return ExtractedToolCalls(tools_called=True, tool_calls=p.tool_calls,
                                  content="".join(p._content) or None)

    def extract_streaming(self, delta_text: str) -> list[dict]:
        """Take the next piece of the completion; returns the deltas it makes known, in order:
        ``{"content": str}``, a call's first ``{"tool_calls": [{"index", "id", "type":
        "function", "function": {"name", "arguments": ""}}]}``, or a fragment ``{"tool_calls":
        [{"index", "function": {"arguments": str}}]}``.

        Raises:
            RuntimeError: called after ``finish``.
        """
        if self._finished:
            raise RuntimeError("extract_streaming after finish")
        for c in delta_text:
            if self._passthrough:
                self._send_content(c)
            else:
                self._step(c)
        return self._take()

    def finish(self) -> list[dict]:
        """End of the completion: the deltas of what was held back (an open call is malformed)."""
        if not self._finished:
            self._finished = True
            if not self._passthrough:
                self._end()
        return self._take()

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls sent so far, arguments as sent."""
        return [ToolCall(c.id, c.name, c.arguments) for c in self._calls]

    # ---- for subclasses -----------------------------------------------------------

    def _step(self, c: str) -> None:
        """Take one character (not in passthrough)."""
        raise NotImplementedError

    def _end(self) -> None:
        """The text ended (not in passthrough)."""
        raise NotImplementedError

    def _hold_outside(self, c: str, marker: str) -> str | None:
        """Outside calls: hold ``c`` and send what can no longer be whitespace before ``marker``
        or part of it; returns the held text once it ends with the whole marker, else None."""
        self._held += c
        if self._held.endswith(marker):
            held, self._held = self._held, ""
            return held
        # the longest end of the held text that may still become the marker
        keep = next((k for k in range(min(len(marker) - 1, len(self._held)), 0, -1)
                     if marker.startswith(self._held[-k:])), 0)
        body = self._held[:len(self._held) - keep].rstrip(WHITESPACE)
        if body:   # text, with the whitespace before it: sent; whitespace after it: held
            self._send_content(body)
            self._held = self._held[len(body):]
        return None

    def _end_outside(self) -> None:
        """At the end, send held text: all of it without calls, else only if not whitespace."""
        if not self._calls or self._held.strip(WHITESPACE):
            self._send_content(self._held)
        self._held = ""

    def _start_call(self, raw: str) -> None:
        """A call begins; ``raw`` is its text so far (held whitespace and marker)."""
        self._reader, self._header_sent, self._block_raw = CallObjectReader(), False, raw

    def _feed_call(self, c: str) -> Read:
        """Give ``c`` to the current call object, sending what becomes known."""
        r = self._reader.feed(c)
        if r is Read.ERROR:
            self._fail(c)
            return r
        self._block_raw += c
        reader = self._reader
        if not self._header_sent and reader.name is not None:
            self._header_sent = True
            call = _StreamedCall(self._new_id(), reader.name)
            self._calls.append(call)
            self._out.append({"tool_calls": [{"index": len(self._calls) - 1, "id": call.id, "type": "function",
                                              "function": {"name": call.name, "arguments": ""}}]})
        if self._header_sent:
            call = self._calls[-1]
            text = reader.arguments if r is Read.DONE else reader.arguments_text
            if len(text) > len(call.arguments):
                self._send_arguments(text[len(call.arguments):])
        return r

    def _fail(self, rest: str) -> None:
        """The current call is malformed at ``rest`` (not consumed); the rest goes out as content."""
        self.malformed = True
        self._send_content(rest if self._header_sent else self._block_raw + rest)
        self._reader, self._block_raw = None, ""
        self._passthrough = True

    # ---- output -------------------------------------------------------------------

    def _send_content(self, text: str) -> None:
        if not text:
            return
        self._content.append(text)
        if self._out and "content" in self._out[-1]:
            self._out[-1]["content"] += text
        else:
            self._out.append({"content": text})

    def _send_arguments(self, fragment: str) -> None:
        index = len(self._calls) - 1
        self._calls[index].arguments += fragment
        last = self._out[-1]["tool_calls"][0] if self._out and "tool_calls" in self._out[-1] else None
        if last is not None and last["index"] == index and "id" not in last:
            last["function"]["arguments"] += fragment
        else:
            self._out.append({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})

    def _take(self) -> list[dict]:
        out, self._out = self._out, []
        return out
