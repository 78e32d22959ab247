"""Gated activations of the MLP (SwiGLU and GeGLU, Shazeer 2020, arXiv:2002.05202)."""
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


class GeluAndMul(nn.Module):
    """GELU(gate) * up (GeGLU) for the fused gate|up output: x [T, 2I] → new [T, I] in x's
    dtype, in torch ops. ``approximate="tanh"`` is transformers' ``gelu_pytorch_tanh``
    (Gemma), ``"none"`` the exact erf form."""

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
    """The gated activation called ``name`` in a HF config (``hidden_act`` /
    ``hidden_activation``): ``"silu"`` -> ``SiluAndMul`` (SwiGLU), ``"gelu_pytorch_tanh"``
    -> ``GeluAndMul("tanh")``, ``"gelu"`` -> ``GeluAndMul("none")`` (GeGLU).

    Raises:
        ValueError: another name (named, with the supported ones).
    """
    if name not in _ACT_AND_MUL:
        raise ValueError(f"unsupported hidden activation {name!r}; supported: {', '.join(_ACT_AND_MUL)}")
    approximate = _ACT_AND_MUL[name]
    return SiluAndMul(dtype, device) if approximate is None else GeluAndMul(approximate)
