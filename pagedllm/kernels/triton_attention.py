"""Paged attention in Triton: the K/V write (``reshape_and_cache``) and one kernel for a
flattened mixed batch (``unified_attention``), with a split-K path for long decodes.

Design after vLLM's unified Triton attention and its paper (Ringlein et al., arXiv
2511.11581): one program per (block of query tokens of one request, KV head), the query
heads that share a KV head packed into its rows, K/V read in place through the block
table, online softmax in float32; a program finds its request by a binary search over
``query_start_loc``, so the grid depends on host ints only (CUDA-graph capturable). Cache
layout ``[num_slots, num_kv_heads, head_dim]`` per layer, slot = block * block_size +
offset. fp8 caches hold fp8(x / scale) (nearest even, saturated), encoded by integer ops in
the kernel: the Triton interpreter's float->fp8 cast is not round-to-nearest-even; integer
ops are exact on both. Runs on the CPU under ``TRITON_INTERPRET=1`` (set before triton is
imported). More: docs/notes/attention.md."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# (mantissa bits, exponent bias, largest finite value, NaN code) of each fp8 cache dtype
_FP8_FORMAT = {torch.float8_e4m3fn: (3, 7, 448.0, 0x7F), torch.float8_e5m2: (2, 15, 57344.0, 0x7F)}

# Split-K (``use_split_kv``): the decodes' launch splits when its longest sequence has at
# least this many tokens, and inside it only requests that long split (each segment a tile
# or more): a request's arithmetic depends on its own length, never on its batch.
SPLIT_KV_MIN_SEQ_LEN = 256
NUM_SEGMENTS = 16       # KV segments per (query, KV head) on the split-K path


@triton.jit
def _fp8_code(y, MANT: tl.constexpr, BIAS: tl.constexpr, FMAX: tl.constexpr, NAN_CODE: tl.constexpr):
    """uint8 fp8 codes of float32 ``y``: round to nearest even, |y| above FMAX (inf too)
    saturated to FMAX, NaN -> NAN_CODE; the sign kept (also for -0.0 and NaN)."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.minimum(tl.abs(y), FMAX).to(tl.int32, bitcast=True)
    e = (a >> 23) - 127                               # unbiased float32 exponent
    SHIFT: tl.constexpr = 23 - MANT
    # normal fp8: rebias the exponent, drop SHIFT mantissa bits rounding to nearest even
    # (a carry out of the mantissa correctly bumps the exponent)
    normal = (a - ((127 - BIAS) << 23) + ((1 << (SHIFT - 1)) - 1) + ((a >> SHIFT) & 1)) >> SHIFT
    # subnormal fp8: the code is the integer nearest (ties even) to a / 2^(1 - BIAS - MANT)
    full = (a & 0x7FFFFF) | 0x800000
    s = tl.minimum(24 - e - BIAS - MANT, 30)          # > 0 here; 30: anything below rounds to 0
    q = full >> s
    rem = full & ((1 << s) - 1)
    half = 1 << (s - 1)
    sub = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    code = tl.where(e >= 1 - BIAS, normal, sub)
    code = tl.where(y != y, NAN_CODE, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def _reshape_and_cache_kernel(
        key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr, k_scale, v_scale,
        stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
        stride_kcs, stride_kch, stride_kcd, stride_vcs, stride_vch, stride_vcd,
        NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
        SCALED: tl.constexpr, FP8: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
        FMAX: tl.constexpr, NAN_CODE: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:                                      # a padding token
        return
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    if SCALED:                                        # correctly rounded, as torch's division
        k = tl.math.div_rn(k.to(tl.float32), k_scale)
        v = tl.math.div_rn(v.to(tl.float32), v_scale)
    if FP8:                                           # the caches are uint8 views
        k = _fp8_code(k.to(tl.float32), MANT, BIAS, FMAX, NAN_CODE)
        v = _fp8_code(v.to(tl.float32), MANT, BIAS, FMAX, NAN_CODE)
    else:
        k = k.to(key_cache_ptr.dtype.element_ty)
        v = v.to(value_cache_ptr.dtype.element_ty)
    tl.store(key_cache_ptr + slot * stride_kcs + h * stride_kch + d * stride_kcd, k, mask=mask)
    tl.store(value_cache_ptr + slot * stride_vcs + h * stride_vch + d * stride_vcd, v, mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write token t's K/V at ``slot_mapping[t]`` (int64 [T]; < 0: skip, a padding token).
    key, value [T, num_kv_heads, head_dim] in the model dtype (rows may be strided); caches
    [num_slots, num_kv_heads, head_dim] in the model dtype, another float dtype or fp8,
    holding ``x / scale`` rounded once to nearest even (fp8: saturated at the format's max),
    bit for bit as ``torch_backend.quantize_kv``. Raises ValueError on mismatched shapes."""
    T, nkv, hd = key.shape
    if value.shape != key.shape or key_cache.shape[1:] != (nkv, hd) or value_cache.shape != key_cache.shape:
        raise ValueError(f"reshape_and_cache: key {tuple(key.shape)}, value {tuple(value.shape)}, "
                         f"caches {tuple(key_cache.shape)}, {tuple(value_cache.shape)} do not match")
    if T == 0:
        return
    fp8 = key_cache.dtype in FP8_DTYPES
    mant, bias, fmax, nan_code = _FP8_FORMAT.get(key_cache.dtype, (0, 0, 0.0, 0))
    kc = key_cache.view(torch.uint8) if fp8 else key_cache
    vc = value_cache.view(torch.uint8) if fp8 else value_cache
    _reshape_and_cache_kernel[(T,)](
        key, value, kc, vc, slot_mapping, float(k_scale), float(v_scale),
        *key.stride(), *value.stride(), *kc.stride(), *vc.stride(),
        NUM_KV_HEADS=nkv, HEAD_DIM=hd, BLOCK_H=triton.next_power_of_2(nkv),
        BLOCK_D=triton.next_power_of_2(hd), SCALED=(k_scale != 1.0 or v_scale != 1.0),
        FP8=fp8, MANT=mant, BIAS=bias, FMAX=fmax, NAN_CODE=nan_code)


@triton.jit
def _request_of(qsl_ptr, num_reqs, q_block, BLOCK_Q: tl.constexpr):
    """The request whose query blocks hold global block ``q_block``: the last i < num_reqs
    with first_block(i) <= q_block (first_block(i) = qsl[i] // BLOCK_Q + i; qsl[i] when
    BLOCK_Q is 1). Binary search, log2(num_reqs) loads."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_reqs - 1                   # tensors, not constexprs: both change in the loop
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(qsl_ptr + mid)
        if BLOCK_Q > 1:
            first = first // BLOCK_Q + mid
        if first <= q_block:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _attention_kernel(
        q_ptr, key_cache_ptr, value_cache_ptr, out_ptr, seg_acc_ptr, seg_max_ptr, seg_sum_ptr,
        qsl_ptr, seq_lens_ptr, block_table_ptr, num_reqs,
        qk_scale, k_scale, v_scale, sliding_window,
        stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,
        stride_kcs, stride_kch, stride_kcd, stride_vcs, stride_vch, stride_vcd, stride_bt,
        NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
        NUM_SEGMENTS: tl.constexpr, SPLIT_MIN_SEQ: tl.constexpr, FP8: tl.constexpr,
        DOT_PRECISION: tl.constexpr):
    # block numbers start at the first request's (qsl[0] > 0 when the decodes ran apart)
    if BLOCK_Q > 1:
        q_block = tl.program_id(0) + tl.load(qsl_ptr) // BLOCK_Q
    else:
        q_block = tl.program_id(0) + tl.load(qsl_ptr)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    req = _request_of(qsl_ptr, num_reqs, q_block, BLOCK_Q)
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    if BLOCK_Q > 1:
        first_q = (q_block - (q_start // BLOCK_Q + req)) * BLOCK_Q
    else:
        first_q = q_block - q_start
    if first_q >= q_len:            # a spare block (the grid is an upper bound) or padding
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context = seq_len - q_len

    # rows: BLOCK_Q queries x the GROUP query heads of this KV head
    rows = tl.arange(0, BLOCK_M)
    qi = first_q + rows // GROUP                    # query index within the request
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (qi < q_len)
    pos = context + qi                              # the query's position in its sequence
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    tok = (q_start + qi).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # keys [lo, hi) cover every query of the block; split into segments of whole tiles
    last_q = tl.minimum(first_q + BLOCK_Q, q_len) - 1
    hi = context + last_q + 1
    lo = tl.where(sliding_window > 0, tl.maximum(context + first_q - sliding_window + 1, 0), 0)
    tile_lo = lo // TILE_N
    tile_hi = tl.cdiv(hi, TILE_N)
    # a request shorter than SPLIT_MIN_SEQ keeps every tile in segment 0 (the others are empty
    # and the reduce returns acc / l exactly as one pass does): its result never depends on
    # whether its batch took the split path
    per_segment = tl.where(seq_len < SPLIT_MIN_SEQ, tile_hi - tile_lo, tl.cdiv(tile_hi - tile_lo, NUM_SEGMENTS))
    t_begin = tile_lo + segment * per_segment
    t_end = tl.minimum(t_begin + per_segment, tile_hi)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)      # running max (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)                    # running sum of exp2
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    for t in range(t_begin, t_end):
        keys = t * TILE_N + tl.arange(0, TILE_N)
        k_ok = keys < hi
        block = tl.load(bt_row + keys // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        slot = block * BLOCK_SIZE + keys % BLOCK_SIZE
        k = tl.load(key_cache_ptr + slot[None, :] * stride_kcs + kv_head * stride_kch + d[:, None] * stride_kcd,
                    mask=k_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(value_cache_ptr + slot[:, None] * stride_vcs + kv_head * stride_vch + d[None, :] * stride_vcd,
                    mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        if FP8:
            k = k.to(tl.float32) * k_scale
            v = v.to(tl.float32) * v_scale
        s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale
        seen = (keys[None, :] <= pos[:, None]) & k_ok[None, :]
        seen = seen & ((sliding_window <= 0) | (keys[None, :] > pos[:, None] - sliding_window))
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)   # rows with nothing seen yet
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SEGMENTS == 1:
        out = acc / l_i[:, None]
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:                           # partial (max, sum, unnormalised acc); empty segments too
        idx = (tok * NUM_HEADS + head) * NUM_SEGMENTS + segment
        tl.store(seg_max_ptr + idx, m_i, mask=row_ok)
        tl.store(seg_sum_ptr + idx, l_i, mask=row_ok)
        tl.store(seg_acc_ptr + idx[:, None] * BLOCK_D + d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _reduce_segments_kernel(
        out_ptr, seg_acc_ptr, seg_max_ptr, seg_sum_ptr, qsl_ptr, num_reqs,
        stride_ot, stride_oh, stride_od,
        NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SEGMENTS: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    if t >= tl.load(qsl_ptr + num_reqs):            # a padding token: no request, no partials
        return
    seg = tl.arange(0, NUM_SEGMENTS)
    d = tl.arange(0, BLOCK_D)
    base = (t.to(tl.int64) * NUM_HEADS + h) * NUM_SEGMENTS
    m = tl.load(seg_max_ptr + base + seg)
    m_all = tl.max(m, 0)                            # finite: some segment saw the query's own key
    w = tl.exp2(m - m_all)                          # 0 for empty segments (max -inf)
    l_all = tl.sum(tl.load(seg_sum_ptr + base + seg) * w, 0)
    acc = tl.load(seg_acc_ptr + (base + seg)[:, None] * BLOCK_D + d[None, :])
    out = tl.sum(acc * w[:, None], 0) / l_all
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d * stride_od, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def use_split_kv(max_query_len: int, max_seq_len: int | None) -> bool:
    """Whether a launch of decodes (``max_query_len`` 1) takes the split path: its longest
    sequence has ``SPLIT_KV_MIN_SEQ_LEN`` tokens or more (None: unknown, no split)."""
    return max_query_len <= 1 and max_seq_len is not None and max_seq_len >= SPLIT_KV_MIN_SEQ_LEN


def split_kv_scratch(num_tokens: int, num_heads: int, head_dim: int, device: torch.device,
                     num_segments: int = NUM_SEGMENTS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scratch for the split-K path: (acc [num_tokens, num_heads, num_segments,
    next_pow2(head_dim)], max, sum [num_tokens, num_heads, num_segments]), float32."""
    d = max(16, triton.next_power_of_2(head_dim))
    acc = torch.empty(num_tokens, num_heads, num_segments, d, dtype=torch.float32, device=device)
    mx = torch.empty(num_tokens, num_heads, num_segments, dtype=torch.float32, device=device)
    return acc, mx, torch.empty_like(mx)


def unified_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                      block_size: int, scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                      sliding_window: int = 0, max_query_len: int = 1, max_seq_len: int | None = None,
                      split_kv: bool | None = None, num_segments: int = NUM_SEGMENTS,
                      scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                      num_decodes: int | None = None) -> None:
    """Causal paged attention of a flattened batch into ``out``, reading no device value on
    the host. q, out [T, num_heads, head_dim] (float32/float16/bfloat16; q may be strided);
    caches [num_slots, num_kv_heads, head_dim] (q's dtype, or fp8 read as element * scale);
    request i owns queries ``query_start_loc[i]:[i+1]`` (int32 [B+1]), the LAST of its
    ``seq_lens[i]`` (int32 [B]) tokens, keys through ``block_table[i]`` (int32 [B, max_blocks]);
    tokens past ``query_start_loc[B]`` are padding (rows of ``out`` left undefined).
    ``sliding_window`` 0 = none, else query p sees keys p - w + 1 .. p. The first
    ``num_decodes`` requests have one query each (None: all when ``max_query_len`` <= 1, else
    none); they run in their own launch (16-key tiles, split-K when ``split_kv`` is True, or
    None and ``use_split_kv``), the rest in another (32-key tiles, never split), so a
    request's result does not depend on its batch. ``max_query_len``, ``max_seq_len``: host
    ints; ``scratch``: preallocated ``split_kv_scratch`` for the decodes. Raises ValueError
    on inconsistent shapes."""
    T, nh, hd = q.shape
    nkv = key_cache.shape[1]
    B = query_start_loc.shape[0] - 1
    if nh % nkv or key_cache.shape[2] != hd or value_cache.shape != key_cache.shape or out.shape != q.shape:
        raise ValueError(f"unified_attention: q {tuple(q.shape)}, caches {tuple(key_cache.shape)}, "
                         f"{tuple(value_cache.shape)}, out {tuple(out.shape)} do not match")
    if block_table.shape[0] < B or seq_lens.shape[0] < B:
        raise ValueError(f"unified_attention: {B} requests but block_table {tuple(block_table.shape)}, "
                         f"seq_lens {tuple(seq_lens.shape)}")
    nd = (B if max_query_len <= 1 else 0) if num_decodes is None else num_decodes
    if not 0 <= nd <= min(B, T):
        raise ValueError(f"unified_attention: num_decodes {nd} outside 0..{min(B, T)}")
    if T == 0 or B == 0:
        return
    group = nh // nkv
    block_m = max(16, triton.next_power_of_2(group))
    block_d = max(16, triton.next_power_of_2(hd))
    scales = (float(scale) * 1.4426950408889634, float(k_scale), float(v_scale), int(sliding_window or 0))
    consts = dict(NUM_HEADS=nh, GROUP=group, HEAD_DIM=hd, BLOCK_D=block_d, BLOCK_SIZE=block_size,
                  BLOCK_M=block_m, SPLIT_MIN_SEQ=SPLIT_KV_MIN_SEQ_LEN, FP8=key_cache.dtype in FP8_DTYPES,
                  DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    strides = (*q.stride(), *out.stride(), *key_cache.stride(), *value_cache.stride(), block_table.stride(0))
    if nd:
        split = use_split_kv(1, max_seq_len) if split_kv is None else split_kv
        nseg = num_segments if split else 1
        acc = mx = sm = out                         # not read without a split
        if split:
            acc, mx, sm = scratch if scratch is not None else split_kv_scratch(nd, nh, hd, q.device, nseg)
            if acc.shape[0] < nd or acc.shape[1:] != (nh, nseg, block_d) or mx.shape[1:] != (nh, nseg):
                raise ValueError(f"unified_attention: scratch {tuple(acc.shape)} does not fit "
                                 f"[{nd}, {nh}, {nseg}, {block_d}]")
        qsl = query_start_loc[:nd + 1]
        _attention_kernel[(nd, nkv, nseg)](
            q, key_cache, value_cache, out, acc, mx, sm, qsl, seq_lens, block_table, nd, *scales, *strides,
            BLOCK_Q=1, TILE_N=16, NUM_SEGMENTS=nseg, **consts)
        if split:
            _reduce_segments_kernel[(nd, nh)](
                out, acc, mx, sm, qsl, nd, *out.stride(),
                NUM_HEADS=nh, HEAD_DIM=hd, BLOCK_D=block_d, NUM_SEGMENTS=nseg)
    if nd < B:
        # the rest: request nd's queries start at token nd (one token per decode before it)
        block_q = block_m // group if max_query_len > 1 else 1
        rest_t, rest_b = T - nd, B - nd
        grid = rest_t if block_q == 1 else rest_t // block_q + rest_b + 1
        _attention_kernel[(grid, nkv, 1)](
            q, key_cache, value_cache, out, out, out, out, query_start_loc[nd:], seq_lens[nd:], block_table[nd:],
            rest_b, *scales, *strides, BLOCK_Q=block_q, TILE_N=32, NUM_SEGMENTS=1, **consts)
