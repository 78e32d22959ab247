"""Rotary position embedding (RoPE, Su et al. 2021, arXiv:2104.09864) in HF's rotate-half
form, with the scalings HF configs use."""
from __future__ import annotations

import math

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies, float32 [head_dim // 2].

    Scalings: ``None``/``default``; ``linear`` (positions divided by ``factor``);
    ``llama3`` (Llama 3.1's wavelength-banded scaling, as in Meta's reference code and
    HF's ``_compute_llama3_parameters``).

    Raises:
        ValueError: any other ``rope_type`` (named in the message).
    """
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


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables, float32 [max_positions, head_dim // 2]."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 device: torch.device):
        super().__init__()
        inv = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        self.register_buffer("cos", freqs.cos().to(device), persistent=False)
        self.register_buffer("sin", freqs.sin().to(device), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for ``positions`` (int64 [T]) as [T, 1, head_dim // 2] in ``dtype``."""
        return (self.cos.index_select(0, positions).unsqueeze(1).to(dtype),
                self.sin.index_select(0, positions).unsqueeze(1).to(dtype))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, heads, head_dim] (rotate-half layout); returns a new tensor."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
