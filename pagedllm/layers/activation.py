"""Gated activations of the MLP (SwiGLU and GeGLU, Shazeer 2020, arXiv:2002.05202)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels.cpu import trace
from pagedllm.layers.utils import cpu_kernels_for


class SiluAndMul(nn.Module):
    """SiLU(gate) * up: x [T, 2I] (gate first) → new [T, I] in x's dtype; C++ on CPU fp32/bf16."""

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


class GeluAndMul(nn.Module):
    """GELU(gate) * up: x [T, 2I] → new [T, I]; ``approximate`` "tanh" (Gemma) or "none"."""

    def __init__(self, approximate: str = "tanh"):
        super().__init__()
        if approximate not in ("tanh", "none"):
            raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
        self.approximate = approximate
        self.compute_path = ("gelu_and_mul", "torch")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[:, :d], approximate=self.approximate) * x[:, d:]


# HF's ``hidden_act`` names of the gated MLPs' activations -> GeluAndMul's approximation
# (None: SiLU).
_ACT_AND_MUL = {"silu": None, "gelu_pytorch_tanh": "tanh", "gelu": "none"}


def get_act_and_mul(name: str, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The gated activation for a HF ``hidden_act`` ("silu", "gelu_pytorch_tanh", "gelu").
    Raises ValueError for another name."""
    if name not in _ACT_AND_MUL:
        raise ValueError(f"unsupported hidden activation {name!r}; supported: {', '.join(_ACT_AND_MUL)}")
    approximate = _ACT_AND_MUL[name]
    return SiluAndMul(dtype, device) if approximate is None else GeluAndMul(approximate)
