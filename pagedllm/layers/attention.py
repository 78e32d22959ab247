"""The attention layer of a model: q, k, v in, attention output out, over this layer's
slice of the paged KV cache. Which backend computes it and where the cache lives are the
runner's business (``bind_kv_cache``); the step's batch description comes from the
forward context (``pagedllm/forward_context.py``)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagedllm.forward_context import get_forward_context
from pagedllm.layers.utils import cpu_kernels_for

if TYPE_CHECKING:
    from pagedllm.attention.backend import AttentionBackend


class Attention(nn.Module):
    """Causal self-attention of one layer over the paged KV cache (GQA when
    num_kv_heads < num_heads).

    Args:
        num_heads, head_dim: query heads and their size; scale: softmax scale (usually
            head_dim ** -0.5); num_kv_heads: key/value heads.
        layer_idx: which layer of the KV cache this one reads and writes.
        dtype, device: of q, k and v.
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int, layer_idx: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.num_heads, self.head_dim, self.scale = num_heads, head_dim, scale
        self.num_kv_heads, self.layer_idx = num_kv_heads, layer_idx
        self.backend: AttentionBackend | None = None
        self.kv_cache: Any = None
        # The C++ K/V write reads strided rows in place; the torch ops get a contiguous v
        # (one copy per layer, which their index_copy_ and SDPA read faster).
        self._contiguous_v = cpu_kernels_for(device, dtype) is None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write k, v into the cache at the step's slot mapping, then attend.

        Args:
            q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (rows may be
            strided views of one q|k|v output).

        Returns:
            [T, num_heads * head_dim] in q's dtype.

        Raises:
            RuntimeError: the layer was not bound to a cache (``bind_kv_cache``), or it runs
            outside ``set_forward_context``.
        """
        if self.backend is None:
            raise RuntimeError(f"attention layer {self.layer_idx} has no KV cache: call bind_kv_cache first")
        md = get_forward_context().attn_metadata
        if self._contiguous_v:
            v = v.contiguous()
        return self.backend.forward(q, k, v, self.kv_cache, md, self.scale)


def bind_kv_cache(model: nn.Module, kv_cache: torch.Tensor, backend: AttentionBackend) -> None:
    """Bind every ``Attention`` layer of ``model`` to ``backend`` and to its own layer's
    view of ``kv_cache`` (the backend's whole cache tensor, ``backend.layer_cache(kv_cache,
    layer_idx)``). The runner calls it once, after allocating the cache; binding again
    (a new cache) replaces the previous binding."""
    for m in model.modules():
        if isinstance(m, Attention):
            m.backend, m.kv_cache = backend, backend.layer_cache(kv_cache, m.layer_idx)
