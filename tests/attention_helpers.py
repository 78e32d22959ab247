"""A mixed attention batch with blocks scattered in the cache, and the naive reference
(test_attention.py, test_kv_cache_dtype.py)."""
from __future__ import annotations

import numpy as np
import torch

from pagedllm.attention.backend import CommonAttentionMetadata


def _batch(seed=0, nh=9, nkv=3, hd=64, bs=16):
    rng = np.random.default_rng(seed)
    nblocks = 300 * 16 // bs
    seq_prev = [5, 40, 17, 290, 1, 64]            # decodes: context before this step
    qlens = [1] * len(seq_prev) + [7, 12, 33]      # + chunk on context, fresh prompt, chunk
    ctx = seq_prev + [20, 0, 47]
    B = len(qlens)
    seq = np.array([c + q for c, q in zip(ctx, qlens)])
    perm = rng.permutation(nblocks)
    max_blocks = int(max(-(-s // bs) for s in seq))
    bt = np.zeros((B, max_blocks), dtype=np.int32)
    k = 0
    for i in range(B):
        n = -(-seq[i] // bs)
        bt[i, :n] = perm[k:k + n]
        k += n
    qsl = np.concatenate([[0], np.cumsum(qlens)])
    T = int(qsl[-1])
    pos = np.concatenate([np.arange(c, c + q) for c, q in zip(ctx, qlens)])
    req = np.repeat(np.arange(B), qlens)
    slot = bt[req, pos // bs].astype(np.int64) * bs + pos % bs
    c = CommonAttentionMetadata(
        B, T, len(seq_prev), torch.from_numpy(qsl.astype(np.int32)), torch.from_numpy(seq.astype(np.int32)),
        torch.from_numpy(np.array(ctx, dtype=np.int32)), torch.from_numpy(bt), torch.from_numpy(slot), bs,
        qsl, seq, np.array(ctx), bt)
    g = torch.Generator().manual_seed(seed)
    shape = (2, nblocks * bs, nkv, hd)
    layer_cache = torch.randn(shape, generator=g)
    q = torch.randn(T, nh, hd, generator=g)
    k_new = torch.randn(T, nkv, hd, generator=g)
    v_new = torch.randn(T, nkv, hd, generator=g)
    return c, layer_cache, q, k_new, v_new, (bt, seq, ctx, qlens, qsl, bs)


def _naive(layer_cache, q, k_new, v_new, c, info, scale):
    bt, seq, ctx, qlens, qsl, bs = info
    cache = layer_cache.clone()
    cache[0][c.slot_mapping] = k_new
    cache[1][c.slot_mapping] = v_new
    g = q.shape[1] // k_new.shape[1]
    out = torch.empty(q.shape[0], q.shape[1] * q.shape[2])
    for i in range(len(qlens)):
        p = np.arange(seq[i])
        slots = torch.from_numpy(bt[i, p // bs].astype(np.int64) * bs + p % bs)
        K = cache[0][slots].repeat_interleave(g, dim=1)
        V = cache[1][slots].repeat_interleave(g, dim=1)
        for j in range(qlens[i]):
            t, n = qsl[i] + j, ctx[i] + j + 1       # causal: keys 0 .. context + j
            s = torch.einsum("hd,chd->hc", q[t], K[:n]) * scale
            out[t] = torch.einsum("hc,chd->hd", s.softmax(-1), V[:n]).reshape(-1)
    return out, cache


def _one_request(c, info, i, q_from, q_to):
    """Metadata for queries [q_from, q_to) of request i of ``_batch``, alone in a batch
    (its earlier queries' K/V already in the cache)."""
    bt, seq, ctx, qlens, qsl, bs = info
    n = q_to - q_from
    seq_i = ctx[i] + q_to
    return CommonAttentionMetadata(
        1, n, int(n == 1), torch.tensor([0, n], dtype=torch.int32), torch.tensor([seq_i], dtype=torch.int32),
        torch.tensor([ctx[i] + q_from], dtype=torch.int32), torch.from_numpy(bt[i:i + 1].copy()),
        c.slot_mapping[qsl[i] + q_from: qsl[i] + q_to].clone(), bs, np.array([0, n]), np.array([seq_i]),
        np.array([ctx[i] + q_from]), bt[i:i + 1].copy())
