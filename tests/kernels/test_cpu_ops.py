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


def _bf16_ulps(a: torch.Tensor, ref: torch.Tensor) -> int:
    """Largest distance in bf16 units in the last place between a (bf16) and the float32
    reference rounded to bf16 (0: every element rounds the same)."""
    ai = a.view(torch.int16).int()
    ri = ref.to(torch.bfloat16).view(torch.int16).int()
    return int((ai - ri).abs().max())


def test_bfloat16_kernels_round_float32_maths_once(ops):
    """bf16 storage, float32 arithmetic: each op's output is the float32 result on the
    bf16 inputs, rounded to bf16 once (at most 1 ulp from torch's rounding of the float32
    reference, which computes exp/rsqrt slightly differently)."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(37, 200, generator=g) * 4).bfloat16()
    out = torch.empty(37, 100, dtype=torch.bfloat16)
    ops.silu_and_mul(out, x)
    xf = x.float()
    assert _bf16_ulps(out, F.silu(xf[:, :100]) * xf[:, 100:]) <= 1

    x, res = torch.randn(19, 576, generator=g).bfloat16(), torch.randn(19, 576, generator=g).bfloat16()
    w = torch.rand(576, generator=g).bfloat16()
    x2, res2 = x.clone(), res.clone()
    ops.fused_add_rms_norm(x2, res2, w, 1e-5)
    ref_res = res.float() + x.float()
    assert _bf16_ulps(res2, ref_res) == 0                         # one rounding of the exact sum
    assert _bf16_ulps(x2, rms_norm(res2.float(), w.float(), 1e-5)) <= 1

    T, H, hd = 13, 12, 64
    qk = torch.randn(T, H, hd, generator=g).bfloat16()
    cos, sin = torch.rand(T, hd // 2, generator=g), torch.rand(T, hd // 2, generator=g)
    ref = apply_rotary(qk.float(), cos.unsqueeze(1), sin.unsqueeze(1))
    ops.rotary_embedding(qk, cos, sin)
    assert _bf16_ulps(qk, ref) <= 1

    k, v = torch.randn(5, 3, 64, generator=g).bfloat16(), torch.randn(5, 3, 64, generator=g).bfloat16()
    cache = torch.zeros(2, 10, 3, 64, dtype=torch.bfloat16)
    slots = torch.tensor([7, 0, 3, 9, 4])
    ops.reshape_and_cache(k, v, cache[0], cache[1], slots)
    assert torch.equal(cache[0][slots], k) and torch.equal(cache[1][slots], v)


def test_bfloat16_rounding_matches_torch(ops):
    """The kernels' float32 -> bf16 rounding is torch's: nearest, ties to even, overflow
    to inf, NaN stays NaN. Checked on fused_add_rms_norm's residual, residual + x, whose
    float32 sum of two bf16 values is exact, so only the final rounding is tested."""
    a = [1.0, 1.0, 1.0 + 2 ** -7, -1.0, 3.0e38, float("inf"), 1.5, 256.0] * 2
    b = [2 ** -8, 3 * 2 ** -8, 2 ** -8, -(2 ** -8), 3.0e38, float("-inf"), 2 ** -20, 1.0] * 2
    res = torch.tensor(a).bfloat16().view(1, -1)
    x = torch.tensor(b).bfloat16().view(1, -1)
    ref = (res.float() + x.float()).bfloat16()
    r2 = res.clone()
    ops.fused_add_rms_norm(x.clone(), r2, torch.ones(16, dtype=torch.bfloat16), 1e-5)
    assert torch.equal(r2.isnan(), ref.isnan()) and bool(ref.isnan().any())
    assert torch.equal(r2[~r2.isnan()], ref[~ref.isnan()])
    assert r2[0, 0] == 1.0 and r2[0, 2] == 1.0 + 2 ** -6    # the two ties went to even


def test_rms_norm_row_does_not_depend_on_batch(ops):
    """A row normalised alone equals the same row inside a batch, bit for bit, in both
    dtypes (fixed-order reduction)."""
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16):
        x, res = torch.randn(33, 576, generator=g).to(dtype), torch.randn(33, 576, generator=g).to(dtype)
        w = torch.rand(576, generator=g).to(dtype)
        xb, rb = x.clone(), res.clone()
        ops.fused_add_rms_norm(xb, rb, w, 1e-5)
        for i in (0, 17, 32):
            x1, r1 = x[i:i + 1].clone(), res[i:i + 1].clone()
            ops.fused_add_rms_norm(x1, r1, w, 1e-5)
            assert torch.equal(x1[0], xb[i]) and torch.equal(r1[0], rb[i])
