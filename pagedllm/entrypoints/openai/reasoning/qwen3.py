"""Qwen3 (vLLM's ``--reasoning-parser qwen3``): the model writes the whole
``<think>...</think>`` block itself; an output that does not open with ``<think>`` is all
answer. With ``enable_thinking: false`` the template puts an empty block in the prompt and
nothing in the output is reasoning. (Templates that open ``<think>`` in the prompt, as
Qwen3's 2507 thinking models do, need ``deepseek_r1``.)"""
from __future__ import annotations

from pagedllm.entrypoints.openai.reasoning.parser import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    """Reasoning only inside a ``<think>`` block that opens the output."""

    name = "qwen3"
    implicit_start = False
