"""Reasoning for one chat request (``--reasoning-parser``): each choice's output split into
``reasoning_content`` (and ``reasoning``, vLLM's newer name) and the answer, which alone
goes on to tool-call parsing; whole or as streamed deltas; and
``completion_tokens_details.reasoning_tokens``. Without a parser every method passes
the output through unchanged. Rules: reasoning/parser.py; fields: docs/api.md."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from pagedllm.entrypoints.openai.reasoning import ReasoningStream, get_reasoning_parser
from pagedllm.outputs import CompletionOutput


class ChatReasoning:
    """Args:
        parser_name: the server's ``--reasoning-parser`` (None: off).
        chat_template_kwargs: the request's (``enable_thinking``).
        constrained: the request's output is under a grammar (structured outputs, a forced
            tool call), which applies from the first token.
    """

    def __init__(self, parser_name: str | None, chat_template_kwargs: dict | None, constrained: bool):
        self.parser = None
        if parser_name is not None:
            cls = get_reasoning_parser(parser_name)
            self.parser = cls(cls.thinking_enabled(chat_template_kwargs), constrained)
        self._streams: dict[int, ReasoningStream] = {}
        self._reasoning: dict[int, str] = {}    # choice index -> its reasoning text

    def split(self, c: CompletionOutput) -> tuple[str | None, CompletionOutput]:
        """(reasoning or None, ``c`` with only its answer as ``text``) of a whole choice."""
        if self.parser is None:
            return None, c
        reasoning, answer = self.parser.extract(c.text)
        self._reasoning[c.index] = reasoning or ""
        return reasoning, dataclasses.replace(c, text=answer or "")

    def message(self, message: dict, reasoning: str | None) -> dict:
        """The assistant ``message`` with the reasoning fields (a parser is on); an answer
        that was all reasoning has ``content`` null."""
        if self.parser is None:
            return message
        if message.get("content") == "" and not message.get("tool_calls"):
            message["content"] = None
        return {**message, "reasoning_content": reasoning, "reasoning": reasoning}

    def stream(self, index: int, delta_text: str, done: bool,
               answer: Callable[[int, str, bool], list[dict]]) -> list[dict]:
        """Choice ``index``'s chat deltas for its next text (``done``: its last): reasoning
        deltas, then what ``answer(index, answer_text, done)`` makes of the answer part."""
        if self.parser is None:
            return answer(index, delta_text, done)
        st = self._streams.get(index)
        if st is None:
            st = self._streams[index] = self.parser.stream()
        reasoning, text = st.feed(delta_text)
        if done:
            r, t = st.finish()
            reasoning, text = reasoning + r, text + t
        out = [{"reasoning_content": reasoning, "reasoning": reasoning}] if reasoning else []
        self._reasoning[index] = self._reasoning.get(index, "") + reasoning
        return out + answer(index, text, done)

    async def reasoning_tokens(self, engine) -> int | None:
        """The choices' reasoning, re-tokenized (no special tokens) with ``engine``'s
        tokenizer, summed; None without a parser."""
        if self.parser is None:
            return None
        return sum([len(await engine.tokenize(t, add_special_tokens=False))
                    for t in self._reasoning.values() if t])
