"""KV-cache sizing on CUDA (vLLM's ``determine_available_memory``): weights are loaded, one
profiling step at ``--max-num-batched-tokens`` measures the activation peak, and the KV
cache gets what ``--gpu-memory-utilization`` of the device leaves after weights, that peak
and memory outside torch (the CUDA context, other processes)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention.backend import build_common_metadata
from pagedllm.distributed import get_tp_size
from pagedllm.forward_context import set_forward_context
from pagedllm.layers import bind_kv_cache, unbind_kv_cache
from pagedllm.utils import cdiv

logger = logging.getLogger("pagedllm")


@dataclass
class MemoryProfile:
    """Bytes: ``total`` device memory; ``weights`` torch memory in use before profiling (the
    model's weights and buffers); ``activation_peak`` torch's peak above that during the
    profiling step (its throwaway KV cache excluded); ``non_torch`` in use outside torch's
    allocator (device total - free - torch reserved)."""

    total: int
    weights: int
    activation_peak: int
    non_torch: int

    def kv_cache_budget(self, utilization: float) -> int:
        """``total * utilization - weights - activation_peak - non_torch`` bytes (may be <= 0)."""
        return int(self.total * utilization) - self.weights - self.activation_peak - self.non_torch

    def describe(self, utilization: float) -> str:
        g = 2 ** 30
        return (f"{self.total / g:.2f} GiB x {utilization:g} = {self.total * utilization / g:.2f} GiB: weights "
                f"{self.weights / g:.2f} GiB, activation peak {self.activation_peak / g:.2f} GiB, outside torch "
                f"{self.non_torch / g:.2f} GiB, KV cache {max(self.kv_cache_budget(utilization), 0) / g:.2f} GiB")


def profile_step(runner, num_tokens: int) -> int:
    """Run ``runner``'s model over ``num_tokens`` prompt tokens (requests of at most
    ``max_model_len`` tokens) on a throwaway KV cache, then the LM head and a log-softmax over
    ``max_num_seqs`` rows, as the largest step would. Returns the throwaway cache's bytes.
    The model is left unbound. Raises ValueError when ``num_tokens`` < 1."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    cfg, bs, dev = runner.config, runner.block_size, runner.device
    per_req = min(num_tokens, cfg.max_model_len)
    q_lens = np.full(cdiv(num_tokens, per_req), per_req, dtype=np.int64)
    q_lens[-1] = num_tokens - per_req * (len(q_lens) - 1)
    blocks = cdiv(per_req, bs)
    table = np.arange(len(q_lens) * blocks, dtype=np.int32).reshape(len(q_lens), blocks)
    a = cfg.arch
    kv = torch.zeros(runner.attn.kv_cache_shape(runner.kv_cache_config.layers_per_block, table.size, bs,
                                                a.num_kv_heads_per_rank(get_tp_size()), a.head_dim),
                     dtype=runner.kv_cache_dtype, device=dev)
    common, pos, _ = build_common_metadata(np.zeros_like(q_lens), q_lens, table, bs, dev)
    md = [runner.attn.build_metadata(common, w) for _, w in runner.attn_groups]
    bind_kv_cache(runner.model, kv, runner.attn, runner.layer_cache_slot, runner.layer_attn_group)
    try:
        with torch.inference_mode(), set_forward_context(md[0] if len(md) == 1 else md):
            hidden = runner.model(torch.zeros(num_tokens, dtype=torch.int64, device=dev),
                                  torch.from_numpy(pos).to(dev))
            rows = min(cfg.args.max_num_seqs, num_tokens)
            torch.log_softmax(runner.model.compute_logits(hidden[:rows]), dim=-1)
    finally:
        unbind_kv_cache(runner.model)
    return kv.numel() * kv.element_size()


def profile_cuda_memory(runner) -> MemoryProfile:
    """Measure ``MemoryProfile`` for ``runner`` on its CUDA device (one ``profile_step`` at
    ``max_num_batched_tokens``)."""
    dev = runner.device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    weights = torch.cuda.memory_allocated(dev)
    kv_bytes = profile_step(runner, runner.config.args.max_num_batched_tokens)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - weights - kv_bytes
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    non_torch = max(total - free - torch.cuda.memory_reserved(dev), 0)
    return MemoryProfile(total, weights, max(peak, 0), non_torch)
