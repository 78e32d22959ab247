"""Reasoning parsers (``--reasoning-parser``): a model's ``<think>`` block split from its
answer, in pure functions over text (no engine, no tokenizer), for every API's serving
class. Per request: ``parser = get_reasoning_parser(name)(enable_thinking, constrained)``;
a whole output: ``parser.extract(text) -> (reasoning, answer)``; a stream: ``st =
parser.stream()``, ``st.feed(delta) -> (reasoning, answer)`` per delta, then
``st.finish()``. Rules: ``parser``'s module doc; the API fields: docs/api.md."""
from pagedllm.entrypoints.openai.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from pagedllm.entrypoints.openai.reasoning.parser import ReasoningParser, ReasoningStream
from pagedllm.entrypoints.openai.reasoning.qwen3 import Qwen3ReasoningParser
from pagedllm.entrypoints.openai.reasoning.registry import REASONING_PARSERS, get_reasoning_parser

__all__ = ["DeepSeekR1ReasoningParser", "Qwen3ReasoningParser", "REASONING_PARSERS", "ReasoningParser",
           "ReasoningStream", "get_reasoning_parser"]
