"""The LM head returns float32 logits from every ``LinearMethod`` in a 16-bit model: the
product of the model-dtype operands accumulated in float32 and never rounded through the
16-bit dtype (rounded to bfloat16, logits of 16-32 move in steps of 0.125-0.25 nats and
near-ties swap: the README's own example answered wrong on an AVX512-BF16 EPYC)."""
from __future__ import annotations

import pytest
import torch

from pagedllm.layers.linear import (AMXBF16LinearMethod, AVX512BF16LinearMethod, OneDNNPackedLinearMethod,
                                    UnquantizedLinearMethod, amx_bf16_available, avx512_bf16_available,
                                    mm_float32_out_works, onednn_packing_available)
from pagedllm.layers.quantization.gguf_blocks import BlockQuantLinearMethod
from pagedllm.layers.quantization.int8 import Int8W8A8LinearMethod, avx2_int8_available, onednn_int8_available
from pagedllm.layers.vocab_embedding import ParallelLMHead
from pagedllm.layers.utils import cpu_kernels_for

CPU, BF16 = torch.device("cpu"), torch.bfloat16
VOCAB, HIDDEN = 384, 128


def _skip(cond: bool, why: str):
    return pytest.mark.skipif(not cond, reason=why)


DENSE = [
    pytest.param(UnquantizedLinearMethod, id="F.linear"),
    pytest.param(OneDNNPackedLinearMethod, id="onednn",
                 marks=_skip(onednn_packing_available(CPU, BF16), "oneDNN packs no bf16 weight on this CPU")),
    pytest.param(AMXBF16LinearMethod, id="amx", marks=_skip(amx_bf16_available(CPU, BF16), "no AMX-BF16")),
    pytest.param(AVX512BF16LinearMethod, id="avx512bf16",
                 marks=_skip(avx512_bf16_available(CPU, BF16), "no AVX512-BF16")),
]


def _head(method, dtype=BF16):
    g = torch.Generator().manual_seed(3)
    head = ParallelLMHead(VOCAB, HIDDEN, dtype, CPU, linear_method=method)
    head.weight.data.copy_(torch.randn(VOCAB, HIDDEN, generator=g) * 0.3)
    dense = head.weight.data.clone()
    method.process_weights_after_loading(head)
    h = (torch.randn(7, HIDDEN, generator=g) * 2).to(dtype)
    return head, dense, h


@pytest.mark.parametrize("method_class", DENSE)
def test_dense_head_equals_float32_reference_of_the_bf16_values(method_class):
    """Within float32 accumulation error of the exact (float64) product of the same bf16
    hidden states and weights, and not rounded to bf16."""
    head, w, h = _head(method_class())
    logits = head(h)
    assert logits.dtype == torch.float32 and logits.shape == (7, VOCAB) and logits.is_contiguous()
    exact = h.double() @ w.double().T
    assert exact.abs().max() > 16          # logits where bf16's steps are 0.125 and more
    torch.testing.assert_close(logits.double(), exact, rtol=0, atol=1e-5 * HIDDEN ** 0.5)
    assert not torch.equal(logits, logits.to(BF16).float())
    if method_class is not UnquantizedLinearMethod:       # MKL's F.linear: the load-time probe wraps it
        assert torch.equal(head(h[3:4]), logits[3:4])      # a row alone: the same bits


QUANT = [
    pytest.param(lambda: BlockQuantLinearMethod("Q8_0", from_float=True), id="gguf-Q8_0"),
    pytest.param(lambda: BlockQuantLinearMethod("Q4_1", from_float=True), id="gguf-Q4_1"),
    pytest.param(lambda: Int8W8A8LinearMethod(CPU, backend="torch"), id="int8-torch"),
    pytest.param(lambda: Int8W8A8LinearMethod(CPU, backend="avx2"), id="int8-avx2",
                 marks=_skip(avx2_int8_available(CPU), "no AVX2 int8 kernel")),
    pytest.param(lambda: Int8W8A8LinearMethod(CPU, backend="onednn"), id="int8-onednn",
                 marks=_skip(onednn_int8_available(CPU), "no oneDNN int8")),
]


@pytest.mark.parametrize("make", QUANT)
def test_quantized_head_returns_its_float32_accumulator(make):
    """A quantized head's logits from bf16 hidden states are the float32 result of the
    method's own arithmetic: the same as its float32-activation path on the same values
    (which quantizes them identically), never rounded to bf16."""
    method = make()
    head, _, h = _head(method)
    logits = head(h)
    assert logits.dtype == torch.float32
    ref = method.apply(head, h.float())      # float32 activations with the bf16 values
    torch.testing.assert_close(logits, ref, rtol=1e-6, atol=1e-5)
    assert not torch.equal(logits, logits.to(BF16).float())


@pytest.mark.skipif(cpu_kernels_for(CPU, BF16) is None, reason="no C++ kernels")
def test_block_quant_kernel_writes_float32_from_bf16():
    from pagedllm.layers.quantization.gguf_blocks import block_format, block_quant_linear_ref, quantize_to_blocks

    ops = cpu_kernels_for(CPU, BF16)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 64, generator=g)
    x = torch.randn(5, 64, generator=g).to(BF16)
    fmt = block_format("Q8_0")
    packed = quantize_to_blocks(w, fmt)
    y = ops.block_quant_linear(None, x, packed, int(fmt.ggml_type), out_float32=True)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, block_quant_linear_ref(x, packed, fmt, 64, out_float32=True), rtol=1e-6,
                               atol=1e-5)
    assert torch.equal(ops.block_quant_linear(None, x, packed, int(fmt.ggml_type)), y.to(BF16))


def test_mm_float32_out_is_not_claimed_on_the_cpu():
    """torch has no CPU kernel for ``mm(out_dtype=float32)``: the probe says so and the
    dense method computes from a float32 copy instead."""
    assert not mm_float32_out_works(CPU, BF16)
    head, _, _ = _head(UnquantizedLinearMethod())
    assert head.weight_float32.dtype == torch.float32
