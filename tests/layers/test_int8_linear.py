"""int8 W8A8 linear method (pagedllm/layers/quantization/int8.py) and its C++ kernels
(csrc/quant_act.cpp): the kernels against their torch twins bit for bit, the method against
an integer reference and against float ``F.linear`` within the quantization error, batch
invariance, fused layers, and the torch backend."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels.cpu import load_cpu_kernels
from pagedllm.layers.batch_invariance import probe_row_invariance
from pagedllm.layers import describe_compute_path
from pagedllm.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear,
                                    RowChunkedLinearMethod, pack_amx_tiles)
from pagedllm.layers.quantization import int8
from pagedllm.layers.quantization.int8 import (ACT_RANGES, INT8_KERNEL_LABELS, Int8W8A8LinearMethod, amx_int8_available,
                                               avx2_int8_available, avx2_int8_vnni, pack_int8_avx2,
                                               epilogue_ref, int8_matmul_ref, onednn_exact, onednn_exact_bits,
                                               onednn_int8_available, quantize_per_token,
                                               quantize_per_token_ref, quantize_weight_per_channel,
                                               weight_compensation)
from pagedllm.platform import cpu_features

ROWS = (1, 3, 17, 64, 300)
needs_onednn = pytest.mark.skipif(not onednn_int8_available("cpu"), reason="oneDNN int8 matmul unavailable")
needs_avx2 = pytest.mark.skipif(not avx2_int8_available("cpu"),
                                reason="no AVX2 on this CPU (or PAGEDLLM_AVX2_INT8=0, or no C++ kernels)")
needs_amx = pytest.mark.skipif(not amx_int8_available("cpu"),
                               reason="no AMX-INT8 on this CPU (or PAGEDLLM_AMX=0, or no C++ kernels)")


@pytest.fixture(scope="module")
def ops():
    m = load_cpu_kernels()
    assert m is not None, "the C++ CPU kernels did not build"
    return m


def _acts(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Activations with rows of very different magnitudes (1e-3 to 1e3), an outlier channel
    and a zero row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m)[:, None]
    x[:, k // 3] *= 20
    if m > 2:
        x[1] = 0
    return x.to(dtype)


# ---------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 7])
@pytest.mark.parametrize("m,k", [(1, 576), (3, 77), (17, 1536), (64, 8), (300, 203)])
def test_quantizer_cpp_matches_torch_bitwise(ops, dtype, bits, m, k):
    qmax, zp = ACT_RANGES[bits]
    x = _acts(m, k, dtype, seed=m * k)
    want_q, want_s = quantize_per_token_ref(x, qmax, zp)
    got_q, got_s = quantize_per_token(x, qmax, zp)
    assert torch.equal(got_s, want_s)
    assert torch.equal(got_q, want_q)
    # and the values are the definition's: |q| <= qmax, the row maximum hits +-qmax,
    # |x - q * s| <= s / 2 (plus float32 rounding of x * inv)
    q = got_q.int() - zp
    assert q.abs().max() <= qmax
    xf = x.float()
    nz = want_s > 0
    assert torch.equal(q.abs().amax(dim=1)[nz], torch.full((int(nz.sum()),), qmax, dtype=torch.int32))
    err = (xf - q * got_s[:, None]).abs()
    assert (err <= got_s[:, None] * (0.5 + 1e-5)).all()
    if m > 2:
        assert got_s[1] == 0 and (q[1] == 0).all()


def test_quantizer_strided_rows_and_ties(ops):
    # a column slice (rows not adjacent) and exact ties: 63 / amax = 1, values k + 0.5
    base = torch.zeros(5, 40)
    base[:, :9] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 62.5, -63.0, 3.5])
    x = base[:, :20]
    q, s = quantize_per_token(x, 63, 64)
    assert torch.equal(s, torch.ones(5))
    assert q[0, :9].int().sub(64).tolist() == [0, 2, 2, 0, -2, -2, 62, -63, 4]    # half to even
    want_q, want_s = quantize_per_token_ref(x, 63, 64)
    assert torch.equal(q, want_q) and torch.equal(s, want_s)


def test_quantizer_non_finite_rows_get_non_finite_scales(ops):
    x = torch.ones(3, 16)
    x[0, 3], x[1, 5] = float("inf"), float("nan")
    for q, s in (quantize_per_token(x, 127, 128), quantize_per_token_ref(x, 127, 128)):
        assert not math.isfinite(s[0]) and not math.isfinite(s[1])
        assert s[2] == 1 / 127 and (q[2] == 255).all()


@pytest.mark.parametrize("qmax,zp", [(0, 64), (128, 128), (63, 10), (127, 200)])
def test_quantizer_rejects_bad_ranges(qmax, zp):
    with pytest.raises(ValueError, match="qmax|zero_point"):
        quantize_per_token(torch.ones(2, 8), qmax, zp)
    with pytest.raises(ValueError, match="qmax|zero_point"):
        quantize_per_token_ref(torch.ones(2, 8), qmax, zp)


def test_integer_sums_round_once_past_2_to_the_24():
    g = torch.Generator().manual_seed(7)
    k, n, m = 2048, 37, 9
    w = torch.randint(-63, 64, (n, k), dtype=torch.int8, generator=g)
    w[:5] = torch.randint(40, 64, (5, k), dtype=torch.int8, generator=g)
    xq = torch.randint(0, 256, (m, k), dtype=torch.uint8, generator=g)
    xq[:3] = torch.randint(200, 256, (3, k), dtype=torch.uint8, generator=g)
    exact = xq.long() @ w.long().t()
    assert exact.abs().max() > 2**24
    want = exact.double().float()          # one rounding, to nearest even
    assert torch.equal(int8_matmul_ref(xq, w), want)
    if onednn_int8_available("cpu"):
        packed = torch.ops.onednn.qlinear_prepack(w, None)
        assert torch.equal(int8._qlinear(xq, packed, torch.ones(n), torch.zeros(n, dtype=torch.int64)), want)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_epilogue_cpp_matches_torch_bitwise(ops, out_dtype, with_bias):
    g = torch.Generator().manual_seed(5)
    m, n = 37, 203
    acc = torch.randint(-2**24, 2**24, (m, n), generator=g).float()
    ws, rs = torch.rand(n, generator=g) * 1e-3, torch.rand(m, generator=g) * 0.1
    rs[3] = 0
    bias = torch.randn(n, generator=g) if with_bias else None
    comp = torch.randint(-2**20, 2**20, (n,), generator=g).float()
    want = epilogue_ref(acc, comp, ws, rs, bias, out_dtype)
    got = torch.empty(m, n, dtype=out_dtype)
    ops.int8_epilogue(got, acc, comp, ws, rs, bias)
    assert torch.equal(got, want)


@pytest.mark.parametrize("qmax", [127, 63])
def test_weight_quantization(qmax):
    g = torch.Generator().manual_seed(6)
    w = torch.randn(9, 50, generator=g)
    w[4] = 0
    q, s = quantize_weight_per_channel(w.to(torch.bfloat16), qmax)
    wf = w.to(torch.bfloat16).float()
    assert q.dtype == torch.int8 and q.abs().max() == qmax
    torch.testing.assert_close(s, wf.abs().amax(dim=1) / qmax, rtol=0, atol=0)
    assert s[4] == 0 and (q[4] == 0).all()
    assert ((wf - q.float() * s[:, None]).abs() <= s[:, None] * 0.5 * (1 + 1e-6)).all()
    with pytest.raises(ValueError, match="weight"):
        quantize_weight_per_channel(torch.ones(4))
    with pytest.raises(ValueError, match="qmax"):
        quantize_weight_per_channel(w, 128)


# ----------------------------------------------------------------------------- method


def _layer(k: int, n: int, bias: bool, dtype=torch.float32, seed=0, **method_kw) -> ReplicatedLinear:
    g = torch.Generator().manual_seed(seed)
    layer = ReplicatedLinear(k, n, bias, dtype, torch.device("cpu"), Int8W8A8LinearMethod("cpu", **method_kw))
    layer.weight.data.copy_(torch.randn(n, k, generator=g) * 0.05)
    if bias:
        layer.bias.data.copy_(torch.randn(n, generator=g))
    return layer


def _reference(layer_w: torch.Tensor, bias, x: torch.Tensor, method: Int8W8A8LinearMethod):
    """The method's maths with exact integers (int64) and float64 scaling: (float64 result,
    bound on its distance to a float32 computation of the same maths)."""
    qmax, zp = method.qmax, method.zero_point
    q, ws = quantize_weight_per_channel(layer_w, method.weight_qmax)
    xq, rs = quantize_per_token_ref(x, qmax, zp)
    acc = (xq.long() - zp) @ q.long().t()
    scale = ws.double() * rs.double()[:, None]
    y = acc.double() * scale
    # float32 rounds the uint8 sums and the zero point's column sums past 2**24, then
    # each of the four operations once
    acc_u = xq.long() @ q.long().t()
    comp = zp * q.long().sum(dim=1)
    mag = (acc.abs() + acc_u.abs() + comp.abs()).double() * scale
    if bias is not None:
        y = y + bias.double()
        mag = mag + bias.double().abs()
    return y, mag * 4 * 2.0 ** -24


@needs_onednn
@pytest.mark.parametrize("widths", [None, (8, 7), (8, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", ROWS)
def test_method_matches_integer_reference(dtype, m, widths):
    if widths is not None and not onednn_exact(*widths):
        pytest.skip(f"oneDNN's int8 sums are not exact at {widths} bits on this CPU")
    k, n = 320, 203
    bits = {} if widths is None else dict(weight_bits=widths[0], act_bits=widths[1])
    layer = _layer(k, n, bias=True, seed=m, **bits)
    w = layer.weight.data.clone()
    layer.linear_method.process_weights_after_loading(layer)
    method = layer.linear_method
    x = _acts(m, k, dtype, seed=m)
    y = layer(x)
    assert y.dtype == dtype and y.shape == (m, n)
    want, tol = _reference(w, layer.bias.data, x, method)
    if dtype == torch.bfloat16:
        tol = tol + want.abs() * 2.0 ** -8
    assert ((y.double() - want).abs() <= tol).all()
    # and bit for bit the torch twins' composition (oneDNN's float32 of the integer sums)
    xq, rs = quantize_per_token_ref(x, method.qmax, method.zero_point)
    q, ws = quantize_weight_per_channel(w, method.weight_qmax)
    acc = int8_matmul_ref(xq, q)
    comp = weight_compensation(q, method.zero_point)
    assert torch.equal(y, epilogue_ref(acc, comp, ws, rs, layer.bias.data, dtype))


@needs_onednn
def test_method_without_bias_and_odd_shapes():
    for k, n, m in ((7, 1, 5), (64, 3, 1), (1000, 333, 17)):
        layer = _layer(k, n, bias=False, seed=k)
        w = layer.weight.data.clone()
        layer.linear_method.process_weights_after_loading(layer)
        x = _acts(m, k, torch.float32, seed=n)
        want, tol = _reference(w, None, x, layer.linear_method)
        assert ((layer(x).double() - want).abs() <= tol).all()
    assert layer(torch.empty(0, 1000)).shape == (0, 333)


@pytest.mark.parametrize("backend", ["onednn", "torch"])
def test_error_against_float_linear_is_the_quantization_error(backend):
    if backend == "onednn" and not onednn_int8_available("cpu"):
        pytest.skip("oneDNN int8 matmul unavailable")
    k, n, m = 576, 257, 64
    g = torch.Generator().manual_seed(9)
    layer = _layer(k, n, bias=True, seed=3, backend=backend)
    w, b = layer.weight.data.clone(), layer.bias.data.clone()
    layer.linear_method.process_weights_after_loading(layer)
    method = layer.linear_method
    x = torch.randn(m, k, generator=g)
    y = layer(x).double()
    ref = F.linear(x.double(), w.double(), b.double())
    # worst case per element: each factor off by at most half its step
    _, sw = quantize_weight_per_channel(w, method.weight_qmax)
    _, sx = quantize_per_token_ref(x, method.qmax, method.zero_point)
    sw, sx = sw.double(), sx.double()
    bound = (x.double().abs().sum(1, keepdim=True) * sw / 2 + sx[:, None] * w.double().abs().sum(1) / 2
             + k * sx[:, None] * sw / 4) * (1 + 1e-4)
    assert ((y - ref).abs() <= bound).all()
    # typical: rounding errors are uniform (variance step^2 / 12) and independent, so the
    # relative error is about sqrt(rel_x^2 + rel_w^2): Gaussian x (576 per row) has amax
    # ~3.3 sigma, so rel_x ~ 3.3 / qmax / sqrt(12): 0.75 % at 8 bits, 1.5 % at 7; weights
    # (576 per row) likewise
    rel = ((y - ref).norm() / (ref - b.double()).norm()).item()
    expected = math.hypot(3.3 / method.qmax, 3.3 / method.weight_qmax) / math.sqrt(12)
    assert 0.5 * expected < rel < 1.5 * expected, (rel, expected)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_batch_invariant(dtype):
    layer = _layer(576, 203, bias=True, dtype=dtype, seed=11)
    layer.linear_method.process_weights_after_loading(layer)
    assert probe_row_invariance(layer, 576, dtype, "cpu", [1, 2, 3, 5, 16, 17, 33, 64, 65, 300]) == []


@needs_onednn
def test_rows_are_batch_invariant_on_two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        layer = _layer(1536, 576, bias=False, seed=12)
        layer.linear_method.process_weights_after_loading(layer)
        assert probe_row_invariance(layer, 1536, torch.float32, "cpu", [1, 3, 16, 17, 64, 129]) == []
    finally:
        torch.set_num_threads(before)


def test_torch_backend_and_kernel_free_paths_give_the_same_bits(monkeypatch):
    """oneDNN vs torch backend at the same activation width, and the C++ kernels vs their
    torch twins inside the method: all one set of bits."""
    k, n, m = 300, 97, 29
    x = _acts(m, k, torch.float32, seed=4)
    wbits, abits = onednn_exact_bits() if onednn_int8_available("cpu") else (8, 8)
    layers = {}
    for backend in ("onednn", "torch"):
        if backend == "onednn" and not onednn_int8_available("cpu"):
            continue
        layers[backend] = _layer(k, n, bias=True, seed=8, backend=backend, weight_bits=wbits,
                                 act_bits=abits)
        layers[backend].linear_method.process_weights_after_loading(layers[backend])
    outs = [layer(x) for layer in layers.values()]
    monkeypatch.setattr(int8, "kernels_for", lambda device, dtype: None)
    outs += [layer(x) for layer in layers.values()]
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


def test_torch_backend_matches_integer_reference():
    k, n, m = 2100, 45, 6      # K over five reference chunks, uint8 sums past 2**24
    layer = _layer(k, n, bias=False, seed=2, backend="torch")
    w = layer.weight.data.clone()
    layer.linear_method.process_weights_after_loading(layer)
    assert layer.linear_method.name == "int8 W8A8 (torch reference)"
    assert hasattr(layer, "int8_weight") and layer.weight.numel() == 0
    x = _acts(m, k, torch.float32, seed=1)
    want, tol = _reference(w, None, x, layer.linear_method)
    assert ((layer(x).double() - want).abs() <= tol).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_uses_the_torch_backend():
    layer = ReplicatedLinear(256, 96, True, torch.float32, torch.device("cuda"), Int8W8A8LinearMethod("cuda"))
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 256, generator=g), torch.randn(96, generator=g)
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(b)
    layer.linear_method.process_weights_after_loading(layer)
    assert layer.linear_method.backend == "torch"
    x = _acts(33, 256, torch.float32, seed=3)
    want, tol = _reference(w, b, x, layer.linear_method)
    assert ((layer(x.cuda()).cpu().double() - want).abs() <= tol).all()


def test_constructor_errors():
    with pytest.raises(ValueError, match="act_bits"):
        Int8W8A8LinearMethod("cpu", act_bits=4)
    with pytest.raises(ValueError, match="weight_bits"):
        Int8W8A8LinearMethod("cpu", weight_bits=16)
    with pytest.raises(ValueError, match="backend"):
        Int8W8A8LinearMethod("cpu", backend="mkl")
    with pytest.raises(ValueError, match="backend"):
        Int8W8A8LinearMethod("meta", backend="onednn")


@needs_onednn
def test_exactness_probe_agrees_with_the_isa():
    f = cpu_features()
    int32_dot = f.avx512_vnni or f.avx_vnni or f.amx_int8
    assert onednn_exact_bits() == ((8, 8) if int32_dot else (7, 8))
    assert Int8W8A8LinearMethod("cpu", backend="onednn").name == (
        "int8 W8A8 (oneDNN u8s8)" if int32_dot else "int8 W8A8 (oneDNN u8s8, 7-bit weights)")
    assert onednn_exact(8, 7) and onednn_exact(7, 8)
    assert onednn_exact(8, 8) == int32_dot    # int16 pair sums saturate without VNNI/AMX
    if not int32_dot:
        with pytest.raises(ValueError, match="not exact"):
            Int8W8A8LinearMethod("cpu", weight_bits=8, act_bits=8, backend="onednn")
        assert (Int8W8A8LinearMethod("cpu", act_bits=7, backend="onednn").name
                == "int8 W8A8 (oneDNN u8s8, 7-bit activations)")


@needs_onednn
def test_inference_mode_either_side_of_loading():
    x = _acts(5, 64, torch.float32, seed=0)
    layer_a = _layer(64, 24, bias=True, seed=1)
    layer_a.linear_method.process_weights_after_loading(layer_a)
    with torch.inference_mode():
        layer_b = _layer(64, 24, bias=True, seed=1)
        layer_b.linear_method.process_weights_after_loading(layer_b)
        y_ab, y_bb = layer_a(x), layer_b(x)
    with torch.no_grad():
        y_ba = layer_b(x)
    assert torch.equal(layer_a(x), y_ab) and torch.equal(y_ab, y_bb) and torch.equal(y_bb, y_ba)


@pytest.mark.parametrize("backend", ["onednn", "torch"])
def test_fused_layers_equal_separate_layers(backend):
    if backend == "onednn" and not onednn_int8_available("cpu"):
        pytest.skip("oneDNN int8 matmul unavailable")
    g = torch.Generator().manual_seed(13)
    hidden, hd, nh, nkv, inter = 96, 16, 6, 2, 160
    cpu = torch.device("cpu")

    def method():
        return Int8W8A8LinearMethod("cpu", backend=backend)

    qkv = QKVParallelLinear(hidden, hd, nh, nkv, True, torch.float32, cpu, method())
    gate_up = MergedColumnParallelLinear(hidden, [inter, inter], False, torch.float32, cpu, method())
    parts = {"q": nh * hd, "k": nkv * hd, "v": nkv * hd}
    separate = {}
    for name, rows in parts.items():
        w, b = torch.randn(rows, hidden, generator=g), torch.randn(rows, generator=g)
        qkv.weight_loader(qkv.weight, w, name)
        qkv.weight_loader(qkv.bias, b, name)
        separate[name] = ReplicatedLinear(hidden, rows, True, torch.float32, cpu, method())
        separate[name].weight.data.copy_(w)
        separate[name].bias.data.copy_(b)
    for i in range(2):
        w = torch.randn(inter, hidden, generator=g) * (i + 1)
        gate_up.weight_loader(gate_up.weight, w, i)
        separate[i] = ReplicatedLinear(hidden, inter, False, torch.float32, cpu, method())
        separate[i].weight.data.copy_(w)
    for layer in [qkv, gate_up, *separate.values()]:
        layer.linear_method.process_weights_after_loading(layer)
    x = torch.randn(19, hidden, generator=g)
    assert torch.equal(qkv(x), torch.cat([separate[p](x) for p in "qkv"], dim=1))
    assert torch.equal(gate_up(x), torch.cat([separate[0](x), separate[1](x)], dim=1))


@needs_onednn
def test_tied_lm_head_keeps_the_embedding_table():
    from pagedllm.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

    cpu = torch.device("cpu")
    emb = VocabParallelEmbedding(500, 64, torch.float32, cpu)
    emb.weight.data.copy_(torch.randn(500, 64, generator=torch.Generator().manual_seed(0)))
    head = ParallelLMHead(500, 64, torch.float32, cpu, tied_embedding=emb,
                          linear_method=Int8W8A8LinearMethod("cpu"))
    head.linear_method.process_weights_after_loading(head)
    assert head.weight.shape == (500, 64)      # still the embedding table
    x = _acts(4, 64, torch.float32, seed=2)
    want, tol = _reference(emb.weight.data, None, x, head.linear_method)
    assert ((head(x).double() - want).abs() <= tol).all()


# ------------------------------------------------------------------------ AMX-INT8


def test_amx_int8_pack_layout():
    q = (torch.arange(32 * 128) % 255 - 127).to(torch.int8).reshape(32, 128)
    p = pack_amx_tiles(q, torch.int8)
    assert p.shape == (2, 2, 16, 64) and p.dtype == torch.int8
    for nb, kb, r, n, j in [(0, 0, 0, 0, 0), (0, 0, 0, 0, 3), (1, 0, 5, 7, 2), (1, 1, 15, 15, 3)]:
        assert p[nb, kb, r, 4 * n + j] == q[16 * nb + n, 64 * kb + 4 * r + j]
    with pytest.raises(ValueError, match="K % 64"):
        pack_amx_tiles(torch.zeros(32, 96, dtype=torch.int8), torch.int8)


@needs_amx
@pytest.mark.parametrize("m", ROWS)
def test_amx_u8s8_sums_are_the_exact_integer_sums(ops, m):
    """Random values and the extremes (255 x -128 and 255 x 127 all along a row: sums far
    past 2**24, where float32 rounds once), 48 columns (an odd number of 16-column blocks)."""
    g = torch.Generator().manual_seed(m)
    for k, n in ((64, 48), (576, 960), (1536, 576)):
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        q[0], q[1] = -128, 127
        x = torch.randint(0, 256, (m, k), generator=g, dtype=torch.uint8)
        x[0] = 255
        got = ops.amx_u8s8_matmul(x, pack_amx_tiles(q, torch.int8))
        assert torch.equal(got, (x.long() @ q.long().t()).double().float())
        assert torch.equal(got, int8_matmul_ref(x, q))


@needs_amx
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", ROWS)
def test_amx_backend_gives_the_torch_backends_bits(dtype, m):
    """The AMX backend's layer output equals the torch backend's (the integer reference's
    sums through the same epilogue) bit for bit, and its rows are batch-invariant."""
    k, n = 576, 208
    amx = _layer(k, n, bias=True, dtype=dtype, seed=m, backend="amx")
    ref = _layer(k, n, bias=True, dtype=dtype, seed=m, backend="torch")
    for layer in (amx, ref):
        layer.linear_method.process_weights_after_loading(layer)
    assert amx.int8_backend == "amx" and amx.linear_method.name == "int8 W8A8 (AMX u8s8)"
    x = _acts(m, k, dtype, seed=m)
    assert torch.equal(amx(x), ref(x))
    assert probe_row_invariance(amx, k, dtype, "cpu", [1, 2, 3, 16, 17, 33, 64, 300]) == []


@needs_amx
def test_amx_backend_falls_back_for_shapes_its_tiles_cannot_hold():
    method = Int8W8A8LinearMethod("cpu")
    assert method.backend == "amx"
    layer = _layer(320, 203, bias=True, seed=1)
    layer.linear_method.process_weights_after_loading(layer)
    assert layer.int8_backend == layer.linear_method.fallback_backend != "amx"
    assert layer(_acts(5, 320, torch.float32, seed=2)).shape == (5, 203)


@needs_amx
@needs_avx2
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_amx_falls_back_to_the_avx2_kernel_without_onednn(monkeypatch, dtype):
    """Without oneDNN (``PAGEDLLM_ONEDNN=0``, a torch without mkldnn), a layer AMX's tiles
    cannot hold runs on the AVX2 kernel at the method's 8-bit widths (same bits as the
    torch reference), not on the far slower torch ops; one whose K is not a multiple of 4
    takes the torch ops."""
    from pagedllm.layers.quantization import int8

    monkeypatch.setattr(int8, "onednn_int8_available", lambda device: False)
    method = Int8W8A8LinearMethod("cpu")
    assert method.backend == "amx" and method.fallback_backend == "avx2" and method.weight_bits == 8
    layer = _layer(320, 203, bias=True, dtype=dtype, seed=4)    # N % 16 != 0
    odd = _layer(30, 20, bias=True, dtype=dtype, seed=5)        # K % 4 != 0 as well
    refs = [_layer(320, 203, bias=True, dtype=dtype, seed=4, backend="torch"),
            _layer(30, 20, bias=True, dtype=dtype, seed=5, backend="torch")]
    for lay in (layer, odd, *refs):
        lay.linear_method.process_weights_after_loading(lay)
    assert layer.int8_backend == "avx2" and odd.int8_backend == "torch"
    assert layer.linear_method.layer_name(layer) == "int8 W8A8 (AVX2 u8s8)"
    for lay, ref, k in ((layer, refs[0], 320), (odd, refs[1], 30)):
        x = _acts(7, k, dtype, seed=k)
        assert torch.equal(lay(x), ref(x))


@pytest.mark.parametrize("backend, available, in_odd", [("amx", amx_int8_available, 320),
                                                         ("avx2", avx2_int8_available, 30)])
def test_start_up_line_names_the_kernel_each_layer_runs(backend, available, in_odd):
    """One method shared by two layers, one of which its kernel's layout cannot hold (AMX:
    out % 16; AVX2: in % 4): the start-up line names the fallback's kernel for that layer
    only, also inside a batch-invariance wrapper and in the decoder stack's reason."""
    if not available("cpu"):
        pytest.skip(f"no {backend} int8 kernel on this CPU")
    method = Int8W8A8LinearMethod("cpu", backend=backend)
    fits = ReplicatedLinear(64, 32, False, torch.float32, torch.device("cpu"), method, prefix="model.fits")
    odd = ReplicatedLinear(in_odd, 203, False, torch.float32, torch.device("cpu"), method, prefix="model.odd")
    for layer in (fits, odd):
        layer.weight.data.normal_(0, 0.05)
        method.process_weights_after_loading(layer)
    assert fits.int8_backend == backend and odd.int8_backend == method.fallback_backend != backend
    own, other = INT8_KERNEL_LABELS[backend], INT8_KERNEL_LABELS[method.fallback_backend]
    assert method.layer_name(fits) == method.name and own in method.name
    assert method.layer_name(odd) == method.name.replace(own, other)
    assert describe_compute_path(nn.ModuleList([fits, odd])) == (
        f"linear {method.name} (fits) / {method.name.replace(own, other)} (odd)")
    wrapped = RowChunkedLinearMethod(method, 16)
    assert wrapped.layer_name(odd) == f"{method.name.replace(own, other)} in 16-row chunks"
    assert wrapped.layer_name(fits) == wrapped.name == f"{method.name} in 16-row chunks"
    # the fallback has no C++ stack form; the layer that fits has one
    kernels = load_cpu_kernels()
    assert method.stack_linear(odd, kernels) is None
    assert method.stack_linear(fits, kernels) is not None


@pytest.mark.parametrize("env, backend, available", [("PAGEDLLM_AMX", "amx", amx_int8_available),
                                                     ("PAGEDLLM_AVX2_INT8", "avx2", avx2_int8_available)])
def test_kernel_backend_refused_where_it_cannot_run(monkeypatch, env, backend, available):
    monkeypatch.setenv(env, "0")
    assert not available("cpu")
    with pytest.raises(ValueError, match=f"backend='{backend}'"):
        Int8W8A8LinearMethod("cpu", backend=backend)
    assert Int8W8A8LinearMethod("cpu").backend != backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantizer_with_smoothing_is_the_product_then_quantized(ops, dtype):
    """quantize_per_token(x, smooth=s) gives the bits of quantizing torch's x * s (rounded
    to x's dtype), without the product tensor; strided rows too, rows whose length is
    not a multiple of the 16 or 8 lanes (the 8-lane and scalar tails), and a row whose
    products are partly subnormal (kept, not flushed: its scale lets them quantize to
    non-zero values)."""
    g = torch.Generator().manual_seed(21)
    for k in (200, 203, 1536):
        x = _acts(37, k, dtype, seed=5)
        x[3] = (torch.randn(k, generator=g) * 2e-37).to(dtype)
        s = (torch.rand(k, generator=g) * 4 + 0.05).to(dtype)
        for xx in (x, torch.cat([x, x], dim=1)[:, :k]):
            q, sc = quantize_per_token(xx, 127, 128, s)
            want_q, want_sc = quantize_per_token_ref(xx * s, 127, 128)
            assert torch.equal(q, want_q) and torch.equal(sc, want_sc)
        prod = (x[3] * s).float().abs()
        sub = (prod > 0) & (prod < torch.finfo(torch.float32).tiny)
        assert sub.sum() >= 3 and (q[3][sub] != 128).sum() >= 2     # the case above is exercised


# ------------------------------------------------------------------------ AVX2


def test_avx2_int8_pack_layout():
    q = (torch.arange(20 * 12) % 255 - 127).to(torch.int8).reshape(20, 12)
    p = pack_int8_avx2(q)
    assert p.shape == (2, 3, 16, 4) and p.dtype == torch.int8
    for t, g4, j, i in [(0, 0, 0, 0), (0, 0, 0, 3), (0, 2, 7, 1), (1, 1, 3, 2)]:
        assert p[t, g4, j, i] == q[16 * t + j, 4 * g4 + i]
    assert (p[1, :, 4:] == 0).all()      # columns past N are zero
    with pytest.raises(ValueError, match="K % 4"):
        pack_int8_avx2(torch.zeros(16, 6, dtype=torch.int8))


def _avx2_linear(ops, x, q, zp, bias=None, bf16=False, seven=False):
    n = q.shape[0]
    ws = torch.rand(n, generator=torch.Generator().manual_seed(n)) + 0.5
    rs = torch.rand(x.shape[0], generator=torch.Generator().manual_seed(x.shape[0])) + 0.5
    comp = weight_compensation(q, zp)
    got = ops.avx2_int8_linear(x, pack_int8_avx2(q), q.to(torch.int32).sum(1, dtype=torch.int32), zp, comp, ws,
                               rs, bias, bf16, seven)
    want = epilogue_ref(int8_matmul_ref(x, q), comp, ws, rs, bias, torch.bfloat16 if bf16 else torch.float32)
    return got, want


@needs_avx2
@pytest.mark.parametrize("m", ROWS)
def test_avx2_int8_linear_is_the_epilogue_of_the_exact_sums(ops, m):
    """Bit for bit the torch reference (integer sums, then the epilogue), on both paths:
    8-bit weights (where vpmaddubsw's pair sums would saturate without the sign trick) and
    7-bit ones (multiplied directly): random values, the extremes all along a row (sums
    past 2**24, rounded once), columns not a multiple of 16, 7-bit activations (zero point
    64), with and without bias, float32 and bfloat16."""
    g = torch.Generator().manual_seed(m)
    for k, n in ((4, 1), (64, 48), (576, 203), (1536, 576)):
        for wmax, seven in ((127, False), (63, True)):
            q = torch.randint(-wmax, wmax + 1, (n, k), generator=g, dtype=torch.int8)
            q[0] = wmax
            if n > 1:
                q[1] = -wmax
            x = torch.randint(1, 256, (m, k), generator=g, dtype=torch.uint8)
            x[0] = 255
            if m > 1:
                x[1] = 1
            bias = torch.randn(n, generator=g)
            for b, bf in ((None, False), (bias, False), (bias, True)):
                got, want = _avx2_linear(ops, x, q, 128, b, bf, seven)
                assert got.dtype == want.dtype and torch.equal(got, want), (k, n, wmax, b is None, bf)
            x7 = torch.randint(1, 128, (m, k), generator=g, dtype=torch.uint8)
            got, want = _avx2_linear(ops, x7, q, 64, seven=seven)
            assert torch.equal(got, want)


@needs_avx2
def test_avx2_int8_linear_every_micro_kernel_remainder(ops):
    """Every row count 1 .. 17 (the VNNI micro-kernel takes 8 rows, the AVX2 one 4, then the
    rest in one call) against 1 .. 5 column tiles (taken 2 at a time with VNNI, so an odd
    count leaves one): bit for bit the exact sums' epilogue."""
    g = torch.Generator().manual_seed(7)
    for n in (16, 32, 48, 64, 70, 80):
        q = torch.randint(-127, 128, (n, 64), generator=g, dtype=torch.int8)
        for m in range(1, 18):
            x = torch.randint(1, 256, (m, 64), generator=g, dtype=torch.uint8)
            got, want = _avx2_linear(ops, x, q, 128)
            assert torch.equal(got, want), (m, n)


@needs_avx2
def test_avx2_int8_linear_errors(ops):
    q = torch.zeros(16, 8, dtype=torch.int8)
    x, f = torch.zeros(2, 8, dtype=torch.uint8), torch.ones(16)
    cs = torch.zeros(16, dtype=torch.int32)
    with pytest.raises(ValueError, match="columns"):
        ops.avx2_int8_linear(torch.zeros(2, 12, dtype=torch.uint8), pack_int8_avx2(q), cs, 128, f, f, torch.ones(2))
    with pytest.raises(ValueError, match="row_scales"):
        ops.avx2_int8_linear(x, pack_int8_avx2(q), cs, 128, f, f, torch.ones(3))
    with pytest.raises(ValueError, match="colsum"):
        ops.avx2_int8_linear(x, pack_int8_avx2(q), torch.zeros(17, dtype=torch.int32), 128, torch.ones(17),
                             torch.ones(17), torch.ones(2))     # 17 columns need two tiles
    with pytest.raises(ValueError, match="zero_point"):
        ops.avx2_int8_linear(x, pack_int8_avx2(q), cs, 300, f, f, torch.ones(2))
    with pytest.raises(ValueError, match="compensation"):
        ops.avx2_int8_linear(x, pack_int8_avx2(q), cs, 128, f.reshape(4, 4), f, torch.ones(2))
    with pytest.raises(ValueError, match="row_scales"):
        ops.avx2_int8_linear(x, pack_int8_avx2(q), cs, 128, f, f, torch.ones(2, device="meta"))
    # 8-bit weights: x = 0 with zero point 128 is q = -128, which the sign trick cannot negate
    with pytest.raises(ValueError, match="x - zero_point"):
        ops.avx2_int8_linear(x, pack_int8_avx2(q), cs, 128, f, f, torch.ones(2), None, False, False)
    assert ops.avx2_int8_linear(x + 1, pack_int8_avx2(q), cs, 128, f, f, torch.ones(2)).shape == (2, 16)


@needs_avx2
@pytest.mark.parametrize("weight_bits", [None, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", ROWS)
def test_avx2_backend_gives_the_torch_backends_bits(dtype, m, weight_bits):
    """The AVX2 backend's layer output equals the torch backend's at the same widths bit
    for bit (7-bit weights by default, 8 on request), and its rows are batch-invariant (on
    two threads too)."""
    k, n = 576, 203
    avx2 = _layer(k, n, bias=True, dtype=dtype, seed=m, backend="avx2", weight_bits=weight_bits)
    bits = avx2.linear_method.weight_bits
    vnni = avx2_int8_vnni("cpu")          # VPDPBUSD: 8-bit weights by default
    assert bits == (weight_bits or (8 if vnni else 7)) and avx2.linear_method.act_bits == 8
    ref = _layer(k, n, bias=True, dtype=dtype, seed=m, backend="torch", weight_bits=bits)
    for layer in (avx2, ref):
        layer.linear_method.process_weights_after_loading(layer)
    assert avx2.int8_backend == "avx2"
    label = "AVX2 u8s8 with AVX512-VNNI" if vnni else "AVX2 u8s8"
    assert avx2.linear_method.name == (f"int8 W8A8 ({label})" if bits == 8 else
                                       f"int8 W8A8 ({label}, 7-bit weights)")
    x = _acts(m, k, dtype, seed=m)
    assert torch.equal(avx2(x), ref(x))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert probe_row_invariance(avx2, k, dtype, "cpu", [1, 2, 3, 4, 5, 16, 17, 64, 300]) == []
    finally:
        torch.set_num_threads(before)


@needs_avx2
def test_avx2_backend_is_the_default_without_vnni_and_falls_back_for_odd_inputs():
    f = cpu_features()
    method = Int8W8A8LinearMethod("cpu")
    if f.amx_int8:
        assert method.backend == "amx"
    elif avx2_int8_vnni("cpu"):
        assert method.backend == "avx2" and method.name == "int8 W8A8 (AVX2 u8s8 with AVX512-VNNI)"
    elif not (f.avx512_vnni or f.avx_vnni):
        assert method.backend == "avx2" and method.name == "int8 W8A8 (AVX2 u8s8, 7-bit weights)"
    layer = _layer(30, 20, bias=True, seed=1, backend="avx2")     # K % 4 != 0
    layer.linear_method.process_weights_after_loading(layer)
    assert layer.int8_backend == layer.linear_method.fallback_backend != "avx2"
    want = _layer(30, 20, bias=True, seed=1, backend="torch", weight_bits=layer.linear_method.weight_bits)
    want.linear_method.process_weights_after_loading(want)
    x = _acts(5, 30, torch.float32, seed=2)
    assert torch.equal(layer(x), want(x))


@needs_avx2
def test_the_kernel_sums_with_vnni_exactly_where_the_cpu_has_it():
    """The build takes the VPDPBUSD path on every AVX-512 CPU with VNNI (else a VNNI CPU
    would quietly fall back to oneDNN and every value test would still pass)."""
    f = cpu_features()
    assert avx2_int8_vnni("cpu") == (f.avx512_vnni and f.avx512f and f.avx512bw and f.avx512vl)
