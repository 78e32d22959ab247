"""The attention layer of a model: q, k, v in, attention output out, over this layer's
slice of the paged KV cache (bound by the runner, ``bind_kv_cache``; the step's metadata
from the forward context). With an fp8 cache each layer stores fp8(k / k_scale) and reads
element * scale, as vLLM's attention layer; the scales come from the checkpoint (names:
``kv_scale_target``) or are 1.0. Calibrating scales: docs/notes/attention.md."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagedllm.attention.backend import FP8_DTYPES
from pagedllm.forward_context import get_forward_context

if TYPE_CHECKING:
    from pagedllm.attention.backend import AttentionBackend


class Attention(nn.Module):
    """Causal self-attention of one layer over the paged KV cache (GQA when num_kv_heads <
    num_heads); ``sliding_window``: a query at p sees keys p - window + 1 .. p (None: all).
    ``k_scale``, ``v_scale``: the checkpoint's KV-cache scales (1.0 without), fp8 caches only."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int, layer_idx: int,
                 dtype: torch.dtype, device: torch.device, sliding_window: int | None = None):
        super().__init__()
        self.num_heads, self.head_dim, self.scale = num_heads, head_dim, scale
        self.num_kv_heads, self.layer_idx = num_kv_heads, layer_idx
        self.sliding_window = sliding_window
        self.attn_group = 0   # which of the step's attention metadata this layer reads (bind_kv_cache)
        self.backend: AttentionBackend | None = None
        self.kv_cache: Any = None
        self.k_scale = self.v_scale = 1.0
        self._scales = (1.0, 1.0)   # what the backend applies (bind_kv_cache)
        self._contiguous_v = False  # the backend's ``contiguous_v`` (bind_kv_cache)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write k, v into the cache at the step's slots, then attend. q [T, num_heads, head_dim],
        k, v [T, num_kv_heads, head_dim] (may be strided) → [T, num_heads * head_dim] in q's dtype.
        Raises RuntimeError when not bound (``bind_kv_cache``) or outside ``set_forward_context``."""
        if self.backend is None:
            raise RuntimeError(f"attention layer {self.layer_idx} has no KV cache: call bind_kv_cache first")
        md = get_forward_context().attn_metadata
        if isinstance(md, list):
            md = md[self.attn_group]
        if self._contiguous_v:
            v = v.contiguous()
        return self.backend.forward(q, k, v, self.kv_cache, md, self.scale, *self._scales)

    @property
    def kv_scales(self) -> tuple[float, float]:
        """(k_scale, v_scale) the backend applies: the checkpoint's with an fp8 cache, else 1.0."""
        return self._scales

    def set_kv_scale(self, which: str, value: torch.Tensor, name: str) -> None:
        """Set ``k_scale`` or ``v_scale`` (``which``) from the one-element checkpoint tensor ``name``.
        Raises ValueError for another ``which`` or a value that is not one positive finite number."""
        if which not in ("k_scale", "v_scale"):
            raise ValueError(f"which must be 'k_scale' or 'v_scale', got {which!r}")
        if value.numel() != 1:
            raise ValueError(f"{name}: a KV-cache scale must be one number (per-tensor), got shape "
                             f"{tuple(value.shape)}")
        x = float(value.reshape(()).float())
        if not (math.isfinite(x) and x > 0):
            raise ValueError(f"{name}: a KV-cache scale must be positive and finite, got {x}")
        setattr(self, which, x)


def kv_scale_target(name: str) -> tuple[str, tuple[str, ...]] | None:
    """(``Attention`` module path, scales it sets) for a checkpoint KV-scale name as vLLM reads
    them (``maybe_remap_kv_scale_name``: ``<p>.self_attn[.attn].k_scale``, ModelOpt's
    ``<p>.self_attn.k_proj.k_scale``, the deprecated ``kv_scale`` for both); None otherwise."""
    head, _, leaf = name.rpartition(".")
    if leaf not in ("k_scale", "v_scale", "kv_scale") or not head:
        return None
    which = ("k_scale", "v_scale") if leaf == "kv_scale" else (leaf,)
    for proj in (".k_proj", ".v_proj"):
        if head.endswith(proj):
            head = head[: -len(proj)]
    if not head.endswith(".attn"):
        head += ".attn"
    return head, which


def bind_kv_cache(model: nn.Module, kv_cache: torch.Tensor, backend: AttentionBackend,
                  cache_slot: dict[int, int] | None = None, attn_group: dict[int, int] | None = None) -> None:
    """Bind every ``Attention`` layer of ``model`` to ``backend`` and its cache view
    (``backend.layer_cache(kv_cache, cache_slot[layer_idx])``, default slot = layer index),
    metadata index ``attn_group[layer_idx]`` (default 0), and its k/v scales if the cache is
    fp8. Binding again replaces the previous binding."""
    fp8 = kv_cache.dtype in FP8_DTYPES
    for m in model.modules():
        if isinstance(m, Attention):
            slot = m.layer_idx if cache_slot is None else cache_slot[m.layer_idx]
            m.backend, m.kv_cache = backend, backend.layer_cache(kv_cache, slot)
            m.attn_group = 0 if attn_group is None else attn_group[m.layer_idx]
            m._scales = (m.k_scale, m.v_scale) if fp8 else (1.0, 1.0)
            m._contiguous_v = backend.contiguous_v


def unbind_kv_cache(model: nn.Module) -> None:
    """Undo ``bind_kv_cache``: every ``Attention`` layer holds no cache or backend."""
    for m in model.modules():
        if isinstance(m, Attention):
            m.backend, m.kv_cache, m.attn_group, m._scales, m._contiguous_v = None, None, 0, (1.0, 1.0), False


def describe_kv_scales(model: nn.Module) -> str:
    """The layers' k/v scales for the start-up log (1.0, or their ranges)."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    ks, vs = [m.k_scale for m in layers], [m.v_scale for m in layers]
    if all(x == 1.0 for x in ks + vs):
        return "k/v scales 1.0 (none in the checkpoint)"
    span = lambda xs: f"{min(xs):.4g}" if min(xs) == max(xs) else f"{min(xs):.4g}-{max(xs):.4g}"  # noqa: E731
    return f"k_scale {span(ks)}, v_scale {span(vs)} (checkpoint)"
