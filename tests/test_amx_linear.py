"""The AMX bfloat16 linear kernel (kernels/csrc/amx_linear.cpp, AMXBF16LinearMethod): its
weight layout, its values against a float64 reference, bitwise row invariance at every
row count, and its place in get_linear_method. The kernel tests are skipped on CPUs
without AMX-BF16 (the AMD EPYCs): not faked there; the layout test runs everywhere."""
from __future__ import annotations

import pytest
import torch

from pagedllm import platform
from pagedllm.layers import batch_invariance as bi
from pagedllm.layers.linear import (AMXBF16LinearMethod, OneDNNPackedLinearMethod, ReplicatedLinear,
                                    UnquantizedLinearMethod, _dense_linear_method, amx_bf16_available,
                                    get_linear_method, pack_amx_tiles)
from pagedllm.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

CPU, BF16 = torch.device("cpu"), torch.bfloat16
needs_amx = pytest.mark.skipif(not amx_bf16_available(CPU, BF16),
                               reason="no AMX-BF16 on this CPU (or PAGEDLLM_AMX=0, or no C++ kernels)")


def _ops():
    from pagedllm.layers.utils import cpu_kernels_for
    return cpu_kernels_for(CPU, BF16)


def test_pack_layout_is_amx_vnni():
    w = (torch.arange(48 * 64) % 251).reshape(48, 64).to(BF16)     # distinct enough, exact in bf16
    p = pack_amx_tiles(w, BF16)
    assert p.shape == (3, 2, 16, 32) and p.dtype == BF16 and p.is_contiguous()
    for nb, kb, r, n, j in [(0, 0, 0, 0, 0), (0, 0, 0, 0, 1), (1, 0, 3, 5, 1), (2, 1, 15, 15, 0), (2, 1, 7, 2, 1)]:
        assert p[nb, kb, r, 2 * n + j] == w[16 * nb + n, 32 * kb + 2 * r + j]
    with pytest.raises(ValueError, match="N % 16"):
        pack_amx_tiles(torch.zeros(40, 64, dtype=BF16), BF16)
    with pytest.raises(ValueError, match="K % 32"):
        pack_amx_tiles(torch.zeros(48, 48, dtype=BF16), BF16)


@needs_amx
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 33, 100, 300])
@pytest.mark.parametrize("fin, fout", [(64, 48), (576, 960), (1536, 576)])
def test_kernel_matches_float64_reference(rows, fin, fout):
    """float32 output within float32 accumulation error of the exact product; the bf16
    output is exactly the float32 accumulator (plus bias) rounded to nearest-even. Row
    counts cover one and two A tiles with tails; 48 outputs, an odd number of 16-column
    blocks."""
    g = torch.Generator().manual_seed(rows + fin)
    x = torch.randn(rows, fin, generator=g).to(BF16)
    w = torch.randn(fout, fin, generator=g).to(BF16)
    b = torch.randn(fout, generator=g).to(BF16)
    p = pack_amx_tiles(w, BF16)
    exact = x.double() @ w.double().T
    y32 = _ops().amx_bf16_linear(x, p, None, True)
    assert y32.dtype == torch.float32 and y32.shape == (rows, fout)
    torch.testing.assert_close(y32.double(), exact, rtol=0, atol=1e-5 * fin ** 0.5)
    y = _ops().amx_bf16_linear(x, p, b, False)
    assert y.dtype == BF16
    assert torch.equal(y, (_ops().amx_bf16_linear(x, p, None, True) + b.float()).to(BF16))


@needs_amx
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fin, fout", [(576, 960), (576, 3072), (1536, 576)])
def test_rows_are_bitwise_invariant_at_every_row_count(fin, fout, threads):
    """With cancellation weights and inputs (their exact sums are 0, so what comes out is
    the kernel's own rounding, which any change of summation order changes), every row
    count from 1 to 70 and a few larger ones give each row the bits it has in a 512-row
    call, at any place in the call."""
    w, x = bi.cancellation_inputs(fout, fin, 512, BF16, CPU)
    p = pack_amx_tiles(w, BF16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ref = _ops().amx_bf16_linear(x, p, None, False)
        assert ref.abs().max() > 0          # rounding error shows: the test can see order changes
        for m in list(range(1, 71)) + [96, 129, 255, 257, 383]:
            off = (7 * m) % (512 - m + 1)
            assert torch.equal(_ops().amx_bf16_linear(x[off:off + m].clone(), p, None, False), ref[off:off + m]), m
    finally:
        torch.set_num_threads(before)


def _layer(fin, fout, method, bias=True):
    layer = ReplicatedLinear(fin, fout, bias, BF16, CPU, method)
    g = torch.Generator().manual_seed(fin * fout)
    layer.weight.data.copy_(torch.randn(fout, fin, generator=g) * fin ** -0.5)
    if bias:
        layer.bias.data.copy_(torch.randn(fout, generator=g))
    dense = layer.weight.data.clone()
    method.process_weights_after_loading(layer)
    return layer, dense


@needs_amx
@pytest.mark.parametrize("fin, fout, packed", [(96, 64, True), (96, 40, False), (80, 64, False)])
def test_method_matches_dense_and_falls_back_for_odd_shapes(fin, fout, packed):
    """The method's layer computes x @ W.T + b as dense F.linear does (bf16 tolerance);
    shapes the tiles cannot hold (40 outputs, 80 inputs) compute through the fallback."""
    layer, w = _layer(fin, fout, AMXBF16LinearMethod())
    assert (layer.amx_weight is not None) == packed
    # the start-up line names the kernel that runs: the tiles, or the fallback's own name
    fallback = _dense_linear_method("cpu", BF16).name       # oneDNN-packed where it packs bf16
    assert layer.compute_path[1] == ("AMX bf16 (C++)" if packed else fallback)
    x = torch.randn(9, fin, generator=torch.Generator().manual_seed(1)).to(BF16)
    ref = (x.float() @ w.float().T + layer.bias.float())
    torch.testing.assert_close(layer(x).float(), ref, rtol=2e-2, atol=2e-2)
    if packed:
        assert layer.weight.numel() == 0       # the dense copy is released
        assert bi.probe_row_invariance(layer, fin, BF16, CPU, bi.probe_rows(fin, fout)) == []


@needs_amx
@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_on_amx(tied):
    g = torch.Generator().manual_seed(5)
    table, h = (torch.randn(320, 64, generator=g) * 0.1).to(BF16), torch.randn(6, 64, generator=g).to(BF16)
    method = AMXBF16LinearMethod()
    emb = VocabParallelEmbedding(320, 64, BF16, CPU)
    emb.weight.data.copy_(table)
    head = ParallelLMHead(320, 64, BF16, CPU, emb if tied else None, method)
    if not tied:
        head.weight.data.copy_(table)
    method.process_weights_after_loading(head)
    if tied:
        assert torch.equal(emb(torch.tensor([0, 319])), table[[0, 319]])   # the table stays dense
    logits = head(h)
    assert logits.dtype == torch.float32 and logits.shape == (6, 320)
    torch.testing.assert_close(logits, h.float() @ table.float().T, rtol=2e-2, atol=2e-2)
    assert torch.equal(head(h[2:3]), logits[2:3])


def test_get_linear_method_picks_amx_where_it_runs(monkeypatch):
    method = get_linear_method(CPU, BF16)
    if amx_bf16_available(CPU, BF16):
        assert isinstance(method, AMXBF16LinearMethod)
        assert platform.cpu_features().amx_bf16
    else:
        assert isinstance(method, (OneDNNPackedLinearMethod, UnquantizedLinearMethod))
    monkeypatch.setenv("PAGEDLLM_AMX", "0")
    assert not amx_bf16_available(CPU, BF16)
    assert not isinstance(get_linear_method(CPU, BF16), AMXBF16LinearMethod)
    assert not amx_bf16_available(CPU, torch.float32)


@needs_amx
def test_zero_inputs_give_the_bias():
    """K = 0 (an empty sum): every output is the bias (or 0), never a crash."""
    b = torch.arange(48, dtype=torch.float32).to(BF16)
    y = _ops().amx_bf16_linear(torch.empty(3, 0, dtype=BF16), torch.empty(3, 0, 16, 32, dtype=BF16), b, False)
    assert torch.equal(y, b.expand(3, 48))
    y = _ops().amx_int8_linear(torch.empty(3, 0, dtype=torch.uint8), torch.empty(3, 0, 16, 64, dtype=torch.int8),
                               torch.zeros(48), torch.ones(48), torch.ones(3), None, False)
    assert torch.equal(y, torch.zeros(3, 48))
    assert _ops().amx_u8s8_matmul(torch.empty(2, 0, dtype=torch.uint8),
                                  torch.empty(3, 0, 16, 64, dtype=torch.int8)).abs().sum() == 0
