"""The C++ elementwise CPU kernels (pagedllm/kernels/csrc/cpu_ops.cpp) against the torch
ops they replace, on strided views shaped as the model passes them."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels.cpu import load_cpu_kernels
from pagedllm.layers.layernorm import rms_norm
from pagedllm.layers.rotary_embedding import apply_rotary


@pytest.fixture(scope="module")
def ops():
    m = load_cpu_kernels()
    assert m is not None, "the C++ CPU kernels did not build"
    return m


def test_silu_and_mul(ops):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 2 * 100, generator=g) * 4
    out = torch.empty(37, 100)
    ops.silu_and_mul(out, x)
    ref = F.silu(x[:, :100]) * x[:, 100:]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_fused_add_rms_norm(ops):
    g = torch.Generator().manual_seed(1)
    x, res, w = torch.randn(19, 576, generator=g), torch.randn(19, 576, generator=g), torch.rand(576, generator=g)
    x2, res2 = x.clone(), res.clone()
    ops.fused_add_rms_norm(x2, res2, w, 1e-5)
    ref_res = res + x
    torch.testing.assert_close(res2, ref_res, rtol=0, atol=0)   # the add is exact
    torch.testing.assert_close(x2, rms_norm(ref_res, w, 1e-5), rtol=1e-5, atol=1e-6)


def test_rotary_in_place_on_strided_view(ops):
    g = torch.Generator().manual_seed(2)
    T, nh, nkv, hd = 13, 9, 3, 64
    qkv = torch.randn(T, (nh + 2 * nkv) * hd, generator=g)
    cos, sin = torch.rand(T, 1, hd // 2, generator=g), torch.rand(T, 1, hd // 2, generator=g)
    qk = qkv[:, : (nh + nkv) * hd].view(T, nh + nkv, hd)
    ref = apply_rotary(qk, cos, sin)
    v_before = qkv[:, (nh + nkv) * hd:].clone()
    ops.rotary_embedding(qk, cos.view(T, -1), sin.view(T, -1))
    torch.testing.assert_close(qk, ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(qkv[:, (nh + nkv) * hd:], v_before)    # v untouched


def test_reshape_and_cache(ops):
    g = torch.Generator().manual_seed(3)
    T, nkv, hd, slots = 21, 3, 64, 100
    qkv = torch.randn(T, 15 * hd, generator=g)
    k = qkv[:, 9 * hd: 12 * hd].view(T, nkv, hd)
    v = qkv[:, 12 * hd:].view(T, nkv, hd)
    cache = torch.zeros(2, slots, nkv, hd)
    slot_mapping = torch.randperm(slots, generator=g)[:T]
    ops.reshape_and_cache(k, v, cache[0], cache[1], slot_mapping)
    ref = torch.zeros_like(cache)
    ref[0].index_copy_(0, slot_mapping, k)
    ref[1].index_copy_(0, slot_mapping, v)
    assert torch.equal(cache, ref)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.reshape_and_cache(k, v, cache[0], cache[1], torch.full((T,), slots, dtype=torch.int64))
