"""The attention-backend interface.

A backend owns two things: the KV-cache layout it wants, and one ``forward`` per layer
that (1) writes the new tokens' K/V into the paged cache at ``slot_mapping`` and (2)
attends every request's queries over all of that request's cached tokens with causal
masking. The cache's element type may differ from the model's (``--kv-cache-dtype``:
float32, bfloat16 or fp8, ``kv_cache_dtypes``); a backend stores K as fp8(k / k_scale)
(V alike) and reads element * scale (vLLM's per-tensor ``k_scale`` / ``v_scale``).

The ModelRunner builds one ``CommonAttentionMetadata`` per step; each backend derives
what it needs from it once per step (``build_metadata``), never per layer.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


# 8-bit floating point KV-cache dtypes (OCP OFP8 spec rev. 1.0: E4M3 without infinities,
# E5M2 IEEE-like); only these use the per-layer k/v scales.
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass
class CommonAttentionMetadata:
    """Batch description shared by all backends (one flattened, unpadded batch).

    Requests with exactly one query token (decodes) come first in the batch.

    Attributes:
        num_reqs: B, requests in the batch.
        num_tokens: T, total query tokens.
        num_decodes: requests (at the front) whose query length is 1.
        query_start_loc: int32 [B+1], offsets of each request's queries in the T tokens.
        seq_lens: int32 [B], tokens in the cache for each request after this step
            (computed context + this step's queries).
        context_lens: int32 [B], tokens already cached before this step.
        block_table: int32 [B, max_blocks], block ids of each request (row-padded with 0).
        slot_mapping: int64 [T], cache slot (block_id * block_size + offset) of each token.
        block_size: tokens per block.
        query_start_loc_np, seq_lens_np, context_lens_np, block_table_np: CPU numpy copies
            of the above (host-side planning without device syncs).
    """

    num_reqs: int
    num_tokens: int
    num_decodes: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    context_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    block_size: int
    query_start_loc_np: np.ndarray
    seq_lens_np: np.ndarray
    context_lens_np: np.ndarray
    block_table_np: np.ndarray


def build_common_metadata(context_lens: np.ndarray, query_lens: np.ndarray, block_table: np.ndarray,
                          block_size: int, device: torch.device) -> tuple[CommonAttentionMetadata, np.ndarray, np.ndarray]:
    """Describe one flattened batch, vectorised (numpy on the host, then one copy each).

    Args:
        context_lens: int64 [B], tokens already in the cache per request.
        query_lens: int64 [B] (> 0), tokens computed this step per request; requests with
            one query token must come first.
        block_table: int32 [B, max_blocks], each request's block ids (row-padded).
        block_size: tokens per block; device: where the tensors go.

    Returns:
        (metadata, positions int64 [T], request index of each token int64 [T]).
    """
    B = len(query_lens)
    qsl = np.zeros(B + 1, dtype=np.int64)
    np.cumsum(query_lens, out=qsl[1:])
    T = int(qsl[-1])
    seq_lens = context_lens + query_lens
    req_of_tok = np.repeat(np.arange(B), query_lens)
    pos = context_lens[req_of_tok] + (np.arange(T) - qsl[:-1][req_of_tok])
    slot_mapping = block_table[req_of_tok, pos // block_size].astype(np.int64) * block_size + pos % block_size
    to = (lambda a: torch.from_numpy(a)) if device.type == "cpu" else (
        lambda a: torch.from_numpy(a).to(device, non_blocking=True))
    common = CommonAttentionMetadata(
        num_reqs=B, num_tokens=T, num_decodes=int((query_lens == 1).sum()),
        query_start_loc=to(qsl.astype(np.int32)), seq_lens=to(seq_lens.astype(np.int32)),
        context_lens=to(context_lens.astype(np.int32)), block_table=to(block_table),
        slot_mapping=to(slot_mapping), block_size=block_size,
        query_start_loc_np=qsl, seq_lens_np=seq_lens, context_lens_np=context_lens,
        block_table_np=block_table)
    return common, pos, req_of_tok


class AttentionBackend(ABC):
    """Interface every attention implementation provides.

    Attributes:
        name: the ``--attention-backend`` name.
        kv_cache_dtypes: the KV-cache element types it can write and read.
        dtype: the model's dtype (q, k, v, output); kv_cache_dtype: the cache's.
        kernels: the compiled C++ kernel module this backend computes with, which a
            fused caller may call in its place (``models/fused_decoder.py``); None for
            a backend without one.
    """

    name: str = "abstract"
    kv_cache_dtypes: tuple[torch.dtype, ...] = ()
    kernels: Any = None

    def __init__(self, device: torch.device | None = None, dtype: torch.dtype = torch.float32,
                 kv_cache_dtype: torch.dtype | None = None):
        self.device, self.dtype = device, dtype
        self.kv_cache_dtype = kv_cache_dtype or dtype

    def describe(self, head_dim: int | None = None, block_size: int | None = None,
                 sliding_windows: Sequence[int | None] = ()) -> str:
        """How this backend computes, for the start-up log (default: its name). The model's
        ``head_dim``, the cache's ``block_size`` (tokens) and each layer's sliding window
        (None: full attention), where known, let a backend say which kernel those layers get."""
        return self.name

    @staticmethod
    @abstractmethod
    def kv_cache_shape(num_layers: int, num_blocks: int, block_size: int,
                       num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Shape of the one tensor that holds every layer's K and V blocks."""

    @staticmethod
    @abstractmethod
    def layer_cache(kv_cache: torch.Tensor, layer: int) -> Any:
        """The per-layer view of the cache that ``forward`` receives."""

    @abstractmethod
    def build_metadata(self, common: CommonAttentionMetadata, sliding_window: int | None = None) -> Any:
        """Per-step precomputation (gather indices, masks), shared by all layers that
        attend over ``sliding_window`` tokens (None: the whole context; else query
        position p sees keys p - sliding_window + 1 .. p, and the keys before that are
        never read, so their blocks may have been released)."""

    def kernel_metadata(self, metadata: Any) -> Any | None:
        """``metadata`` (what ``build_metadata`` returned, or a list of those) when it is
        what ``kernels`` read, so a fused caller may hand it to them; else None (the
        default: a backend without kernels)."""
        return None

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer_cache: Any, metadata: Any, scale: float,
                k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        """Write K/V at the slot mapping, then attend.

        Args:
            q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (model dtype).
            layer_cache: this layer's cache view (see ``layer_cache``), in any of
                ``kv_cache_dtypes``.
            metadata: the object ``build_metadata`` returned for this step.
            scale: softmax scale, usually head_dim ** -0.5.
            k_scale, v_scale: the cache holds k / k_scale and v / v_scale (positive,
                finite; 1.0 = as they are).

        Returns:
            [T, num_heads * head_dim] attention output.
        """


_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    _BACKENDS[cls.name] = cls
    return cls


def attention_backend_class(name: str = "auto", device: torch.device | None = None) -> type[AttentionBackend]:
    """The backend class called ``name``. ``"auto"``: ``cpu_kernel`` on the CPU (the C++
    paged-attention kernel, falling back to torch ops), ``torch`` elsewhere.

    Raises:
        ValueError: no backend has that name (the known names are listed).
    """
    from pagedllm.attention import cpu_backend, torch_backend  # noqa: F401  (register themselves)

    if name == "auto":
        name = "cpu_kernel" if (device is None or torch.device(device).type == "cpu") else "torch"
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(_BACKENDS)}")
    return _BACKENDS[name]


def get_attention_backend(name: str = "auto", device: torch.device | None = None,
                          dtype: torch.dtype = torch.float32,
                          kv_cache_dtype: torch.dtype | None = None) -> AttentionBackend:
    """Instantiate a backend by name (``attention_backend_class``) for a model computing in
    ``dtype`` with a KV cache of ``kv_cache_dtype`` (None: ``dtype``).

    Raises:
        ValueError: no backend has that name (the known names are listed), or it cannot
            use ``kv_cache_dtype`` (named).
    """
    cls = attention_backend_class(name, device)
    if kv_cache_dtype is not None and kv_cache_dtype not in cls.kv_cache_dtypes:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype} is not supported by the {cls.name!r} attention backend")
    return cls(device=device, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
