"""The attention-backend interface. A backend owns its KV-cache layout and one ``forward`` per
layer that writes the new tokens' K/V at ``slot_mapping`` and attends each request's queries
causally over its cached tokens. A cache in fp8 stores fp8(k / k_scale) and reads element *
scale (vLLM's per-tensor ``k_scale`` / ``v_scale``). Per-step metadata is derived once per
step (``build_metadata``) from the runner's ``CommonAttentionMetadata``."""
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
    """One flattened, unpadded batch, decodes (one query token) first. B requests, T tokens:
    ``query_start_loc`` int32 [B+1]; ``seq_lens`` int32 [B] (cached after this step);
    ``context_lens`` int32 [B] (cached before); ``block_table`` int32 [B, max_blocks] (0-padded);
    ``slot_mapping`` int64 [T] (block_id * block_size + offset); ``*_np``: host numpy copies."""

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
                          block_size: int, device: torch.device,
                          buffers: Any = None) -> tuple[CommonAttentionMetadata, np.ndarray, np.ndarray]:
    """Describe one batch (decodes first) from context_lens, query_lens (int64 [B]) and
    block_table int32 [B, max_blocks]. Returns (metadata, positions int64 [T], request index
    of each token int64 [T]). ``buffers``: the runner's persistent ``InputBuffers``; when the
    step fits, the device tensors are views of their heads (valid until the next step),
    else fresh tensors."""
    B = len(query_lens)
    qsl = np.zeros(B + 1, dtype=np.int64)
    np.cumsum(query_lens, out=qsl[1:])
    T = int(qsl[-1])
    seq_lens = context_lens + query_lens
    req_of_tok = np.repeat(np.arange(B), query_lens)
    pos = context_lens[req_of_tok] + (np.arange(T) - qsl[:-1][req_of_tok])
    slot_mapping = block_table[req_of_tok, pos // block_size].astype(np.int64) * block_size + pos % block_size
    if buffers is not None and buffers.fits(T, B, block_table.shape[1]):
        to = buffers.stage
    elif device.type == "cpu":
        to = lambda name, a: torch.from_numpy(a)  # noqa: E731
    else:
        to = lambda name, a: torch.from_numpy(a).to(device, non_blocking=True)  # noqa: E731
    common = CommonAttentionMetadata(
        num_reqs=B, num_tokens=T, num_decodes=int((query_lens == 1).sum()),
        query_start_loc=to("query_start_loc", qsl.astype(np.int32)),
        seq_lens=to("seq_lens", seq_lens.astype(np.int32)),
        context_lens=to("context_lens", context_lens.astype(np.int32)),
        block_table=to("block_table", block_table), slot_mapping=to("slot_mapping", slot_mapping),
        block_size=block_size,
        query_start_loc_np=qsl, seq_lens_np=seq_lens, context_lens_np=context_lens,
        block_table_np=block_table)
    return common, pos, req_of_tok


class AttentionBackend(ABC):
    """Interface every attention implementation provides, and what it needs from its callers.

    ``name``: the ``--attention-backend`` name (``attention/registry.py``); ``kv_cache_dtypes``:
    cache dtypes it supports; ``kernels``: its compiled C++ module (for a fused caller), or
    None; ``contiguous_v``: ``forward`` wants v contiguous (the layer copies a strided v once);
    ``cudagraph_support``: its decode ``forward`` reads only device tensors that the runner's
    persistent buffers hold, so a step may be captured and replayed (``worker/cuda_graph.py``);
    ``why``: how it was chosen (set by ``get_attention_backend``)."""

    name: str = "abstract"
    kv_cache_dtypes: tuple[torch.dtype, ...] = ()
    kernels: Any = None
    contiguous_v: bool = True
    cudagraph_support: bool = False
    why: str = ""

    def __init__(self, device: torch.device | None = None, dtype: torch.dtype = torch.float32,
                 kv_cache_dtype: torch.dtype | None = None):
        self.device, self.dtype = device, dtype
        self.kv_cache_dtype = kv_cache_dtype or dtype

    def describe(self, head_dim: int | None = None, block_size: int | None = None,
                 sliding_windows: Sequence[int | None] = ()) -> str:
        """How this backend computes, for the start-up log (default: its name)."""
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
        """Per-step precomputation shared by the layers with ``sliding_window`` (None: whole
        context; else query p sees keys p - window + 1 .. p, older blocks may be released)."""

    def build_graph_metadata(self, common: CommonAttentionMetadata, sliding_window: int | None = None) -> Any:
        """``build_metadata`` for a captured decode step over the runner's persistent buffers,
        replayed on other requests: nothing in it may depend on this step's values beyond the
        batch size (default: ``build_metadata``; only backends with ``cudagraph_support``)."""
        return self.build_metadata(common, sliding_window)

    def kernel_metadata(self, metadata: Any) -> Any | None:
        """``metadata`` when ``kernels`` read it as it is, else None (default)."""
        return None

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer_cache: Any, metadata: Any, scale: float,
                k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        """Write K/V at the slot mapping, then attend. q [T, num_heads, head_dim], k, v
        [T, num_kv_heads, head_dim] (model dtype); the cache holds k / k_scale, v / v_scale.
        Returns [T, num_heads * head_dim]."""
