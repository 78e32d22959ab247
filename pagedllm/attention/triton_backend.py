"""Paged attention by Triton kernels (``kernels/triton_attention.py``) on CUDA: per layer one
K/V write and one attention launch for the whole mixed batch, split-K for long decodes at
small batch. Same cache layout as the torch backend (interchangeable on one cache). On the
CPU only under ``TRITON_INTERPRET=1`` (the interpreter; tests). More: docs/notes/attention.md."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm import envs
from pagedllm.attention.backend import FP8_DTYPES, AttentionBackend, CommonAttentionMetadata
from pagedllm.attention.torch_backend import TorchAttentionBackend


@dataclass
class TritonAttentionMetadata:
    """What the kernels read for one step, all device tensors the runner already holds:
    ``slot_mapping`` int64 [T], ``block_table`` int32 [B, max_blocks], ``query_start_loc``
    int32 [B+1], ``seq_lens`` int32 [B]; host ints ``block_size``, ``sliding_window`` (0 =
    all), ``max_query_len``, ``max_seq_len`` (tiles and path), ``num_decodes``;
    ``split_kv``: None = the kernels' rule (``use_split_kv``), True/False forces the decodes' path."""

    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_size: int
    sliding_window: int
    max_query_len: int
    max_seq_len: int
    num_decodes: int
    split_kv: bool | None = None


class TritonAttentionBackend(AttentionBackend):
    """Unified paged attention in Triton; K/V caches in any of ``kv_cache_dtypes``.
    Raises ValueError (naming ``attention_backend``) on a CPU device without
    ``TRITON_INTERPRET=1``, where Triton cannot be imported, or for an fp8_e4m3 cache on a
    GPU older than compute capability 8.9."""

    name = "triton"
    kv_cache_dtypes = (torch.float32, torch.bfloat16, torch.float16) + FP8_DTYPES
    contiguous_v = False        # the K/V write reads strided rows
    cudagraph_support = True    # forward reads only the metadata's device tensors

    def __init__(self, device: torch.device | None = None, dtype: torch.dtype = torch.float32,
                 kv_cache_dtype: torch.dtype | None = None):
        super().__init__(device, dtype, kv_cache_dtype)
        self.interpreted = device is None or torch.device(device).type == "cpu"
        if self.interpreted and not envs.triton_interpret():
            raise ValueError("attention_backend 'triton' runs on CUDA (on the CPU only in the Triton "
                             "interpreter, TRITON_INTERPRET=1, for tests); use 'cpu_kernel' or 'torch' here")
        if self.interpreted and dtype == torch.bfloat16:
            raise ValueError("attention_backend 'triton' in the Triton interpreter cannot run bfloat16 (its bf16 "
                             "tl.dot is wrong: triton issue 11584); use --dtype float32 or float16")
        if (not self.interpreted and self.kv_cache_dtype == torch.float8_e4m3fn
                and torch.cuda.get_device_capability(device) < (8, 9)):
            raise ValueError("kv_cache_dtype fp8_e4m3 with attention_backend 'triton' needs compute capability "
                             "8.9 or newer (Triton's fp8e4nv); use fp8_e5m2, or --attention-backend torch")
        try:
            # imported here: Triton picks its interpreter when a kernel is defined
            from pagedllm.kernels import triton_attention
        except ImportError as e:
            raise ValueError(f"attention_backend 'triton' needs Triton: {e}") from None
        self.ops = triton_attention

    def describe(self, head_dim=None, block_size=None, sliding_windows=()) -> str:
        """``triton (unified paged attention, split-K decodes[, <dtype> KV cache][, interpreter])``."""
        parts = ["unified paged attention", "split-K decodes"]
        if self.kv_cache_dtype != self.dtype:
            parts.append(f"{str(self.kv_cache_dtype).removeprefix('torch.')} KV cache")
        if self.interpreted:
            parts.append("Triton interpreter")
        return f"{self.name} ({', '.join(parts)})"

    # the torch backend's layout, from its one definition (the two read one cache interchangeably)
    kv_cache_shape = staticmethod(TorchAttentionBackend.kv_cache_shape)
    layer_cache = staticmethod(TorchAttentionBackend.layer_cache)

    def build_metadata(self, c: CommonAttentionMetadata, sliding_window: int | None = None) -> TritonAttentionMetadata:
        # host ints from the host copies; the device tensors pass through (.to is a no-op
        # for the int32 ones the runner builds)
        qsl = c.query_start_loc_np[:c.num_reqs + 1]
        max_q = int(np.diff(qsl).max()) if c.num_reqs else 0
        max_seq = int(c.seq_lens_np[:c.num_reqs].max()) if c.num_reqs else 0
        return TritonAttentionMetadata(
            c.slot_mapping, c.block_table.to(torch.int32), c.query_start_loc.to(torch.int32),
            c.seq_lens.to(torch.int32), c.block_size, sliding_window or 0, max_q, max_seq, c.num_decodes)

    def build_graph_metadata(self, c: CommonAttentionMetadata,
                             sliding_window: int | None = None) -> TritonAttentionMetadata:
        """``build_metadata`` for a captured decode batch: the longest sequence is unknown at
        capture, so the split-K choice is made by batch size alone (as for long sequences)."""
        md = self.build_metadata(c, sliding_window)
        md.max_seq_len = self.ops.SPLIT_KV_MIN_SEQ_LEN
        return md

    def forward(self, q, k, v, layer_cache, md: TritonAttentionMetadata, scale, k_scale=1.0, v_scale=1.0):
        T, nh, hd = q.shape
        key_cache, value_cache = layer_cache[0], layer_cache[1]
        self.ops.reshape_and_cache(k, v, key_cache, value_cache, md.slot_mapping, k_scale, v_scale)
        out = torch.empty(T, nh, hd, dtype=q.dtype, device=q.device)
        self.ops.unified_attention(
            q, key_cache, value_cache, out, md.query_start_loc, md.seq_lens, md.block_table,
            md.block_size, scale, k_scale, v_scale, md.sliding_window, md.max_query_len,
            md.max_seq_len, split_kv=md.split_kv, num_decodes=md.num_decodes)
        return out.view(T, nh * hd)
