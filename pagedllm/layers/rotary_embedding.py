"""Rotary position embedding (RoPE, Su et al. 2021, arXiv:2104.09864) in HF's rotate-half
form, with the scalings HF configs use."""
from __future__ import annotations

import math

import torch

from pagedllm.forward_context import ForwardContext, get_forward_context
from pagedllm.kernels.cpu import trace
from pagedllm.layers.utils import cpu_kernels_for


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies, float32 [head_dim // 2], with HF's scalings (None/"default",
    "linear", "llama3" as HF's ``_compute_llama3_parameters``). Raises ValueError for another type."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    rtype = None if scaling is None else (scaling.get("rope_type") or scaling.get("type"))
    if rtype in (None, "default"):
        pass
    elif rtype == "linear":
        inv = inv / float(scaling["factor"])
    elif rtype == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wl, high_wl = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wl) & (wavelen <= low_wl)
        inv = torch.where(is_mid, mid, scaled)
    else:
        raise ValueError(f"unsupported rope_scaling type {rtype!r} (supported: linear, llama3)")
    return inv.float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, heads, head_dim] (rotate-half layout) by ``cos``/``sin``
    [T, 1, head_dim // 2]; returns a new tensor."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _joint_view(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q and k as one [T, heads + kv_heads, head_dim] view when sliced from one q|k|v row, else None."""
    T, nh, hd = q.shape
    if (k.shape[0] == T and k.shape[2] == hd and q.stride() == k.stride() and q.stride()[1:] == (hd, 1)
            and q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
            and k.storage_offset() == q.storage_offset() + nh * hd):
        return q.as_strided((T, nh + k.shape[1], hd), q.stride())
    return None


class RotaryEmbedding(torch.nn.Module):
    """RoPE over precomputed cos/sin tables, float32 [max_positions, head_dim // 2]; one
    instance serves every layer (a step's rows looked up once). C++ kernel on CPU fp32/bf16,
    torch ops elsewhere. Raises ValueError for an unsupported ``scaling`` type."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        inv = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        self.register_buffer("cos", freqs.cos().to(device), persistent=False)
        self.register_buffer("sin", freqs.sin().to(device), persistent=False)
        self.dtype = dtype
        self._kernels = cpu_kernels_for(device, dtype)
        self.compute_path = ("rotary", "torch" if self._kernels is None else "C++")
        self._memo: tuple[ForwardContext, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions int64 [T], contiguous [T, head_dim // 2] (memoised per step)."""
        try:
            step = get_forward_context()
        except RuntimeError:    # outside a model step: nothing to share
            step = None
        m = self._memo
        if step is None or m is None or m[0] is not step or m[1] is not positions:
            # the C++ kernel rotates in float32 whatever x's dtype; the torch ops as HF
            # does, with the tables cast to x's dtype
            dtype = torch.float32 if self._kernels is not None else self.dtype
            m = (step, positions, self.cos.index_select(0, positions).to(dtype),
                 self.sin.index_select(0, positions).to(dtype))
            self._memo = None if step is None else m
        return m[2], m[3]

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, heads, head_dim] and k [T, kv_heads, head_dim] at ``positions``; returns
        (q, k): rotated in place on the C++ path, new tensors on the torch path."""
        cos, sin = self.tables(positions)
        qk = _joint_view(q, k)
        if self._kernels is not None:
            with trace("pagedllm::rotary_embedding"):
                for x in ((q, k) if qk is None else (qk,)):
                    self._kernels.rotary_embedding(x, cos, sin)
            return q, k
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        if qk is None:
            return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        qk = apply_rotary(qk, cos, sin)
        return qk[:, : q.shape[1]], qk[:, q.shape[1]:]
