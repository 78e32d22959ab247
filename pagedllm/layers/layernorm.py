"""RMSNorm (Zhang & Sennrich 2019, arXiv:1910.07467), alone or fused with the residual add
that precedes it in a pre-norm decoder layer."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels.cpu import trace
from pagedllm.layers.utils import cpu_kernels_for


def residual_stream(x: torch.Tensor) -> torch.Tensor:
    """The start of a decoder's residual stream from the embeddings ``x`` [T, hidden]: x in
    float32 (x itself when already float32). A 16-bit model keeps its residual sums in
    float32, so the ~2 x num_layers adds each round to float32 rather than to 8 bits of
    mantissa (docs/benchmarks.md, "bfloat16 fidelity")."""
    return x.float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension of ``x`` [..., d] (any
    float dtype), in float32, returned in ``weight``'s dtype (torch's fused ``F.rms_norm``
    when both are float32; otherwise upcast as HF does, the normalised x rounded to the
    weight's dtype and multiplied by it)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(weight.dtype) * weight


class RMSNorm(nn.Module):
    """RMSNorm with a learned ``weight`` [hidden_size] (ones until loaded).

    ``forward(x)`` normalises x [..., hidden_size] (e.g. [T, hidden] or Qwen3's per-head
    [T, heads, head_dim]; any float dtype) into a new tensor in the layer's dtype.
    ``forward(x, residual)`` with x and residual contiguous [T, hidden_size] (residual in
    x's dtype or float32, ``residual_stream``) returns ``(rms_norm(residual + x),
    residual + x)``, the sum in the residual's dtype; on CPU float32 or bfloat16 with the
    C++ kernels (float32 arithmetic) this happens in place (``x`` becomes the normed rows,
    ``residual`` the sum), else with torch ops (new tensors).
    """

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
    """Gemma's RMSNorm, ``x / rms(x) * (1 + w)`` (transformers' ``Gemma3RMSNorm``): the
    checkpoint's ``w`` is loaded as ``1 + w`` (computed in float32, then cast), so the
    forward is ``RMSNorm``'s. Ones-plus-zero until loaded."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__(hidden_size, eps, dtype, device)
        self.weight.weight_loader = self._load

    @staticmethod
    def _load(param: nn.Parameter, loaded: torch.Tensor, shard=None) -> None:
        if loaded.shape != param.shape:
            raise ValueError(f"norm weight of shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
        param.data.copy_((loaded.float() + 1.0).to(param.dtype))
