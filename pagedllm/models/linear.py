"""Linear layers with weights pre-packed for oneDNN on the CPU.

On the CPU in float32, ``F.linear`` goes to MKL's sgemm, which re-packs the weight on
every call and, for few rows, picks other kernels than for many. oneDNN's inner product
(``torch.ops.mkldnn._linear_pointwise``, the op torch.compile's CPU backend emits for a
frozen linear) takes a weight reordered once into its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``). Measured on this project's 2-core AVX2
machine (fp32, SmolLM2-135M shapes): 64 rows 110-124 GFLOP/s vs 92-104 for ``F.linear``,
the 49152-row LM head 116 vs 51; 2048 rows 128-139 vs 118-126. Each output row is also
bitwise independent of the other rows in the batch (``F.linear`` is not below 16 rows),
which keeps greedy outputs independent of batching.

Elsewhere (CUDA, half precision, no oneDNN, or ``PAGEDLLM_ONEDNN=0``) the plain
``F.linear`` runs.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F

from pagedllm import envs


def onednn_packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights for ``device``/``dtype`` are packed for oneDNN (CPU float32 only)."""
    return (torch.device(device).type == "cpu" and dtype == torch.float32
            and torch.backends.mkldnn.is_available()
            and envs.onednn_enabled())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """Reorder a float32 [out_features, in_features] weight into oneDNN's layout.

    Returns:
        an opaque oneDNN tensor for :func:`linear`; ``weight`` is not modified.
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None = None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``: x [T, in] → [T, out], in x's dtype.

    Args:
        x: [T, in_features]; weight: [out_features, in_features] (unused when ``packed``
        is given; may then be an empty placeholder); packed: :func:`pack_weight`'s result
        or None; bias: [out_features] or None.
    """
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    return F.linear(x, weight, bias)
