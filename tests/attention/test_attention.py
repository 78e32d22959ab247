"""Paged attention backends against a naive reference: a mixed batch of decodes, a prompt
chunk on top of cached context, and a fresh prompt, with blocks scattered in the cache."""
from __future__ import annotations

import pytest
import torch
from attention_helpers import _batch, _naive, _one_request

from pagedllm.attention.registry import get_attention_backend


# Tolerances against the float32 reference: float32 to rounding; bfloat16 inputs are the
# reference's inputs rounded to bf16 (so the reference is exact for them), and the output
# is rounded once to bf16 (relative error <= 2^-8) on values of magnitude ~1.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _as(dtype, *tensors):
    return [t.to(dtype) for t in tensors]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["torch", "cpu_kernel"])
def test_backend_matches_naive(name, dtype):
    c, layer_cache, q, k, v, info = _batch()
    layer_cache, q, k, v = _as(dtype, layer_cache, q, k, v)
    backend = get_attention_backend(name, torch.device("cpu"), dtype)
    if name == "cpu_kernel":
        assert backend.kernels is not None, "the C++ kernel did not build"
    ref, ref_cache = _naive(*_as(torch.float32, layer_cache, q, k, v), c, info, 0.125)
    cache = layer_cache.clone()
    out = backend.forward(q, k, v, cache, backend.build_metadata(c), 0.125)
    assert out.dtype == dtype
    assert (out.float() - ref).abs().max().item() < TOL[dtype]
    assert torch.equal(cache.float(), ref_cache)  # K/V written exactly at the slot mapping


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nh,nkv,hd", [(8, 2, 128), (4, 4, 64), (6, 2, 32), (12, 4, 24)])
def test_cpu_kernel_head_shapes(nh, nkv, hd, dtype):
    """Other GQA groupings and head sizes: the AVX2 path (head_dim a multiple of 64, any
    group size) and the generic path (other head sizes) agree with the reference."""
    c, layer_cache, q, k, v, info = _batch(seed=1, nh=nh, nkv=nkv, hd=hd)
    layer_cache, q, k, v = _as(dtype, layer_cache, q, k, v)
    backend = get_attention_backend("cpu_kernel", torch.device("cpu"), dtype)
    assert backend.kernels is not None, "the C++ kernel did not build"
    scale = hd ** -0.5
    ref, _ = _naive(*_as(torch.float32, layer_cache, q, k, v), c, info, scale)
    out = backend.forward(q, k, v, layer_cache.clone(), backend.build_metadata(c), scale)
    assert (out.float() - ref).abs().max().item() < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_result_does_not_depend_on_batch_or_chunking(dtype):
    """Each (query, head) is computed alone: a decode alone equals the same decode among
    neighbours, bit for bit; a prompt chunk's queries run one at a time (as decodes over
    the K/V the earlier ones wrote) or in other chunk splits equal the whole chunk's."""
    c, layer_cache, q, k, v, info = _batch()
    layer_cache, q, k, v = _as(dtype, layer_cache, q, k, v)
    backend = get_attention_backend("cpu_kernel", torch.device("cpu"), dtype)
    full_cache = layer_cache.clone()
    full = backend.forward(q, k, v, full_cache, backend.build_metadata(c), 0.125)
    i = 3  # the 290-token decode, alone
    one = _one_request(c, info, i, 0, 1)
    alone = backend.forward(q[i:i + 1], k[i:i + 1], v[i:i + 1], layer_cache.clone(),
                            backend.build_metadata(one), 0.125)
    assert torch.equal(alone[0], full[i])
    # the 33-token chunk over 47 cached tokens: split as 1 + 15 + 17, and one by one
    _assert_chunk_splits_equal(backend, c, info, layer_cache, q, k, v, full, 8, ([0, 1, 16, 33], list(range(34))))


def _assert_chunk_splits_equal(backend, c, info, layer_cache, q, k, v, full, i, all_splits):
    """Request i of ``_batch`` run in pieces (each list of ``all_splits`` gives the query
    boundaries, later pieces over the K/V the earlier wrote) equals ``full``'s rows."""
    qsl = info[4]
    for splits in all_splits:
        cache = layer_cache.clone()
        parts = []
        for a, b in zip(splits, splits[1:]):
            t0 = qsl[i]
            md = backend.build_metadata(_one_request(c, info, i, a, b))
            parts.append(backend.forward(q[t0 + a:t0 + b], k[t0 + a:t0 + b], v[t0 + a:t0 + b], cache, md, 0.125))
        assert torch.equal(torch.cat(parts), full[qsl[i]:qsl[i + 1]])


def test_kernel_rejects_bad_metadata():
    """A block id past the cache or a seq_len below the query count is an error, not a
    read out of bounds."""
    c, layer_cache, q, k, v, info = _batch()
    backend = get_attention_backend("cpu_kernel", torch.device("cpu"), torch.float32)
    md = backend.build_metadata(c)
    md.block_table[0, 0] = 10_000
    with pytest.raises(RuntimeError, match="out of range"):
        backend.forward(q, k, v, layer_cache.clone(), md, 0.125)
    c, layer_cache, q, k, v, info = _batch()    # (the metadata shares the batch's arrays)
    md = backend.build_metadata(c)
    md.seq_lens[7] = 3
    with pytest.raises(RuntimeError, match="query length"):
        backend.forward(q, k, v, layer_cache.clone(), md, 0.125)


@pytest.mark.parametrize("name", ["torch", "cpu_kernel"])
def test_attention_layer_bound_to_its_layer_cache(name):
    """The model's Attention layer, bound by bind_kv_cache to layer 1 of a two-layer cache
    and given the step's metadata by the forward context, computes what the backend
    computes and writes only its own layer's K/V."""
    from torch import nn

    from pagedllm.forward_context import set_forward_context
    from pagedllm.layers import bind_kv_cache
    from pagedllm.layers.attention import Attention

    c, layer_cache, q, k, v, info = _batch()
    backend = get_attention_backend(name, torch.device("cpu"), torch.float32)
    ref, ref_cache = _naive(layer_cache, q, k, v, c, info, 0.125)
    kv_cache = torch.stack([layer_cache, layer_cache])        # [layers, 2, slots, kv_heads, hd]
    model = nn.ModuleList(Attention(9, 64, 0.125, 3, i, torch.float32, torch.device("cpu")) for i in range(2))
    bind_kv_cache(model, kv_cache, backend)
    with set_forward_context(backend.build_metadata(c)):
        out = model[1](q, k, v)
    assert (out - ref).abs().max().item() < 1e-5
    assert torch.equal(kv_cache[1], ref_cache) and torch.equal(kv_cache[0], layer_cache)


def _kernels_bf16():
    from pagedllm.kernels.cpu import kernels_for
    k = kernels_for(torch.device("cpu"), torch.bfloat16)
    if k is None:
        pytest.skip("the C++ kernels did not build")
    return k


def test_amx_scores_apply_only_where_they_can():
    """The AMX q.k path is taken for a bf16 model over a bf16 cache with head_dim % 32 == 0,
    block_size % 16 == 0 and no sliding window, on a CPU with AMX-BF16, and never else."""
    k = _kernels_bf16()
    bf, f32 = torch.bfloat16, torch.float32
    on_this_cpu = k.amx_bf16_available()
    assert k.paged_attention_amx_applies(bf, bf, 64, 16, 0) == on_this_cpu
    assert k.paged_attention_amx_applies(bf, bf, 96, 32, 0) == on_this_cpu
    for args in [(f32, f32, 64, 16, 0), (bf, f32, 64, 16, 0), (f32, bf, 64, 16, 0),
                 (bf, torch.float8_e4m3fn, 64, 16, 0), (bf, bf, 48, 16, 0), (bf, bf, 64, 8, 0),
                 (bf, bf, 64, 16, 128)]:
        assert not k.paged_attention_amx_applies(*args), args
    k.paged_attention_set_amx(False)
    try:
        assert not k.paged_attention_amx_applies(bf, bf, 64, 16, 0)
    finally:
        k.paged_attention_set_amx(True)
    # the start-up line names the AMX scores only for the layers that get them
    backend = get_attention_backend("cpu_kernel", torch.device("cpu"), bf)
    label = "AMX-BF16 q.k scores"
    assert (label in backend.describe(64, 16, [None, None])) == on_this_cpu
    assert label not in backend.describe(64, 8, [None]) and label not in backend.describe(48, 16, [None])
    assert label not in backend.describe()
    assert ("in the 1 of 2 layers without a sliding window" in backend.describe(64, 16, [512, None])) == on_this_cpu
    assert backend.amx_layers(64, 16, [None, 512, None]) == (2 if on_this_cpu else 0)
    f32 = get_attention_backend("cpu_kernel", torch.device("cpu"), torch.float32)
    assert label not in f32.describe(64, 16, [None]) and f32.amx_layers(64, 16, [None]) == 0


@pytest.mark.parametrize("dpbf16", [True, False])
@pytest.mark.parametrize("bs", [16, 32])
def test_bf16_scores_paths_agree_with_reference_and_are_invariant(bs, dpbf16):
    """bf16 over a bf16 cache, with the AMX scores on (where the CPU has AMX-BF16) and off,
    and the VDPBF16PS scores (where the CPU has AVX512-BF16) on and off: each matches the
    float32 reference; and with blocks of 32 (two 16-key tiles a block), a decode alone
    equals it among neighbours and a chunk split any way equals the whole, bit for bit."""
    k = _kernels_bf16()
    c, layer_cache, q, kn, vn, info = _batch(seed=2, bs=bs)
    layer_cache, q, kn, vn = _as(torch.bfloat16, layer_cache, q, kn, vn)
    backend = get_attention_backend("cpu_kernel", torch.device("cpu"), torch.bfloat16)
    ref, _ = _naive(*_as(torch.float32, layer_cache, q, kn, vn), c, info, 0.125)
    outs = {}
    k.paged_attention_set_dpbf16(dpbf16)
    try:
        for amx in (True, False):
            k.paged_attention_set_amx(amx)
            try:
                outs[amx] = backend.forward(q, kn, vn, layer_cache.clone(), backend.build_metadata(c), 0.125)
            finally:
                k.paged_attention_set_amx(True)
            assert (outs[amx].float() - ref).abs().max().item() < TOL[torch.bfloat16], amx
        full = outs[True]
        i = 3
        alone = backend.forward(q[i:i + 1], kn[i:i + 1], vn[i:i + 1], layer_cache.clone(),
                                backend.build_metadata(_one_request(c, info, i, 0, 1)), 0.125)
        assert torch.equal(alone[0], full[i])
        _assert_chunk_splits_equal(backend, c, info, layer_cache, q, kn, vn, full, 8,
                                   ([0, 5, 21, 33], list(range(34))))
    finally:
        k.paged_attention_set_dpbf16(True)


def test_vdpbf16ps_scores_apply_only_where_they_can():
    """VDPBF16PS q.k scores: a bf16 model over a bf16 cache with head_dim % 64 == 0 on a CPU
    with AVX512-BF16 (and its switch on), never else; the start-up line names them; and
    where they apply, they give other bits than the float32 FMA path (so the switch is
    real) while both stay within the reference's tolerance."""
    from pagedllm.platform import cpu_features

    k = _kernels_bf16()
    bf, f32 = torch.bfloat16, torch.float32
    f = cpu_features()
    on_this_cpu = f.avx512_bf16 and f.avx512f and f.avx512bw and f.avx512vl
    assert k.paged_attention_dpbf16_applies(bf, bf, 64) == on_this_cpu
    assert k.paged_attention_dpbf16_applies(bf, bf, 256) == on_this_cpu
    for args in [(f32, f32, 64), (bf, f32, 64), (f32, bf, 64), (bf, torch.float8_e4m3fn, 64), (bf, bf, 96)]:
        assert not k.paged_attention_dpbf16_applies(*args), args
    backend = get_attention_backend("cpu_kernel", torch.device("cpu"), bf)
    label = "AVX512-BF16 q.k scores"
    amx = k.paged_attention_amx_applies(bf, bf, 64, 16, 0)
    assert (label in backend.describe(64, 16, [None])) == (on_this_cpu and not amx)
    assert label not in backend.describe(96, 16, [None])
    k.paged_attention_set_dpbf16(False)
    try:
        assert not k.paged_attention_dpbf16_applies(bf, bf, 64)
        assert label not in backend.describe(64, 16, [None])
    finally:
        k.paged_attention_set_dpbf16(True)
    if not on_this_cpu or amx:
        return
    c, layer_cache, q, kn, vn, info = _batch(seed=5, nh=9, nkv=3, hd=64)
    layer_cache, q, kn, vn = _as(bf, layer_cache, q, kn, vn)
    outs = []
    for on in (True, False):
        k.paged_attention_set_dpbf16(on)
        try:
            outs.append(backend.forward(q, kn, vn, layer_cache.clone(), backend.build_metadata(c), 0.125))
        finally:
            k.paged_attention_set_dpbf16(True)
    assert not torch.equal(outs[0], outs[1])
