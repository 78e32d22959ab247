"""Paged attention on the CPU by the C++ kernel (``kernels/csrc/paged_attention_cpu.cpp``),
float32 or bfloat16, over a float32, bfloat16 or fp8 cache: one call per layer for the whole
batch, K/V read in place through the block tables, each (query, head) computed alone in a
fixed order (batch-invariant). Same cache layout as the torch backend, whose ops run where
the kernels do not (said by ``describe``). More: docs/notes/attention.md."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm import envs
from pagedllm.attention.backend import CommonAttentionMetadata
from pagedllm.attention.torch_backend import TorchAttentionBackend
from pagedllm.kernels.cpu import KERNEL_DTYPES, KV_CACHE_KERNEL_DTYPES, kernels_for, trace


@dataclass
class CpuAttentionMetadata:
    """What the kernel reads for one step: ``slot_mapping`` int64 [T], ``block_table`` int32
    [B, max_blocks], ``query_start_loc`` int32 [B+1], ``seq_lens`` int32 [B], ``block_size``,
    ``sliding_window`` (0 = all)."""

    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_size: int
    sliding_window: int = 0


class CpuKernelAttentionBackend(TorchAttentionBackend):
    """The C++ paged-attention kernel where it applies, else the torch backend's ops."""

    name = "cpu_kernel"

    @property
    def contiguous_v(self) -> bool:
        """The C++ K/V write reads strided rows in place; the torch ops read a contiguous v faster."""
        return self.kernels is None

    def __init__(self, device: torch.device | None = None, dtype: torch.dtype = torch.float32,
                 kv_cache_dtype: torch.dtype | None = None):
        super().__init__(device, dtype, kv_cache_dtype)
        kv = self.kv_cache_dtype
        self.kernels = kernels_for(device, dtype, kv)
        name = str(dtype).removeprefix("torch.")
        kv_name = str(kv).removeprefix("torch.")
        if self.kernels is not None:
            self._why = f"C++ paged attention, {name}"
            # AMX scores follow PAGEDLLM_AMX as the AMX linears do, VDPBF16PS scores
            # PAGEDLLM_AVX512_BF16 as that linear kernel does (process-wide switches)
            self.kernels.paged_attention_set_amx(envs.amx_enabled())
            self.kernels.paged_attention_set_dpbf16(envs.avx512_bf16_enabled())
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
        """``cpu_kernel`` and what computes it (or why torch ops), and AMX-BF16 or AVX512-BF16
        q.k scores if known."""
        why = self._why
        if head_dim is not None and block_size is not None:
            windows = list(sliding_windows) or [None]
            n = self.amx_layers(head_dim, block_size, windows)
            dp = self.kernels is not None and bool(
                self.kernels.paged_attention_dpbf16_applies(self.dtype, self.kv_cache_dtype, head_dim))
            if n == len(windows):
                why += ", AMX-BF16 q.k scores"
            elif n:
                why += f", AMX-BF16 q.k scores in the {n} of {len(windows)} layers without a sliding window"
                if dp:
                    why += " (AVX512-BF16 in the others)"
            elif dp:
                why += ", AVX512-BF16 q.k scores"
        return f"{self.name} ({why})"

    def amx_layers(self, head_dim: int, block_size: int, sliding_windows: Sequence[int | None]) -> int:
        """How many layers (one sliding window each) take AMX-BF16 q.k scores; 0 without kernels."""
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
        """``metadata`` if it is one ``CpuAttentionMetadata`` and the kernels are built, else None."""
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
