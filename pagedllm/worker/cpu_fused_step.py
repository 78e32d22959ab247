"""The CPU twin of a captured step: every decoder layer in one C++ call
(``models/fused_decoder.py``) where the model and the attention backend's kernels allow it,
for any batch (prefill chunks and decodes). Off with ``PAGEDLLM_FUSED_DECODER=0``."""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend
from pagedllm.worker.compiled_step import CompiledStep


class CpuFusedStep(CompiledStep):
    """Runs ``model.forward_fused`` with ``backend``'s kernels and kernel metadata; ``reason``:
    why not (None when it applies)."""

    def __init__(self, model: nn.Module, backend: AttentionBackend):
        self.model, self.backend = model, backend
        self.reason: str | None = self._prepare()

    def _prepare(self) -> str | None:
        prepare = getattr(self.model, "prepare_fused", None)
        if prepare is None:
            return f"{type(self.model).__name__} has no fused form"
        return prepare(self.backend.kernels)

    def run(self, input_ids, positions, common, attn_metadata) -> torch.Tensor | None:
        self.reason = self._prepare()   # cheap once built; rebuilt if the cache was rebound
        if self.reason is not None:
            return None
        md = self.backend.kernel_metadata(attn_metadata)
        if md is None:
            self.reason = "attention metadata other than one cpu_kernel group"
            return None
        return self.model.forward_fused(input_ids, positions, md)

    def compute_path(self) -> tuple[str, str]:
        return ("decoder", "one C++ stack call a step" if self.reason is None else f"per-layer ({self.reason})")
