"""The runner's hook for a model step run as one unit instead of layer by layer from Python:
a replayed CUDA graph (``worker/cuda_graph.py``) or, its CPU twin, the fused C++ decoder
stack (``worker/cpu_fused_step.py``). Each says per step whether it applies; the runner
runs the model eagerly when it does not. ``make_compiled_step`` picks one per device."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from pagedllm.attention.backend import CommonAttentionMetadata


class CompiledStep(ABC):
    """One way to run a step's forward as a unit."""

    @abstractmethod
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, common: CommonAttentionMetadata,
            attn_metadata: Any) -> torch.Tensor | None:
        """Hidden states float32 [T, hidden] (before the final norm) for ``input_ids`` and
        ``positions`` int64 [T] with the step's metadata, as the model's ``forward`` gives them;
        None when this step is not one it runs (the runner then runs the model eagerly)."""

    @abstractmethod
    def compute_path(self) -> tuple[str, str]:
        """("decoder", how the decoder runs) for the start-up line."""


def make_compiled_step(runner) -> CompiledStep | None:
    """The CPU's fused stack on the CPU, CUDA graphs on CUDA (unless ``--enforce-eager``),
    for ``runner`` (a ``ModelRunner`` whose KV cache is bound); None elsewhere."""
    if runner.device.type == "cpu":
        from pagedllm.worker.cpu_fused_step import CpuFusedStep

        return CpuFusedStep(runner.model, runner.attn)
    if runner.device.type == "cuda":
        from pagedllm.worker.cuda_graph import CudaGraphStep

        return CudaGraphStep.for_runner(runner)
    return None
