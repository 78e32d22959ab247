"""Paged attention in plain torch ops, on CPU and CUDA (the portable reference path).

Cache: ``[num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim]``; slot ``s`` is
token ``s % block_size`` of block ``s // block_size`` (PagedAttention, Kwon et al. 2023).
Decodes run as one batched masked attention; each multi-query request runs SDPA with a
causal mask offset by its context (and window). A prompt's own K/V are used as the cache
holds them. More: docs/notes/attention.md."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.attention.backend import FP8_DTYPES, AttentionBackend, CommonAttentionMetadata


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """K or V as the cache stores them: ``x / scale`` rounded once to ``cache_dtype`` (fp8:
    saturating at the format's max; NaN stays NaN); ``x`` itself if already so with scale 1."""
    if x.dtype == cache_dtype and scale == 1.0:
        return x
    y = x.float()
    if scale != 1.0:
        y = y / scale
    if cache_dtype in FP8_DTYPES:
        m = torch.finfo(cache_dtype).max
        y = y.clamp(-m, m)
    return y.to(cache_dtype)


def dequantize_kv(c: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Cached K or V as ``dtype``: upcast, times ``scale`` unless 1."""
    y = c.to(dtype)
    return y * scale if scale != 1.0 else y


def write_kv(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """``cache[slots] = x`` along dim 0 (fp8 through a uint8 view)."""
    if cache.dtype in FP8_DTYPES:
        cache.view(torch.uint8).index_copy_(0, slots, x.view(torch.uint8))
    else:
        cache.index_copy_(0, slots, x)


@dataclass
class _PrefillItem:
    q_start: int
    q_end: int
    context_len: int
    slots: torch.Tensor | None      # int64 [seq_len] when context_len > 0
    mask: torch.Tensor | None       # bool [q_len, keys] when context_len > 0 or a window cuts the prompt


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor      # int64 [T]
    num_decodes: int
    block_size: int
    decode_slots: torch.Tensor | None   # int64 [num_decodes * max_ctx]
    decode_max_ctx: int
    decode_bias: torch.Tensor | None    # compute dtype [1, num_decodes, 1, max_ctx], 0 or -inf
    prefills: list[_PrefillItem]


class TorchAttentionBackend(AttentionBackend):
    """Attention in torch ops on any device; K/V caches in any of ``kv_cache_dtypes``."""

    name = "torch"
    kv_cache_dtypes = (torch.float32, torch.bfloat16, torch.float16) + FP8_DTYPES

    def __init__(self, device: torch.device | None = None, dtype: torch.dtype = torch.float32,
                 kv_cache_dtype: torch.dtype | None = None):
        super().__init__(device, dtype, kv_cache_dtype)
        # On the CPU the attention maths runs in float32 whatever the model's dtype: in
        # bf16, SDPA's rounding depended on the batch (the decode context is padded to the
        # batch's longest), so greedy outputs changed with the batch; in float32 they do
        # not (tests/e2e/test_dtype_invariance.py runs this backend in bf16). On CUDA it runs
        # in the model's dtype (flash kernels).
        self.on_cpu = device is None or torch.device(device).type == "cpu"
        self.compute_dtype = torch.float32 if self.on_cpu else dtype

    def describe(self, head_dim=None, block_size=None, sliding_windows=()) -> str:
        """``torch``, and the KV cache's dtype where it is not the model's."""
        if self.kv_cache_dtype == self.dtype:
            return self.name
        return f"{self.name} ({str(self.kv_cache_dtype).removeprefix('torch.')} KV cache)"

    @staticmethod
    def kv_cache_shape(num_layers, num_blocks, block_size, num_kv_heads, head_dim):
        return (num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim)

    @staticmethod
    def layer_cache(kv_cache, layer):
        return kv_cache[layer]

    def build_metadata(self, c: CommonAttentionMetadata, sliding_window: int | None = None) -> TorchAttentionMetadata:
        device = c.slot_mapping.device
        bs = c.block_size
        nd = c.num_decodes
        w = sliding_window
        decode_slots = decode_bias = None
        max_ctx = 0
        if nd:
            lens = c.seq_lens_np[:nd].astype(np.int64)
            start = np.maximum(lens - w, 0) if w else np.zeros_like(lens)   # first key each decode sees
            max_ctx = int((lens - start).max())
            pos = start[:, None] + np.arange(max_ctx, dtype=np.int64)[None, :]
            valid = pos < lens[:, None]
            # Padding reads the request's own last key (written by now), never a slot
            # that may hold uninitialised memory or a released block; the bias zeroes it.
            pos = np.where(valid, pos, (lens - 1)[:, None])
            bt = c.block_table_np[:nd].astype(np.int64)
            slots = np.take_along_axis(bt, pos // bs, axis=1) * bs + (pos % bs)
            decode_slots = torch.from_numpy(slots.reshape(-1)).to(device, non_blocking=True)
            bias = np.where(valid, 0.0, -np.inf).astype(np.float32)
            decode_bias = torch.from_numpy(bias).view(1, nd, 1, max_ctx).to(device, self.compute_dtype,
                                                                            non_blocking=True)
        prefills = []
        qsl, ctx, sl = c.query_start_loc_np, c.context_lens_np, c.seq_lens_np
        for i in range(nd, c.num_reqs):
            s, e, cl, L = int(qsl[i]), int(qsl[i + 1]), int(ctx[i]), int(sl[i])
            slots = mask = None
            q_pos = cl + np.arange(e - s)
            if cl > 0:
                lo = max(0, cl - w + 1) if w else 0          # the first query's first key
                pos = np.arange(lo, L, dtype=np.int64)
                row = c.block_table_np[i].astype(np.int64)
                slots = torch.from_numpy(row[pos // bs] * bs + pos % bs).to(device, non_blocking=True)
                keep = pos[None, :] <= q_pos[:, None]
                if w:
                    keep &= pos[None, :] > q_pos[:, None] - w
                mask = torch.from_numpy(keep).to(device, non_blocking=True)
            elif w and L > w:    # the prompt's own keys, causal within the window
                keep = (q_pos[None, :] <= q_pos[:, None]) & (q_pos[None, :] > q_pos[:, None] - w)
                mask = torch.from_numpy(keep).to(device, non_blocking=True)
            prefills.append(_PrefillItem(s, e, cl, slots, mask))
        return TorchAttentionMetadata(c.slot_mapping, nd, bs, decode_slots,
                                      max_ctx, decode_bias, prefills)

    def forward(self, q, k, v, layer_cache, md: TorchAttentionMetadata, scale, k_scale=1.0, v_scale=1.0):
        T, nh, hd = q.shape
        nkv = k.shape[1]
        key_cache, value_cache = layer_cache[0], layer_cache[1]
        # k, v as cached (k and v themselves for a cache in their dtype)
        k = quantize_kv(k, key_cache.dtype, k_scale)
        v = quantize_kv(v, value_cache.dtype, v_scale)
        write_kv(key_cache, md.slot_mapping, k)
        write_kv(value_cache, md.slot_mapping, v)
        out = torch.empty(T, nh, hd, dtype=q.dtype, device=q.device)
        nd = md.num_decodes
        if nd:
            g = nh // nkv
            ctx = md.decode_max_ctx
            # [nkv, nd, g, hd] queries against [nkv, nd, ctx, hd] keys: kv heads as the
            # batch, the g query heads sharing a kv head as the query length.
            cd = self.compute_dtype
            qd = q[:nd].to(cd).view(nd, nkv, g, hd).permute(1, 0, 2, 3)
            kd = dequantize_kv(key_cache.index_select(0, md.decode_slots), cd, k_scale)
            vd = dequantize_kv(value_cache.index_select(0, md.decode_slots), cd, v_scale)
            kd = kd.view(nd, ctx, nkv, hd).permute(2, 0, 1, 3)
            vd = vd.view(nd, ctx, nkv, hd).permute(2, 0, 1, 3)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=md.decode_bias, scale=scale)
            out[:nd] = o.permute(1, 0, 2, 3).reshape(nd, nh, hd)
        cd = self.compute_dtype
        for p in md.prefills:
            qs = q[p.q_start:p.q_end].to(cd).transpose(0, 1).unsqueeze(0)        # [1, nh, L, hd]
            if p.context_len == 0:
                ks = dequantize_kv(k[p.q_start:p.q_end], cd, k_scale).transpose(0, 1).unsqueeze(0)  # [1, nkv, L, hd]
                vs = dequantize_kv(v[p.q_start:p.q_end], cd, v_scale).transpose(0, 1).unsqueeze(0)
                if p.mask is None:
                    o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                       enable_gqa=nkv != nh)
                else:
                    o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=p.mask, scale=scale,
                                                       enable_gqa=nkv != nh)
            else:
                ks = dequantize_kv(key_cache.index_select(0, p.slots), cd, k_scale).transpose(0, 1).unsqueeze(0)
                vs = dequantize_kv(value_cache.index_select(0, p.slots), cd, v_scale).transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=p.mask, scale=scale,
                                                   enable_gqa=nkv != nh)
            out[p.q_start:p.q_end] = o[0].transpose(0, 1)
        return out.view(T, nh * hd)
