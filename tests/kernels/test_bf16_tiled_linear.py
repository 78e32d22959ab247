"""The bfloat16 tiled linear kernels over AMX's packed weight layout: AMX tiles
(kernels/csrc/amx_linear.cpp, AMXBF16LinearMethod) and AVX512-BF16's VDPBF16PS
(kernels/csrc/bf16_linear_avx512.cpp, AVX512BF16LinearMethod): the layout, values against
a float64 reference, bitwise row invariance at every row count, float32 outputs (the LM
head's), and their place in get_linear_method. A kernel's tests are skipped on CPUs
without its ISA (not faked there); the layout test runs everywhere."""
from __future__ import annotations

import pytest
import torch

from pagedllm import platform
from pagedllm.layers import batch_invariance as bi
from pagedllm.layers.linear import (AMXBF16LinearMethod, AVX512BF16LinearMethod, OneDNNPackedLinearMethod,
                                    ReplicatedLinear, UnquantizedLinearMethod, _dense_linear_method,
                                    amx_bf16_available, avx512_bf16_available, get_linear_method,
                                    pack_amx_tiles)
from pagedllm.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

CPU, BF16 = torch.device("cpu"), torch.bfloat16
# (the kernel's name in the module, its method, whether it runs here)
KERNELS = [
    pytest.param("amx_bf16_linear", AMXBF16LinearMethod, id="amx",
                 marks=pytest.mark.skipif(not amx_bf16_available(CPU, BF16),
                                          reason="no AMX-BF16 on this CPU (or PAGEDLLM_AMX=0, or no C++ kernels)")),
    pytest.param("avx512_bf16_linear", AVX512BF16LinearMethod, id="avx512bf16",
                 marks=pytest.mark.skipif(not avx512_bf16_available(CPU, BF16),
                                          reason="no AVX512-BF16 on this CPU (or PAGEDLLM_AVX512_BF16=0, "
                                                 "or no C++ kernels)")),
]


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


@pytest.mark.parametrize("kernel, method", KERNELS)
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 16, 17, 32, 33, 100, 300])
@pytest.mark.parametrize("fin, fout", [(64, 48), (576, 960), (1536, 576)])
def test_kernel_matches_float64_reference(kernel, method, rows, fin, fout):
    """float32 output within float32 accumulation error of the exact product; the bf16
    output is exactly the float32 accumulator (plus bias) rounded to nearest-even. Row
    counts cover one and two AMX A tiles and the AVX-512 kernel's 6-row blocks with tails;
    48 outputs, an odd number of 16-column blocks (and not a whole 64-column group)."""
    run = getattr(_ops(), kernel)
    g = torch.Generator().manual_seed(rows + fin)
    x = torch.randn(rows, fin, generator=g).to(BF16)
    w = torch.randn(fout, fin, generator=g).to(BF16)
    b = torch.randn(fout, generator=g).to(BF16)
    p = pack_amx_tiles(w, BF16)
    exact = x.double() @ w.double().T
    y32 = run(x, p, None, True)
    assert y32.dtype == torch.float32 and y32.shape == (rows, fout)
    torch.testing.assert_close(y32.double(), exact, rtol=0, atol=1e-5 * fin ** 0.5)
    y = run(x, p, b, False)
    assert y.dtype == BF16
    assert torch.equal(y, (run(x, p, None, True) + b.float()).to(BF16))
    assert torch.equal(run(x, p, b, True), y32 + b.float())


@pytest.mark.parametrize("kernel, method", KERNELS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fin, fout", [(576, 960), (576, 3072), (1536, 576), (576, 560)])
def test_rows_are_bitwise_invariant_at_every_row_count(kernel, method, fin, fout, threads):
    """With cancellation weights and inputs (their exact sums are 0, so what comes out is
    the kernel's own rounding, which any change of summation order changes), every row
    count from 1 to 70 and a few larger ones give each row the bits it has in a 512-row
    call, at any place in the call, and the 512-row call the bits of a 1-thread call
    (560 columns: 35 16-column blocks, split 18 + 17 across two threads)."""
    run = getattr(_ops(), kernel)
    w, x = bi.cancellation_inputs(fout, fin, 512, BF16, CPU)
    p = pack_amx_tiles(w, BF16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ref = run(x, p, None, False)
        assert ref.abs().max() > 0          # rounding error shows: the test can see order changes
        torch.set_num_threads(1)
        assert torch.equal(run(x, p, None, False), ref)
        torch.set_num_threads(threads)
        for m in list(range(1, 71)) + [96, 129, 255, 257, 383]:
            off = (7 * m) % (512 - m + 1)
            assert torch.equal(run(x[off:off + m].clone(), p, None, False), ref[off:off + m]), m
    finally:
        torch.set_num_threads(before)


def _layer(fin, fout, method, bias=True):
    layer = ReplicatedLinear(fin, fout, bias, BF16, CPU, method)
    g = torch.Generator().manual_seed(fin * fout)
    layer.weight.data.copy_(torch.randn(fout, fin, generator=g) * fin ** -0.5)
    if bias:
        layer.bias.data.copy_(torch.randn(fout, generator=g))
    dense = layer.weight.data.clone()
    layer.float32_out = True        # as an LM head: apply_float32 works on every path
    method.process_weights_after_loading(layer)
    return layer, dense


@pytest.mark.parametrize("kernel, method_class", KERNELS)
@pytest.mark.parametrize("fin, fout, packed", [(96, 64, True), (96, 40, False), (80, 64, False)])
def test_method_matches_dense_and_falls_back_for_odd_shapes(kernel, method_class, fin, fout, packed):
    """The method's layer computes x @ W.T + b as dense F.linear does (bf16 tolerance);
    shapes the tiles cannot hold (40 outputs, 80 inputs) compute through the fallback."""
    layer, w = _layer(fin, fout, method_class())
    assert (layer.tiled_weight is not None) == packed
    # the start-up line names the kernel that runs: the tiles, or the fallback's own name
    fallback = _dense_linear_method("cpu", BF16).name       # oneDNN-packed where it packs bf16
    assert layer.compute_path[1] == (method_class.name if packed else fallback)
    x = torch.randn(9, fin, generator=torch.Generator().manual_seed(1)).to(BF16)
    ref = (x.float() @ w.float().T + layer.bias.float())
    torch.testing.assert_close(layer(x).float(), ref, rtol=2e-2, atol=2e-2)
    y32 = layer.linear_method.apply_float32(layer, x, layer.bias)
    assert y32.dtype == torch.float32
    torch.testing.assert_close(y32.double(), x.double() @ w.double().T + layer.bias.double(), rtol=0,
                               atol=1e-5 * fin ** 0.5)
    if packed:
        assert layer.weight.numel() == 0       # the dense copy is released
        assert bi.probe_row_invariance(layer, fin, BF16, CPU, bi.probe_rows(fin, fout)) == []


@pytest.mark.parametrize("kernel, method_class", KERNELS)
@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_float32_logits(kernel, method_class, tied):
    """The LM head's logits come out of the kernel in float32 (never rounded to bf16):
    within float32 accumulation error of the exact product of the same bf16 values."""
    g = torch.Generator().manual_seed(5)
    table, h = (torch.randn(320, 64, generator=g) * 0.1).to(BF16), torch.randn(6, 64, generator=g).to(BF16)
    method = method_class()
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
    torch.testing.assert_close(logits.double(), h.double() @ table.double().T, rtol=0, atol=1e-6)
    assert not torch.equal(logits, logits.to(BF16).float())     # not rounded through bf16
    assert torch.equal(head(h[2:3]), logits[2:3])


def test_get_linear_method_picks_the_tiled_kernels_where_they_run(monkeypatch):
    method = get_linear_method(CPU, BF16)
    if amx_bf16_available(CPU, BF16):
        assert isinstance(method, AMXBF16LinearMethod)
        assert platform.cpu_features().amx_bf16
    elif avx512_bf16_available(CPU, BF16):
        assert isinstance(method, AVX512BF16LinearMethod)
        assert platform.cpu_features().avx512_bf16
    else:
        assert isinstance(method, (OneDNNPackedLinearMethod, UnquantizedLinearMethod))
    assert not avx512_bf16_available(CPU, torch.float32)
    monkeypatch.setenv("PAGEDLLM_AMX", "0")
    assert not amx_bf16_available(CPU, BF16)
    monkeypatch.setenv("PAGEDLLM_AVX512_BF16", "0")
    assert not avx512_bf16_available(CPU, BF16)
    assert isinstance(get_linear_method(CPU, BF16), (OneDNNPackedLinearMethod, UnquantizedLinearMethod))
    assert not isinstance(get_linear_method(CPU, BF16), AMXBF16LinearMethod)
    assert not amx_bf16_available(CPU, torch.float32)


@pytest.mark.parametrize("kernel, method", KERNELS)
def test_zero_inputs_give_the_bias(kernel, method):
    """K = 0 (an empty sum): every output is the bias (or 0), never a crash."""
    b = torch.arange(48, dtype=torch.float32).to(BF16)
    y = getattr(_ops(), kernel)(torch.empty(3, 0, dtype=BF16), torch.empty(3, 0, 16, 32, dtype=BF16), b, False)
    assert torch.equal(y, b.expand(3, 48))


@pytest.mark.parametrize("kernel, method", KERNELS[:1])
def test_zero_inputs_give_zero_int8_on_amx(kernel, method):
    y = _ops().amx_int8_linear(torch.empty(3, 0, dtype=torch.uint8), torch.empty(3, 0, 16, 64, dtype=torch.int8),
                               torch.zeros(48), torch.ones(48), torch.ones(3), None, False)
    assert torch.equal(y, torch.zeros(3, 48))
    assert _ops().amx_u8s8_matmul(torch.empty(2, 0, dtype=torch.uint8),
                                  torch.empty(3, 0, 16, 64, dtype=torch.int8)).abs().sum() == 0
