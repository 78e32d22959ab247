"""Paged attention on the CPU by the C++ kernel (``pagedllm/kernels/csrc/paged_attention_cpu.cpp``),
float32 or bfloat16, with a KV cache in float32, bfloat16 or fp8 (E4M3, E5M2; per-layer
k/v scales), widened to float32 as it is read.

One kernel call per layer covers the whole flattened batch (decodes, prompts, prompt
chunks over a cached prefix, several query tokens per request) and reads K/V in place
through the block tables: no gather into contiguous copies and no Python loop over
requests. Each (query, head) is computed alone in a fixed order, with float32 scores,
softmax and accumulation (on a CPU with AMX-BF16, a bf16 model over a bf16 cache takes
its q.k scores from AMX tile products, for every query alike), so a token's attention output never depends on the batch it
ran in, on how its prompt was chunked, or on whether its prefix came from the cache.

The cache layout is the torch backend's (``[layers, 2, slots, kv_heads, head_dim]``), so
the two backends are interchangeable on one cache; without the compiled kernels (no
compiler, ``PAGEDLLM_CPU_KERNELS=0``) or off the CPU, this backend runs the torch
backend's ops instead, and says so in the start-up log (``describe``).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm import envs
from pagedllm.attention.backend import CommonAttentionMetadata, register_backend
from pagedllm.attention.torch_backend import TorchAttentionBackend
from pagedllm.kernels.cpu import KERNEL_DTYPES, KV_CACHE_KERNEL_DTYPES, kernels_for, trace


@dataclass
class CpuAttentionMetadata:
    """What the kernel reads for one step (CPU tensors sharing the runner's numpy buffers
    where they can).

    Attributes:
        slot_mapping: int64 [T], cache slot of each new token.
        block_table: int32 [B, max_blocks].
        query_start_loc: int32 [B+1].
        seq_lens: int32 [B], cached tokens after this step (context + queries).
        block_size: tokens per block.
        sliding_window: keys a query sees (its own and the ones before it), 0 = all.
    """

    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_size: int
    sliding_window: int = 0


@register_backend
class CpuKernelAttentionBackend(TorchAttentionBackend):
    """The C++ paged-attention kernel where it applies (CPU, float32/bfloat16 model, a
    cache in ``KV_CACHE_KERNEL_DTYPES``, kernels built), else the torch backend's ops.
    ``kernels`` is the compiled module or None."""

    name = "cpu_kernel"

    def __init__(self, device: torch.device | None = None, dtype: torch.dtype = torch.float32,
                 kv_cache_dtype: torch.dtype | None = None):
        super().__init__(device, dtype, kv_cache_dtype)
        kv = self.kv_cache_dtype
        self.kernels = kernels_for(device, dtype, kv)
        name = str(dtype).removeprefix("torch.")
        kv_name = str(kv).removeprefix("torch.")
        if self.kernels is not None:
            self._why = f"C++ paged attention, {name}"
            # AMX scores follow PAGEDLLM_AMX as the AMX linears do (a process-wide switch)
            self.kernels.paged_attention_set_amx(envs.amx_enabled())
        elif not self.on_cpu:
            self._why = "not on the CPU: torch ops"
        elif dtype not in KERNEL_DTYPES:
            self._why = f"no kernel for {name}: torch ops"
        elif kv not in KV_CACHE_KERNEL_DTYPES:
            self._why = f"no kernel for a {kv_name} KV cache: torch ops"
        elif not envs.cpu_kernels_enabled():
            self._why = "kernels disabled by PAGEDLLM_CPU_KERNELS=0: torch ops"
        else:
            self._why = "the kernels failed to build (see the warning above): torch ops"
        if kv != dtype:
            self._why += f", {kv_name} KV cache"

    def describe(self, head_dim=None, block_size=None, sliding_windows=()) -> str:
        """``cpu_kernel`` and what computes it, or why it fell back to torch ops (for the
        start-up log); given the model's ``head_dim`` and the cache's ``block_size``, also
        whether the layers take their q.k scores from AMX tiles (``amx_layers``)."""
        why = self._why
        if head_dim is not None and block_size is not None:
            windows = list(sliding_windows) or [None]
            n = self.amx_layers(head_dim, block_size, windows)
            if n == len(windows):
                why += ", AMX-BF16 q.k scores"
            elif n:
                why += f", AMX-BF16 q.k scores in the {n} of {len(windows)} layers without a sliding window"
        return f"{self.name} ({why})"

    def amx_layers(self, head_dim: int, block_size: int, sliding_windows: Sequence[int | None]) -> int:
        """How many of the layers (one sliding window each, None or 0 for full attention)
        the kernel computes with AMX-BF16 q.k scores (``paged_attention_amx_applies``: a bf16
        model over a bf16 cache, head_dim % 32 == 0, block_size % 16 == 0, no window, AMX-BF16
        present, ``PAGEDLLM_AMX`` not 0); 0 without the kernels."""
        if self.kernels is None:
            return 0
        return sum(bool(self.kernels.paged_attention_amx_applies(self.dtype, self.kv_cache_dtype, head_dim,
                                                                  block_size, w or 0))
                   for w in sliding_windows)

    def build_metadata(self, c: CommonAttentionMetadata, sliding_window: int | None = None):
        if self.kernels is None:
            return super().build_metadata(c, sliding_window)
        B = c.num_reqs
        return CpuAttentionMetadata(
            c.slot_mapping,
            torch.from_numpy(np.ascontiguousarray(c.block_table_np[:B], dtype=np.int32)),
            torch.from_numpy(np.ascontiguousarray(c.query_start_loc_np[:B + 1], dtype=np.int32)),
            torch.from_numpy(np.ascontiguousarray(c.seq_lens_np[:B], dtype=np.int32)),
            c.block_size, sliding_window or 0)

    def kernel_metadata(self, metadata) -> CpuAttentionMetadata | None:
        """``metadata`` when it is one ``CpuAttentionMetadata`` (not a list per KV-cache
        group, nor the torch ops' metadata) and the kernels are built, else None."""
        return metadata if type(metadata) is CpuAttentionMetadata and self.kernels is not None else None

    def forward(self, q, k, v, layer_cache, md, scale, k_scale=1.0, v_scale=1.0):
        if not isinstance(md, CpuAttentionMetadata):
            return super().forward(q, k, v, layer_cache, md, scale, k_scale, v_scale)
        T, nh, hd = q.shape
        key_cache, value_cache = layer_cache[0], layer_cache[1]
        with trace("pagedllm::reshape_and_cache"):
            self.kernels.reshape_and_cache(k, v, key_cache, value_cache, md.slot_mapping, k_scale, v_scale)
        out = torch.empty(T, nh, hd, dtype=q.dtype)
        with trace("pagedllm::paged_attention"):
            self.kernels.paged_attention(out, q, key_cache, value_cache, md.block_table,
                                         md.query_start_loc, md.seq_lens, md.block_size, scale,
                                         k_scale, v_scale, md.sliding_window)
        return out.view(T, nh * hd)
