"""The attention layer of a model: q, k, v in, attention output out, over this layer's
slice of the paged KV cache. Which backend computes it and where the cache lives are the
runner's business (``bind_kv_cache``); the step's batch description comes from the
forward context (``pagedllm/forward_context.py``).

KV-cache scales: with an fp8 cache (``--kv-cache-dtype fp8*``) each layer stores
fp8(k / k_scale) and fp8(v / v_scale) and reads element * scale, as vLLM's attention
layer. The scales are 1.0 unless the checkpoint carries them: per-layer float32 scalars
named as vLLM reads them (``kv_scale_target``), e.g. ``model.layers.N.self_attn.k_scale``
(llm-compressor's ``kv_cache_scheme``) or ``model.layers.N.self_attn.k_proj.k_scale``
(NVIDIA ModelOpt). To use other scales, calibrate them (typically max |k| / 448 over
sample prompts for E4M3, per layer) and add them under those names to the safetensors
checkpoint. GGUF files carry none.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagedllm.attention.backend import FP8_DTYPES
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
        sliding_window: a local layer's window in tokens (query at position p sees keys
            p - sliding_window + 1 .. p), or None (the whole context).

    Attributes:
        k_scale, v_scale: the checkpoint's KV-cache scales (1.0 without;
            ``set_kv_scale``), used with an fp8 cache only.
    """

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
        if isinstance(md, list):
            md = md[self.attn_group]
        if self._contiguous_v:
            v = v.contiguous()
        return self.backend.forward(q, k, v, self.kv_cache, md, self.scale, *self._scales)

    def kernel_module(self):
        """The compiled C++ kernel module this layer's attention runs on (its backend's
        ``kernels``, bound to a cache), else None: what a fused caller may call in its
        place (``models/fused_decoder.py``)."""
        if self.backend is None or self.kv_cache is None:
            return None
        return self.backend.kernels

    def kernel_metadata(self) -> Any | None:
        """The step's attention metadata (forward context) when this layer's kernels read
        it as it is (the backend's ``kernel_metadata``: one ``CpuAttentionMetadata`` for
        ``cpu_kernel``), else None (a list per KV-cache group, or the torch ops'
        metadata)."""
        if self.kernel_module() is None:
            return None
        return self.backend.kernel_metadata(get_forward_context().attn_metadata)

    def set_kv_scale(self, which: str, value: torch.Tensor, name: str) -> None:
        """Set ``k_scale`` or ``v_scale`` (``which``) from the checkpoint tensor ``value``
        (one element) called ``name``.

        Raises:
            ValueError: ``which`` is neither, or the tensor is not one positive finite
                number (``name`` in the message).
        """
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
    """Where a checkpoint's KV-cache scale goes: the ``Attention`` module's path and the
    scale(s) it sets, for the names vLLM reads (``maybe_remap_kv_scale_name``):
    ``<p>.self_attn.k_scale`` and ``<p>.self_attn.attn.k_scale`` (v alike) ->
    (``<p>.self_attn.attn``, ("k_scale",)); ModelOpt's ``<p>.self_attn.k_proj.k_scale`` /
    ``<p>.self_attn.v_proj.v_scale`` likewise; the deprecated ``<p>.self_attn.kv_scale``
    sets both. None for any other name."""
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
    """Bind every ``Attention`` layer of ``model`` to ``backend`` and to its view of
    ``kv_cache`` (the backend's whole cache tensor, ``backend.layer_cache(kv_cache, slot)``
    with ``slot = cache_slot[layer_idx]``, default the layer index: with KV-cache groups
    several layers share a slot, each at its own group's blocks), with the layer's k/v
    scales when the cache is fp8 (1.0 otherwise: a float32 or bfloat16 cache holds values
    as they are, as in vLLM). ``attn_group[layer_idx]`` (default 0) is the index of the
    layer's metadata when the runner sets a list of them in the forward context (one per
    KV-cache group and window). The runner calls it once, after allocating the cache and
    loading the weights; binding again (a new cache) replaces the previous binding."""
    fp8 = kv_cache.dtype in FP8_DTYPES
    for m in model.modules():
        if isinstance(m, Attention):
            slot = m.layer_idx if cache_slot is None else cache_slot[m.layer_idx]
            m.backend, m.kv_cache = backend, backend.layer_cache(kv_cache, slot)
            m.attn_group = 0 if attn_group is None else attn_group[m.layer_idx]
            m._scales = (m.k_scale, m.v_scale) if fp8 else (1.0, 1.0)


def unbind_kv_cache(model: nn.Module) -> None:
    """Undo ``bind_kv_cache``: every ``Attention`` layer of ``model`` holds no cache and no
    backend again, as built (after a pass over a cache made for one call, so that the
    model neither keeps that cache alive nor reports choices made for it)."""
    for m in model.modules():
        if isinstance(m, Attention):
            m.backend, m.kv_cache, m.attn_group, m._scales = None, None, 0, (1.0, 1.0)


def describe_kv_scales(model: nn.Module) -> str:
    """The ``Attention`` layers' k/v scales for the start-up log: ``"k/v scales 1.0 (none
    in the checkpoint)"``, or their ranges, e.g. ``"k_scale 0.012-0.094, v_scale 0.004-0.031
    (checkpoint)"``."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    ks, vs = [m.k_scale for m in layers], [m.v_scale for m in layers]
    if all(x == 1.0 for x in ks + vs):
        return "k/v scales 1.0 (none in the checkpoint)"
    span = lambda xs: f"{min(xs):.4g}" if min(xs) == max(xs) else f"{min(xs):.4g}-{max(xs):.4g}"  # noqa: E731
    return f"k_scale {span(ks)}, v_scale {span(vs)} (checkpoint)"
