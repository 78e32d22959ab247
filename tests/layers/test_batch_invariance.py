"""Batch-invariant linear layers (pagedllm/layers/batch_invariance.py): the load-time probe
that each output row is independent of the number of rows, and the row-chunk wrapper for
methods whose rows are not."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from pagedllm import platform
from pagedllm.layers import batch_invariance as bi
from pagedllm.layers import describe_compute_path
from pagedllm.layers.linear import (OneDNNPackedLinearMethod, PaddedRowsLinearMethod, ReplicatedLinear,
                                    RowChunkedLinearMethod, UnquantizedLinearMethod, onednn_packing_available)
from pagedllm.layers.vocab_embedding import ParallelLMHead

CPU, F32, BF16 = torch.device("cpu"), torch.float32, torch.bfloat16


def _exact(x, w):
    """x @ w.T in float64, rounded to x's dtype: the same bits whatever the row count."""
    return (x.double() @ w.double().t()).to(x.dtype)


def _bump(y):
    """y rounded a few ulp up (a different rounding, as another kernel would give)."""
    return y * (1 + 4 * torch.finfo(y.dtype).eps)


class MDependentMethod(UnquantizedLinearMethod):
    """A fake whose rows depend on M: above 16 rows every result is rounded a few ulp up (as
    a kernel that switches algorithm with the row count would)."""

    name = "fake M-dependent"

    def apply(self, layer, x, bias=None):
        y = _exact(x, layer.weight)
        if x.shape[0] > 16:
            y = _bump(y)
        return y if bias is None else y + bias


class PositionDependentMethod(UnquantizedLinearMethod):
    """A fake no chunking can fix: rows at odd places within the call are rounded differently."""

    name = "fake position-dependent"

    def apply(self, layer, x, bias=None):
        y = _exact(x, layer.weight)
        y[1::2] = _bump(y[1::2])
        return y


def _layer(fin, fout, method, dtype=F32, bias=False, seed=0):
    layer = ReplicatedLinear(fin, fout, bias, dtype, CPU, method, prefix="model.layers.0.mlp.down_proj")
    g = torch.Generator().manual_seed(seed)
    layer.weight.data.copy_(torch.randn(fout, fin, generator=g) * fin ** -0.5)
    if bias:
        layer.bias.data.copy_(torch.randn(fout, generator=g))
    method.process_weights_after_loading(layer)
    return layer


def test_probe_rows_fit_the_budget():
    assert bi.probe_rows(576, 960) == sorted(bi.PROBE_ROWS)         # SmolLM2's decoder shapes: all
    assert bi.probe_rows(1536, 576) == sorted(bi.PROBE_ROWS)
    assert bi.probe_rows(576, 49152) == [1, 2, 16, 17]               # its LM head: the telling ones
    assert bi.probe_rows(8192, 131072) == [1, 2]                     # never fewer than two
    for fin, fout in ((576, 960), (576, 3072), (1536, 576), (576, 49152)):
        rows = bi.probe_rows(fin, fout)
        assert sum((m + bi.PROBE_CALL_ROWS) * fin * fout for m in rows) <= bi.PROBE_MAX_MACS
    with pytest.raises(ValueError, match="two or more"):
        bi.probe_row_invariance(lambda x: x, 4, F32, CPU, [3, 3])


def test_m_dependent_method_is_detected_and_wrapping_fixes_it():
    layer = _layer(64, 48, MDependentMethod(), bias=True)
    rows = bi.probe_rows(64, 48)
    # the reference batch (257 rows) is above 16 rows: every smaller batch differs from it
    assert bi.probe_row_invariance(layer, 64, F32, CPU, rows) == [m for m in rows if m <= 16]
    model = nn.ModuleList([layer])
    (res,) = bi.ensure_batch_invariant_linears(model)
    assert (res.method, res.names, res.chunk_rows, res.still_failed_at) == ("fake M-dependent", ["down_proj"], 16, [])
    assert isinstance(layer.linear_method, RowChunkedLinearMethod) and layer.linear_method.chunk_rows == 16
    assert bi.probe_row_invariance(layer, 64, F32, CPU, rows) == []
    x = torch.randn(40, 64)
    torch.testing.assert_close(layer(x), _exact(x, layer.weight) + layer.bias, rtol=0, atol=0)
    assert describe_compute_path(model) == "linear fake M-dependent in 16-row chunks (down_proj)"


def test_the_lm_head_is_probed_and_wrapped_too():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.o_proj = _layer(32, 32, MDependentMethod())
            self.lm_head = ParallelLMHead(300, 32, F32, CPU, linear_method=MDependentMethod())
            self.lm_head.weight.data.copy_(torch.randn(300, 32, generator=torch.Generator().manual_seed(1)))

    model = Tiny()
    results = bi.ensure_batch_invariant_linears(model)
    assert [(r.names, r.in_features, r.out_features, r.chunk_rows) for r in results] == [
        (["down_proj"], 32, 32, 16), (["lm_head"], 32, 300, 16)]
    assert bi.probe_row_invariance(model.lm_head, 32, F32, CPU, bi.probe_rows(32, 300)) == []
    assert model.lm_head(torch.randn(5, 32)).dtype == torch.float32
    assert "fake M-dependent in 16-row chunks (down_proj lm_head)" in describe_compute_path(model)


def test_unfixable_method_keeps_its_method_and_warns(caplog):
    layer = _layer(64, 48, PositionDependentMethod(), dtype=BF16)
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        (res,) = bi.ensure_batch_invariant_linears(nn.ModuleList([layer]))
    assert res.failed_at and res.still_failed_at and res.chunk_rows is None
    assert type(layer.linear_method) is PositionDependentMethod             # the wrapper was taken off
    warn = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warn) == 1 and "greedy outputs may depend on batching" in warn[0]
    assert "64->48 fake position-dependent (down_proj" in warn[0] and "bfloat16" in warn[0]
    assert "--dtype float32" in warn[0] and "16/32-row chunks" in warn[0]


def _count_rows(method):
    """The list that records the row count of every later ``method.apply`` call."""
    calls = []
    apply = method.apply
    method.apply = lambda layer, x, bias=None: calls.append(x.shape[0]) or apply(layer, x, bias)
    return calls


@pytest.mark.parametrize("rows", [0, 1, 15, 16, 17, 40])
def test_row_chunks_compute_the_same_values(rows):
    inner = MDependentMethod()
    layer = _layer(24, 20, inner, bias=True)
    wrapped = RowChunkedLinearMethod(inner, 16)
    calls = _count_rows(inner)
    x = torch.randn(rows, 24)
    y = wrapped.apply(layer, x, layer.bias)
    assert y.shape == (rows, 20)
    torch.testing.assert_close(y, _exact(x, layer.weight) + layer.bias, rtol=0, atol=0)   # bias once
    assert set(calls) == {16} and len(calls) == max(1, -(-rows // 16))
    with pytest.raises(ValueError):
        RowChunkedLinearMethod(inner, 0)


class OneRowOrderMethod(UnquantizedLinearMethod):
    """A fake whose one-row calls add the same products in the reverse order, in float32,
    then round to x's dtype: in bf16 random inputs hide it (a bf16 ulp is 2**16 float32
    ones), as oneDNN's 1536 -> 576 bf16 kernel on an AVX512-BF16 AMD EPYC hid its own."""

    name = "fake one-row order"

    def apply(self, layer, x, bias=None):
        xf, w = x.float(), layer.weight.float()
        if x.shape[0] == 1:
            y = _ordered_sum(xf[0].flip(0), w.flip(1)).unsqueeze(0)
        else:
            y = torch.stack([_ordered_sum(r, w) for r in xf])
        y = y.to(x.dtype)
        return y if bias is None else y + bias


def _ordered_sum(r, w):
    """r [K] times each row of w [N, K], the products added left to right in float32
    (``cumsum`` would accumulate in float64)."""
    acc = torch.zeros(w.shape[0])
    for k in range(w.shape[1]):
        acc = acc + r[k] * w[:, k]
    return acc


@pytest.mark.parametrize("fin", [96, 97])
def test_cancellation_inputs_sum_to_zero_exactly(fin):
    w, x = bi.cancellation_inputs(700, fin, 5, BF16, CPU)
    assert w.shape == (700, fin) and x.shape == (5, fin) and w.dtype == x.dtype == BF16
    assert torch.equal(x.double() @ w.double().t(), torch.zeros(5, 700, dtype=torch.float64))
    # but summed in float32 in two orders, the rounding errors differ and show in bf16
    fwd = torch.stack([_ordered_sum(r, w.float()) for r in x.float()]).bfloat16()
    rev = torch.stack([_ordered_sum(r.flip(0), w.float().flip(1)) for r in x.float()]).bfloat16()
    assert (fwd != rev).float().mean() > 0.5


def test_summation_order_hidden_by_bf16_rounding_is_found_and_wrapped():
    layer = _layer(256, 40, OneRowOrderMethod(), dtype=BF16, bias=True)
    weight = layer.weight.detach().clone()
    rows = [1, 2, 16, 17]
    assert bi.cancellation_probe(layer, 256, 40, BF16, CPU, rows) == [1]
    assert torch.equal(layer.weight, weight) and layer.bias is not None      # the stand-in was a copy
    (res,) = bi.ensure_batch_invariant_linears(nn.ModuleList([layer]))
    # rows differed at one row only: one-row calls are padded to two, bigger calls stay whole
    assert res.failed_at == [1] and res.min_rows == 2 and res.chunk_rows is None and not res.still_failed_at
    assert isinstance(layer.linear_method, PaddedRowsLinearMethod) and layer.linear_method.min_rows == 2
    assert bi.cancellation_probe(layer, 256, 40, BF16, CPU, rows) == []
    assert "calls under 2 rows padded" in describe_compute_path(nn.ModuleList([layer]))


@pytest.mark.parametrize("rows", [0, 1, 2, 5])
def test_padded_rows_compute_the_same_values(rows):
    inner = MDependentMethod()
    layer = _layer(24, 20, inner, bias=True)
    padded = PaddedRowsLinearMethod(inner, 3)
    calls = _count_rows(inner)
    x = torch.randn(rows, 24)
    y = padded.apply(layer, x, layer.bias)
    assert y.shape == (rows, 20) and calls == [max(rows, 3)]
    torch.testing.assert_close(y, _exact(x, layer.weight) + layer.bias, rtol=0, atol=0)
    with pytest.raises(ValueError):
        PaddedRowsLinearMethod(inner, 1)


def test_cancellation_probe_needs_a_float_weight_method():
    class Packed(MDependentMethod):
        float_weight = False

    layer = _layer(32, 16, Packed())
    assert bi.cancellation_probe(layer, 32, 16, F32, CPU, [1, 2]) is None
    assert RowChunkedLinearMethod(Packed(), 16).float_weight is False
    assert RowChunkedLinearMethod(OneDNNPackedLinearMethod(), 16).float_weight is True


SMOL_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]


@pytest.mark.skipif(not onednn_packing_available(CPU, F32), reason="no oneDNN (or PAGEDLLM_ONEDNN=0)")
@pytest.mark.parametrize("fin, fout", SMOL_SHAPES + [(576, 49152)])
def test_onednn_float32_rows_end_invariant(fin, fout):
    """oneDNN's packed float32 rows are independent of M at these shapes on the AMD AVX2
    CPU; on the AVX-512 Xeon the 1536 -> 576 down projection's are not at 1 row (measured
    2026-12-01). Either way the layer comes out of the load-time probe invariant."""
    class One(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = _layer(fin, fout, OneDNNPackedLinearMethod())

    model = One()
    results = bi.ensure_batch_invariant_linears(model)
    assert all(not r.still_failed_at for r in results), results
    assert bi.probe_row_invariance(model.proj, fin, F32, CPU, bi.probe_rows(fin, fout)) == []


@pytest.mark.skipif(platform.has_native_bf16(), reason="measured row-invariant on the AVX2 machine only")
@pytest.mark.parametrize("fin, fout", SMOL_SHAPES)
def test_bf16_f_linear_rows_are_invariant_on_avx2(fin, fout):
    layer = _layer(fin, fout, UnquantizedLinearMethod(), dtype=BF16)
    assert bi.probe_row_invariance(layer, fin, BF16, CPU, bi.probe_rows(fin, fout)) == []


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_dense_methods_end_invariant_after_the_probe(dtype):
    """Whatever MKL does at this thread count (float32 F.linear's rows differ at 1-5 rows
    here, and the dense float32 LM head's 1-row F.linear from its multi-row W @ h.T), the
    layers come out of ensure_batch_invariant_linears invariant."""
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv_proj = _layer(576, 960, UnquantizedLinearMethod(), dtype=dtype)
            self.lm_head = ParallelLMHead(4096, 576, dtype, CPU, linear_method=UnquantizedLinearMethod())
            self.lm_head.weight.data.copy_(torch.randn(4096, 576, generator=torch.Generator().manual_seed(2)))

    model = Tiny()
    budget = 300_000_000     # fewer rows than at load: bf16 matmuls are very slow on AVX2 CPUs
    results = bi.ensure_batch_invariant_linears(model, max_macs=budget)
    assert all(not r.still_failed_at for r in results), results
    for layer, (fin, fout) in ((model.qkv_proj, (576, 960)), (model.lm_head, (576, 4096))):
        assert bi.probe_row_invariance(layer, fin, dtype, CPU, bi.probe_rows(fin, fout, max_macs=budget)) == []


def test_build_model_probes_unless_disabled(monkeypatch):
    from pagedllm.models import loader

    class FakeModel(nn.Module):
        def __init__(self, *a):
            super().__init__()
            self.proj = ReplicatedLinear(8, 8, False, F32, CPU)

        def load_weights(self, weights):
            self.proj.weight.data.fill_(0.5)

    probed = []
    monkeypatch.setattr(loader, "get_model_class", lambda cfg: FakeModel)
    monkeypatch.setattr(loader, "iter_weights", lambda path, cfg: [])
    monkeypatch.setattr(bi, "ensure_batch_invariant_linears", lambda model: probed.append(model))
    # distinct paths: the suite's conftest may wrap build_model to share built models
    model = loader.build_model("unused-1", None, F32, CPU, 16)
    assert len(probed) == 1 and isinstance(probed[0], FakeModel) and isinstance(model, FakeModel)
    monkeypatch.setenv("PAGEDLLM_BATCH_INVARIANT_PROBE", "0")
    loader.build_model("unused-2", None, F32, CPU, 16)
    assert len(probed) == 1
