"""Reasoning read from generated text: a ``<think>`` ... ``</think>`` block, then the
answer. ``ReasoningParser.extract`` splits a whole output; ``ReasoningStream.feed`` splits
it as it arrives, holding back only what may still be part of a tag, so the split never
depends on how the text was cut into deltas and always equals ``extract``'s.

The rules, for both (``s`` is the output with leading whitespace removed):
- ``enable_thinking`` False: nothing is reasoning; the whole output is the answer.
- ``s`` opens with ``<think>``: reasoning is what follows it up to the first ``</think>``,
  the answer everything after that tag (the whitespace before ``<think>`` is dropped).
- otherwise, ``starts_in_reasoning`` (the prompt opened the block): the output up to the
  first ``</think>`` is reasoning; else the whole output is the answer.
- no ``</think>`` after reasoning began (cut by ``max_tokens``): all of it is reasoning.
Empty parts are None. A ``constrained`` output (a grammar from its first token) never
starts in reasoning: only a ``<think>`` block the grammar allowed is reasoning.
"""
from __future__ import annotations

from typing import ClassVar

START = "<think>"
END = "</think>"


class ReasoningParser:
    """One request's reasoning rules (see the module doc); subclasses set ``name`` and
    ``implicit_start``.

    Args:
        enable_thinking: False when the request's ``chat_template_kwargs`` say
            ``"enable_thinking": false`` (``thinking_enabled`` reads them).
        constrained: the output was generated under a grammar from its first token.

    Attributes:
        starts_in_reasoning: output that does not open with ``<think>`` is reasoning
            until ``</think>`` (``implicit_start``, unless ``constrained``).
    """

    name: ClassVar[str] = ""
    #: the model's chat template opens the think block in the prompt
    implicit_start: ClassVar[bool] = False
    start_tag: ClassVar[str] = START
    end_tag: ClassVar[str] = END

    def __init__(self, enable_thinking: bool = True, constrained: bool = False):
        self.enable_thinking = enable_thinking
        self.starts_in_reasoning = self.implicit_start and not constrained

    @staticmethod
    def thinking_enabled(chat_template_kwargs: dict | None) -> bool:
        """False only for ``{"enable_thinking": false}`` (JSON false, as the templates test it)."""
        return (chat_template_kwargs or {}).get("enable_thinking") is not False

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, answer) of a whole output; either None when empty."""
        if not self.enable_thinking:
            return None, text or None
        s = text.lstrip()
        if s.startswith(self.start_tag):
            body = s[len(self.start_tag):]
        elif self.starts_in_reasoning:
            body = text
        else:
            return None, text or None
        reasoning, tag, answer = body.partition(self.end_tag)
        if not tag:
            return body or None, None
        return reasoning or None, answer or None

    def stream(self) -> ReasoningStream:
        """A fresh streaming state for one output of this request."""
        return ReasoningStream(self)


class ReasoningStream:
    """One output split as it arrives: ``feed`` each delta, then ``finish`` once. Joined,
    the reasoning parts equal ``extract``'s reasoning and the answer parts its answer
    (``""`` for None). Made by ``ReasoningParser.stream``."""

    def __init__(self, parser: ReasoningParser):
        self._start, self._end = parser.start_tag, parser.end_tag
        self._implicit = parser.starts_in_reasoning
        self._where = "start" if parser.enable_thinking else "answer"   # start | reasoning | answer
        self._held = ""
        self.finished = False

    def feed(self, delta_text: str) -> tuple[str, str]:
        """(reasoning, answer) that ``delta_text`` makes known, each ``""`` when none.

        Raises:
            RuntimeError: called after ``finish``.
        """
        if self.finished:
            raise RuntimeError("feed after finish")
        if self._where == "answer":
            return "", delta_text
        self._held += delta_text
        if self._where == "start":
            s = self._held.lstrip()
            if len(s) < len(self._start) and self._start.startswith(s):
                return "", ""                      # still whitespace or a part of <think>
            if s.startswith(self._start):
                self._held = s[len(self._start):]
            elif not self._implicit:
                self._where, held, self._held = "answer", self._held, ""
                return "", held
            self._where = "reasoning"
        return self._reasoning()

    def finish(self) -> tuple[str, str]:
        """(reasoning, answer) still held at the end of the output: a partial tag."""
        if self.finished:
            return "", ""
        self.finished = True
        held, self._held = self._held, ""
        if self._where == "start" and not self._implicit:
            return "", held
        return held, ""

    def _reasoning(self) -> tuple[str, str]:
        held = self._held
        i = held.find(self._end)
        if i >= 0:
            self._where, self._held = "answer", ""
            return held[:i], held[i + len(self._end):]
        # keep the longest end of the text that may still become </think>
        keep = next((k for k in range(min(len(self._end) - 1, len(held)), 0, -1)
                     if self._end.startswith(held[-k:])), 0)
        self._held = held[len(held) - keep:]
        return held[:len(held) - keep], ""
