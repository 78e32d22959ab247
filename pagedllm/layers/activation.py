"""Gated activations of the MLP (SwiGLU, Shazeer 2020, arXiv:2002.05202)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels.cpu import trace
from pagedllm.layers.utils import cpu_kernels_for


class SiluAndMul(nn.Module):
    """SiLU(gate) * up for the fused gate|up projection's output: x [T, 2I] (gate in the
    first I columns, up in the last I; rows may be strided) → new [T, I] in x's dtype. C++
    kernel on CPU float32/bfloat16 when built (float32 arithmetic, one rounding), torch ops
    elsewhere."""

    def __init__(self, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self._kernels = cpu_kernels_for(device, dtype)
        self.compute_path = ("silu_and_mul", "torch" if self._kernels is None else "C++")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        if self._kernels is not None:
            out = x.new_empty(x.shape[0], d)
            with trace("pagedllm::silu_and_mul"):
                self._kernels.silu_and_mul(out, x)
            return out
        return F.silu(x[:, :d]) * x[:, d:]
