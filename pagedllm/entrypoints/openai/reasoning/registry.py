"""Reasoning parsers by name, as vLLM's ``--reasoning-parser`` option names them."""
from __future__ import annotations

from pagedllm.entrypoints.openai.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from pagedllm.entrypoints.openai.reasoning.parser import ReasoningParser
from pagedllm.entrypoints.openai.reasoning.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class called ``name``; make one instance per request.

    Raises:
        ValueError: an unknown name (the message names ``--reasoning-parser`` and the known ones).
    """
    try:
        return REASONING_PARSERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"--reasoning-parser: unknown parser {name!r}; "
                         f"known: {', '.join(sorted(REASONING_PARSERS))}") from None
