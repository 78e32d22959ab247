"""DeepSeek-R1 (vLLM's ``--reasoning-parser deepseek_r1``): its chat template ends the
prompt with ``<think>\\n``, so the output starts inside the think block and usually shows
only ``</think>``; an output that still opens with ``<think>`` (older templates) is read
the same way. Without ``</think>`` the whole output is reasoning."""
from __future__ import annotations

from pagedllm.entrypoints.openai.reasoning.parser import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    """Reasoning up to the first ``</think>``, whether or not ``<think>`` opens the output."""

    name = "deepseek_r1"
    implicit_start = True
