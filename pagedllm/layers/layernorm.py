"""RMSNorm (Zhang & Sennrich 2019, arXiv:1910.07467), alone or fused with the residual add
that precedes it in a pre-norm decoder layer."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels.cpu import trace
from pagedllm.layers.utils import cpu_kernels_for


def residual_stream(x: torch.Tensor) -> torch.Tensor:
    """The residual stream's start from embeddings x [T, hidden]: x in float32 (why:
    docs/benchmarks.md §11)."""
    return x.float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension, in float32, returned in
    ``weight``'s dtype (the normalised x rounded to it first, as HF)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(weight.dtype) * weight


class RMSNorm(nn.Module):
    """RMSNorm with ``weight`` [hidden_size]. ``forward(x)``: new tensor in the layer's dtype;
    ``forward(x, residual)`` (contiguous [T, hidden_size], residual in x's dtype or float32) →
    ``(rms_norm(residual + x), residual + x)``, in place on the C++ path."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self._kernels = cpu_kernels_for(device, dtype)
        self.compute_path = ("rms_norm", "torch" if self._kernels is None else "C++")

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        if self._kernels is not None:
            with trace("pagedllm::fused_add_rms_norm"):
                self._kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        residual = residual + x
        return rms_norm(residual, self.weight, self.eps), residual


class GemmaRMSNorm(RMSNorm):
    """Gemma's ``x / rms(x) * (1 + w)``: the checkpoint's w is loaded as ``1 + w``."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__(hidden_size, eps, dtype, device)
        self.weight.weight_loader = self._load

    @staticmethod
    def _load(param: nn.Parameter, loaded: torch.Tensor, shard=None) -> None:
        if loaded.shape != param.shape:
            raise ValueError(f"norm weight of shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
        param.data.copy_((loaded.float() + 1.0).to(param.dtype))
