"""GGUF block formats (Q8_0, Q4_0, Q4_1) and the block-quantized linear kernel
(pagedllm/layers/quantization/gguf_blocks.py, pagedllm/kernels/csrc/block_quant.cpp):
packing against the ``gguf`` package and the bundled model's own tensors, the C++ kernel
against the torch reference, batch invariance, and the layer methods."""
from __future__ import annotations

import functools

import gguf
import numpy as np
import pytest
import torch

from pagedllm.kernels.cpu import kernels_for
from pagedllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear
from pagedllm.layers.quantization import gguf_blocks as gb
from pagedllm.layers.quantization.gguf_blocks import (
    BlockQuantEmbeddingMethod,
    BlockQuantLinearMethod,
    block_quant_linear_ref,
    dequantize_blocks,
    quantize_to_blocks,
)
from pagedllm.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.utils import default_model_path

FMTS = ("Q8_0", "Q4_0", "Q4_1")
DTYPES = (torch.float32, torch.bfloat16)


@pytest.fixture(scope="module")
def ops():
    m = kernels_for("cpu", torch.float32)
    if m is None:
        pytest.skip("the C++ CPU kernels are unavailable")
    return m


@functools.lru_cache(maxsize=1)
def _gguf_tensors():
    """{name: (packed uint8 [N, bytes], ggml type, K)} for the bundled model's token_embd
    (Q8_0) and one Q4_1 linear."""
    reader = gguf.GGUFReader(default_model_path())
    out = {}
    for t in reader.tensors:
        if t.name in ("token_embd.weight", "blk.0.ffn_down.weight", "blk.0.attn_k.weight"):
            out[t.name] = (torch.from_numpy(np.array(t.data)), t.tensor_type, int(t.shape[0]))
    return out


def _rand(shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# ----------------------------------------------------------------------------------------
# formats: packing and unpacking
# ----------------------------------------------------------------------------------------

def test_format_table_matches_gguf():
    for name in FMTS:
        f = gb.FORMATS[name]
        assert gguf.GGML_QUANT_SIZES[f.ggml_type] == (f.block_size, f.block_bytes)
        assert gb.block_format(int(f.ggml_type)) is f and gb.block_format(f.ggml_type) is f
    with pytest.raises(ValueError, match="fmt"):
        gb.block_format("Q5_K")


@pytest.mark.parametrize("fmt", FMTS)
def test_quantize_and_dequantize_match_gguf(fmt):
    f = gb.block_format(fmt)
    w = _rand((37, 96), 0)
    w[3, :32] = 0.0                                   # an all-zero block: d = 0
    packed = quantize_to_blocks(w, fmt)
    assert packed.dtype == torch.uint8 and packed.shape == (37, 96 // 32 * f.block_bytes)
    # same bytes as ggml's reference quantizers (as ported in gguf.quants)
    np.testing.assert_array_equal(packed.numpy(), gguf.quants.quantize(w.numpy(), f.ggml_type))
    deq = dequantize_blocks(packed, fmt, 96)
    np.testing.assert_array_equal(deq.numpy(), gguf.quants.dequantize(packed.numpy(), f.ggml_type))
    assert torch.all(deq[3, :32] == 0)
    step = {"Q8_0": 1 / 127, "Q4_0": 1 / 8, "Q4_1": 2 / 15}[fmt]    # per unit of the block's range
    assert (deq - w).abs().max() <= step * w.abs().max() + 1e-6


@pytest.mark.parametrize("name", ["token_embd.weight", "blk.0.ffn_down.weight", "blk.0.attn_k.weight"])
def test_dequantize_bundled_model_tensors(name):
    packed, qtype, k = _gguf_tensors()[name]
    fmt = gb.block_format(qtype)
    assert fmt.name == ("Q8_0" if name.startswith("token_embd") else "Q4_1")
    rows = packed[:300]                                  # a slice keeps it quick
    ours = dequantize_blocks(rows, fmt, k)
    np.testing.assert_array_equal(ours.numpy(), gguf.quants.dequantize(rows.numpy(), qtype))


def test_packing_errors():
    with pytest.raises(ValueError, match="K .*= 40"):
        quantize_to_blocks(torch.randn(4, 40), "Q4_1")
    with pytest.raises(ValueError, match="2-D float"):
        quantize_to_blocks(torch.randint(0, 3, (4, 64)), "Q8_0")
    packed = quantize_to_blocks(torch.randn(4, 64), "Q4_1")
    with pytest.raises(ValueError, match="packed must be uint8"):
        dequantize_blocks(packed, "Q4_1", 96)             # wrong K for these rows
    with pytest.raises(ValueError, match="packed must be uint8"):
        dequantize_blocks(packed, "Q8_0", 64)             # wrong format
    with pytest.raises(ValueError, match="x must be"):
        block_quant_linear_ref(torch.randn(2, 96), packed, "Q4_1", 64)


# ----------------------------------------------------------------------------------------
# the torch reference
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FMTS)
def test_reference_close_to_dense_product(fmt):
    """The reference's only extra error is the int8 activations: ~1/254 of each block's
    largest |x| per element, averaging out over K."""
    w, x = _rand((50, 256), 1, 0.05), _rand((6, 256), 2)
    packed = quantize_to_blocks(w, fmt)
    dense = x @ dequantize_blocks(packed, fmt, 256).t()
    ref = block_quant_linear_ref(x, packed, fmt, 256)
    assert (ref - dense).abs().max() < 0.01 * dense.abs().max()


def test_reference_quantizes_activations_as_specified():
    x = torch.tensor([[0.5, -1.0, 0.25] + [0.0] * 29 + [0.0] * 32])        # second block all zero
    q, d, s = gb.quantize_activations(x)
    assert d[0, 0] == torch.tensor(1.0) * gb.INV127 and d[0, 1] == 0
    # 0.5 * 127 = 63.5 -> 64 (half to even), 0.25 * 127 = 31.75 -> 32
    assert q[0, 0, :3].tolist() == [64, -127, 32] and torch.all(q[0, 1] == 0)
    assert s[0, 0] == d[0, 0] * (64 - 127 + 32)


# ----------------------------------------------------------------------------------------
# the C++ kernel
# ----------------------------------------------------------------------------------------

def _kernel(ops, x, packed, fmt, bias=None, portable=False):
    out = torch.empty(x.shape[0], packed.shape[0], dtype=x.dtype)
    ops.block_quant_linear(out, x, packed, int(gb.block_format(fmt).ggml_type), bias, portable)
    return out


def _assert_close_to_ref(out, ref):
    if out.dtype == torch.bfloat16:       # a float32 rounding apart can round to neighbours
        torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=1e-5)
    else:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_kernel_quantizes_activations_like_reference(ops):
    for dtype in DTYPES:
        x = _rand((9, 160), 3, 3.0).to(dtype)
        q, d, s = gb.quantize_activations(x)
        for portable in (False, True):
            kq, kd, ksum = ops.block_quant_quantize_act(x, portable)
            assert torch.equal(kq.view(9, 5, 32), q) and torch.equal(kd, d)
            assert torch.equal(ksum, q.int().sum(-1))
    # a near-tie: x = -amax/2 gives x * (1/d) = -63.499996 in float32 (-> -63), while
    # -amax/2 * 127/amax, what an optimiser may compute instead, is -63.5 (-> -64)
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = 5.65625, -2.828125
    for portable in (False, True):
        assert ops.block_quant_quantize_act(x, portable)[0][0, :2].tolist() == [127, -63]
    assert gb.quantize_activations(x)[0][0, 0, :2].tolist() == [127, -63]


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_kernel_matches_reference(ops, fmt, dtype):
    # N = 45: not a multiple of the 8-column tile; K = 96: a multiple of 32, not of 64
    for k, n in ((96, 45), (288, 13)):
        packed = quantize_to_blocks(_rand((n, k), 4, 0.05), fmt)
        for m in (1, 3, 5, 17, 64):
            x = _rand((m, k), 5 + m).to(dtype)
            out = _kernel(ops, x, packed, fmt)
            assert out.dtype == dtype and out.shape == (m, n)
            _assert_close_to_ref(out, block_quant_linear_ref(x, packed, fmt, k))
            # the portable scalar path: the same operations (bitwise equal where the
            # compiler keeps them as written; asserted to float32 rounding)
            _assert_close_to_ref(_kernel(ops, x, packed, fmt, portable=True), out)


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_1"])      # the bundled model has no Q4_0 tensor
def test_kernel_on_bundled_model_weights(ops, fmt):
    """The bundled file's real blocks (Q4_1 ffn_down, K = 1536; Q8_0 token_embd rows)."""
    name = "token_embd.weight" if fmt == "Q8_0" else "blk.0.ffn_down.weight"
    packed, _, k = _gguf_tensors()[name]
    packed = packed[:200].contiguous()
    x = _rand((7, k), 6)
    out = _kernel(ops, x, packed, fmt)
    _assert_close_to_ref(out, block_quant_linear_ref(x, packed, fmt, k))
    dense = x @ dequantize_blocks(packed, fmt, k).t()
    assert (out - dense).abs().max() < 0.01 * dense.abs().max()


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_kernel_rows_are_batch_invariant(ops, fmt, dtype):
    """Row r of an M-row call is bitwise the same row computed alone, or in another batch
    (fewer than 4 rows read the packed weights directly, more unpack tiles first)."""
    k, n = 352, 77
    packed = quantize_to_blocks(_rand((n, k), 7, 0.05), fmt)
    x = _rand((64, k), 8).to(dtype)
    full = _kernel(ops, x, packed, fmt)
    for r in (0, 5, 63):
        assert torch.equal(_kernel(ops, x[r:r + 1].clone(), packed, fmt), full[r:r + 1])
    for lo, hi in ((3, 8), (10, 27), (40, 41), (20, 22), (30, 33)):   # 1-3 rows: the direct path
        assert torch.equal(_kernel(ops, x[lo:hi].clone(), packed, fmt), full[lo:hi])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_kernel_allocates_out_when_none(ops, dtype):
    """out=None: the kernel returns a new [M, N] tensor of x's dtype, equal to the product
    written into a given out (which it returns as well)."""
    k, n = 96, 19
    packed = quantize_to_blocks(_rand((n, k), 12, 0.05), "Q8_0")
    x, fid = _rand((2, k), 13).to(dtype), int(gb.block_format("Q8_0").ggml_type)
    new = ops.block_quant_linear(None, x, packed, fid)
    assert new.shape == (2, n) and new.dtype == dtype
    out = torch.full((2, n), float("nan"), dtype=dtype)
    assert ops.block_quant_linear(out, x, packed, fid) is not None and torch.equal(out, new)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_kernel_bias(ops, dtype):
    k, n = 64, 21
    packed = quantize_to_blocks(_rand((n, k), 9, 0.05), "Q4_1")
    x, bias = _rand((4, k), 10).to(dtype), _rand((n,), 11).to(dtype)
    out = _kernel(ops, x, packed, "Q4_1", bias)
    _assert_close_to_ref(out, block_quant_linear_ref(x, packed, "Q4_1", k, bias))
    if dtype == torch.float32:            # the bias is one float add after the sum
        assert torch.equal(out, _kernel(ops, x, packed, "Q4_1") + bias)


def test_kernel_zero_activations_and_weights(ops):
    packed = quantize_to_blocks(torch.zeros(9, 64), "Q4_1")
    assert torch.equal(_kernel(ops, torch.randn(3, 64), packed, "Q4_1"), torch.zeros(3, 9))
    packed = quantize_to_blocks(_rand((9, 64), 12), "Q8_0")
    assert torch.equal(_kernel(ops, torch.zeros(2, 64), packed, "Q8_0"), torch.zeros(2, 9))


def test_kernel_q8_weight_of_minus_128(ops):
    """A Q8_0 byte of -128 (not made by ggml's quantizer, legal in a file) is the one
    value whose magnitude int8 cannot hold: the dot must still be exact."""
    k, n = 64, 8
    packed = quantize_to_blocks(_rand((n, k), 13), "Q8_0").view(n, 2, 34).clone()
    packed[:, :, 2:] = 0x80                              # every weight = -128 * d
    packed = packed.view(n, 68)
    x = torch.full((1, k), -1.0)                          # every activation -127
    _assert_close_to_ref(_kernel(ops, x, packed, "Q8_0"), block_quant_linear_ref(x, packed, "Q8_0", k))


def test_kernel_errors(ops):
    packed = quantize_to_blocks(torch.randn(8, 64), "Q4_1")
    fid = int(gb.block_format("Q4_1").ggml_type)
    out = torch.empty(2, 8)
    with pytest.raises(ValueError, match="multiple of 32"):
        ops.block_quant_linear(out, torch.randn(2, 48), packed, fid)
    with pytest.raises(ValueError, match="bytes a row"):
        ops.block_quant_linear(out, torch.randn(2, 96), packed, fid)           # wrong K
    with pytest.raises(ValueError, match="bytes a row"):
        ops.block_quant_linear(out, torch.randn(2, 64), packed[:, :30].contiguous(), fid)
    with pytest.raises(ValueError, match="not a supported block format"):
        ops.block_quant_linear(out, torch.randn(2, 64), packed, 12)
    with pytest.raises(ValueError, match="out must be"):
        ops.block_quant_linear(torch.empty(2, 9), torch.randn(2, 64), packed, fid)
    with pytest.raises(ValueError, match="bias"):
        ops.block_quant_linear(out, torch.randn(2, 64), packed, fid, torch.randn(9))
    with pytest.raises(ValueError, match="x must be"):
        ops.block_quant_linear(out, torch.randn(2, 64).half(), packed, fid)


# ----------------------------------------------------------------------------------------
# the layer methods
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernel", "torch"])
def test_linear_method_loads_packed_fused_shards(use_kernels, monkeypatch):
    """A fused q|k|v layer loads each projection's packed rows (as a GGUF file holds them)
    into its packed weight; the result equals the reference on the stacked blocks."""
    if not use_kernels:
        monkeypatch.setattr(gb, "kernels_for", lambda device, dtype: None)
    elif kernels_for("cpu", torch.float32) is None:
        pytest.skip("the C++ CPU kernels are unavailable")
    hidden, hd = 64, 16
    layer = QKVParallelLinear(hidden, hd, 4, 2, False, torch.float32, torch.device("cpu"),
                              BlockQuantLinearMethod("Q4_1"), prefix="model.layers.0.self_attn.qkv_proj")
    assert layer.weight.dtype == torch.uint8 and layer.weight.shape == (128, 40)
    expect = "gguf Q4_1 (C++ AVX2)" if use_kernels else "gguf Q4_1 (torch)"
    if use_kernels and kernels_for("cpu", torch.float32).block_quant_isa() != "AVX2":
        expect = "gguf Q4_1 (C++ scalar)"
    assert layer.linear_method.name == expect
    shards = {s: quantize_to_blocks(_rand((rows, hidden), 20 + i, 0.1), "Q4_1")
              for i, (s, rows) in enumerate((("q", 64), ("k", 32), ("v", 32)))}
    for s, t in shards.items():
        layer.weight_loader(layer.weight, t, s)
    with pytest.raises(ValueError, match="shard 'k'"):
        layer.weight_loader(layer.weight, shards["q"], "k")
    layer.linear_method.process_weights_after_loading(layer)
    x = _rand((5, hidden), 30)
    stacked = torch.cat([shards["q"], shards["k"], shards["v"]])
    _assert_close_to_ref(layer(x), block_quant_linear_ref(x, stacked, "Q4_1", hidden))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_linear_method_from_float(dtype):
    layer = MergedColumnParallelLinear(96, [40, 40], True, dtype, torch.device("cpu"),
                                       BlockQuantLinearMethod("Q8_0", from_float=True))
    assert layer.weight.dtype == dtype and layer.weight.shape == (80, 96)
    gate, up, bias = _rand((40, 96), 40, 0.1), _rand((40, 96), 41, 0.1), _rand((80,), 42)
    layer.weight_loader(layer.weight, gate, 0)
    layer.weight_loader(layer.weight, up, 1)
    layer.weight_loader(layer.bias, bias[:40], 0)
    layer.weight_loader(layer.bias, bias[40:], 1)
    layer.linear_method.process_weights_after_loading(layer)
    assert layer.weight.dtype == torch.uint8 and layer.weight.shape == (80, 3 * 34)
    packed = quantize_to_blocks(torch.cat([gate, up]).to(dtype), "Q8_0")
    assert torch.equal(layer.weight.data, packed)
    x = _rand((3, 96), 43).to(dtype)
    _assert_close_to_ref(layer(x), block_quant_linear_ref(x, packed, "Q8_0", 96, bias.to(dtype)))


def test_linear_method_errors():
    with pytest.raises(ValueError, match="K .*= 40"):
        ReplicatedLinear(40, 8, False, torch.float32, torch.device("cpu"), BlockQuantLinearMethod("Q4_0"))
    layer = ReplicatedLinear(64, 8, False, torch.float32, torch.device("cpu"), BlockQuantLinearMethod("Q4_0"))
    with pytest.raises(ValueError, match="shape"):
        layer.weight_loader(layer.weight, quantize_to_blocks(torch.randn(8, 64), "Q4_1"))   # 20-byte blocks
    layer.weight.data = torch.zeros(8, 40, dtype=torch.uint8)
    with pytest.raises(ValueError, match="packed must be uint8"):
        layer.linear_method.process_weights_after_loading(layer)


@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernel", "torch"])
def test_tied_lm_head_on_packed_embedding(use_kernels, monkeypatch):
    """SmolLM2's layout: a Q8_0 token_embd used both for the lookup (rows dequantized) and
    as the tied LM head (the block kernel on the same bytes, no second copy)."""
    if not use_kernels:
        monkeypatch.setattr(gb, "kernels_for", lambda device, dtype: None)
    elif kernels_for("cpu", torch.float32) is None:
        pytest.skip("the C++ CPU kernels are unavailable")
    vocab, hidden = 300, 64
    from pagedllm.layers.quantization.gguf_config import GGUFConfig

    quant_config = GGUFConfig({"model.embed_tokens.weight": "Q8_0"})   # a GGUF's tied Q8_0 table
    emb = VocabParallelEmbedding(vocab, hidden, torch.float32, torch.device("cpu"), quant_config=quant_config)
    assert isinstance(emb.embedding_method, BlockQuantEmbeddingMethod)
    table = quantize_to_blocks(_rand((vocab, hidden), 50), "Q8_0")
    emb.weight.data.copy_(table)
    head = ParallelLMHead(vocab, hidden, torch.float32, torch.device("cpu"), tied_embedding=emb,
                          quant_config=quant_config)
    head.linear_method.process_weights_after_loading(head)
    assert head.weight.data_ptr() == emb.weight.data_ptr()
    assert head.compute_path[1].startswith("gguf Q8_0 (")
    ids = torch.tensor([0, 17, 299, 17])
    np.testing.assert_array_equal(emb(ids).numpy(),
                                  gguf.quants.dequantize(table[ids].numpy(), gguf.GGMLQuantizationType.Q8_0))
    h = _rand((3, hidden), 51)
    logits = head(h)
    assert logits.dtype == torch.float32 and logits.shape == (3, vocab)
    _assert_close_to_ref(logits, block_quant_linear_ref(h, table, "Q8_0", hidden))


def test_tied_lm_head_from_float_keeps_the_embedding_table():
    vocab, hidden = 100, 64
    emb = VocabParallelEmbedding(vocab, hidden, torch.float32, torch.device("cpu"))
    emb.weight.data.copy_(_rand((vocab, hidden), 60))
    head = ParallelLMHead(vocab, hidden, torch.float32, torch.device("cpu"), tied_embedding=emb,
                          linear_method=BlockQuantLinearMethod("Q8_0", from_float=True))
    head.linear_method.process_weights_after_loading(head)
    assert emb.weight.dtype == torch.float32
    packed = quantize_to_blocks(emb.weight.data, "Q8_0")
    assert torch.equal(head.weight, packed)
    h = _rand((2, hidden), 61)
    _assert_close_to_ref(head(h), block_quant_linear_ref(h, packed, "Q8_0", hidden))


def test_batch_invariance_probe_takes_block_layers_as_they_are():
    """The load-time probe (layers/batch_invariance.py) feeds block-quantized layers inputs
    in their compute dtype (not their uint8 weight's) and finds them invariant."""
    from pagedllm.layers.batch_invariance import ensure_batch_invariant_linears

    model = torch.nn.Module()
    model.proj = ReplicatedLinear(96, 40, False, torch.float32, torch.device("cpu"),
                                  BlockQuantLinearMethod("Q4_1"), prefix="proj")
    model.proj.weight.data.copy_(quantize_to_blocks(_rand((40, 96), 70, 0.1), "Q4_1"))
    model.proj.linear_method.process_weights_after_loading(model.proj)
    (probe,) = ensure_batch_invariant_linears(model)
    assert probe.dtype == torch.float32 and probe.failed_at == [] and probe.chunk_rows is None
    assert model.proj.linear_method.name.startswith("gguf Q4_1")
