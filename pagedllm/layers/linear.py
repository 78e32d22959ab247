"""Linear layers that own their weights' loading, and the methods that compute them.

A layer (``ReplicatedLinear``, ``RowParallelLinear``, ``QKVParallelLinear``,
``MergedColumnParallelLinear``, after vLLM's) knows its shape and where each checkpoint
tensor goes in its (possibly fused) weight; a ``LinearMethod``, picked once per model by
``get_linear_method``, creates the parameters, prepares them after loading and computes
``x @ W.T + b``. A quantization config would plug in at ``get_linear_method``. There is no
tensor parallelism yet: the loaders place shards by output offset, so splitting a layer
over ranks would only change those offsets and sizes. Quantized methods
(``layers/quantization``) come from the model's ``QuantizationConfig``, which every layer
asks first.

oneDNN-packed weights. On the CPU in float32, ``F.linear`` goes to MKL's sgemm, which
re-packs the weight on every call and, for few rows, picks other kernels than for many.
oneDNN's inner product (``torch.ops.mkldnn._linear_pointwise``, the op torch.compile's
CPU backend emits for a frozen linear) takes a weight reordered once into its blocked
layout (``torch.ops.mkldnn._reorder_linear_weight``). Measured on this project's 2-core
AVX2 machine (fp32, SmolLM2-135M shapes): 64 rows 110-124 GFLOP/s vs 92-104 for
``F.linear``, the 49152-row LM head 116 vs 51; 2048 rows 128-139 vs 118-126. Each output
row is also bitwise independent of the other rows in the batch (``F.linear``'s is not: at
1-5 rows its rows differ from the same rows in a bigger batch), which keeps greedy
outputs independent of batching. In bfloat16 the weights are packed too where oneDNN can
reorder a bf16 weight on this CPU (AVX512-BW/VL/DQ or AVX-NE-CONVERT; checked once by a
tiny probe): on the project's Intel Xeon a 64-row 576 -> 1536 linear ran ~1200 GFLOP/s
packed vs ~830 with ``F.linear``; on its AVX2 AMD EPYC the reorder raises and
``F.linear`` runs. Elsewhere (CUDA, float16, no oneDNN, or ``PAGEDLLM_ONEDNN=0``) the
plain ``F.linear`` runs.

AVX512-BF16. In bfloat16 on a CPU with AVX512-BF16 and no AMX (AMD Zen 4/5),
``AVX512BF16LinearMethod`` runs the project's VDPBF16PS kernel over the same packed layout
as AMX's: batch-invariant by construction and faster than oneDNN (docs/benchmarks.md §11).

Float32 logits. ``LinearMethod.apply_float32`` multiplies from x's dtype and returns the
float32 accumulator, never rounded to 16 bits; the LM head uses it with every method.

AMX. In bfloat16 on a CPU with AMX-BF16 (the Intel Xeon), ``AMXBF16LinearMethod`` runs
the project's own tile kernel instead of oneDNN: oneDNN's bf16 rows there depend on the row
count (<= 32 rows one way, 33-384 another), and the 16-row chunks that made them
invariant cost 2-5x at 64-512 rows; the kernel's rows are invariant by construction and it
runs level with unwrapped oneDNN (64 x (200 in, 128 out): 631.5 output tok/s against
431.1 with oneDNN in chunks, docs/benchmarks.md).

Batch invariance. Where a method's per-row result does depend on the number of rows
(``pagedllm/layers/batch_invariance.py`` probes each shape at load),
``RowChunkedLinearMethod`` wraps it so that every call it makes has the same row count, or,
where rows depend on M at a few small row counts only, ``PaddedRowsLinearMethod`` pads those
calls.
"""
from __future__ import annotations

import functools
import time
from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import envs
from pagedllm.distributed import (divide, get_tp_rank, get_tp_size, kv_head_shard,
                                  tensor_model_parallel_all_reduce)
from pagedllm.kernels.cpu import trace
from pagedllm.errors import InvalidParameterError
from pagedllm.layers.utils import check_shape, cpu_kernels_for, default_weight_loader


class LinearMethod(ABC):
    """How a linear layer's weight is stored and multiplied.

    Attributes:
        name: how ``describe_compute_path`` names it.
        float_weight: True when ``process_weights_after_loading`` prepares ``apply``'s
            weights from nothing but a dense float ``layer.weight`` (of the layer's dtype),
            so that a stand-in layer with another weight can be made (the batch-invariance
            probe's cancellation weights); False for quantized methods, whose weights come
            packed or are rounded to integers.
    """

    name: str
    float_weight: bool = False
    # Row-parallel layers split the input features; a method storing blocks of several
    # weights per byte range splits only on block boundaries.
    input_shard_multiple: int = 1

    def shard_input(self, loaded: torch.Tensor, start: int, size: int) -> torch.Tensor:
        """Input features [start, start + size) of a checkpoint weight as this method loads
        it (row-parallel sharding): ``loaded[:, start:start + size]`` for a dense [out, in]."""
        return loaded.narrow(1, start, size)

    def create_weights(self, layer: nn.Module, input_size: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype, device: torch.device) -> None:
        """Register ``layer.weight``, [sum(output_partition_sizes), input_size] in
        ``params_dtype``, uninitialised until loaded (the outputs of a fused layer,
        e.g. q|k|v, stacked in partition order)."""
        weight = torch.empty(sum(output_partition_sizes), input_size, dtype=params_dtype, device=device)
        layer.weight = nn.Parameter(weight, requires_grad=False)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn the loaded dense weight into what ``apply`` needs (once, after loading)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T + bias``: x [T, in] → [T, out] in x's dtype; bias [out] or None."""

    def apply_float32(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T + bias`` multiplied from x's dtype and accumulated and returned in
        float32, never rounded to x's dtype (the LM head's logits: rounded to bfloat16,
        logits of 16-32 move in steps of 0.125-0.25 nats and near-ties swap).

        x [T, in]; returns float32 [T, out] (possibly a non-contiguous view). This default
        serves float32 x only (``apply``); methods for other dtypes override it.

        Raises:
            NotImplementedError: x not float32 and the method has no float32 output.
        """
        if x.dtype != torch.float32:
            raise NotImplementedError(f"{self.name} has no float32-output path for {x.dtype} inputs")
        return self.apply(layer, x, bias)

    def stack_linear(self, layer: nn.Module, kernels) -> object | None:
        """This layer as the C++ decoder stack calls it (``models/fused_decoder.py``): a
        ``kernels.StackLinear`` that runs the same kernel as ``apply`` on the same operands
        (bias included), so its output is bitwise ``apply``'s; or None where ``apply``
        runs anything but such a kernel (the default: dense and oneDNN methods, wrappers).

        Args:
            layer: a layer this method computes, its weights processed.
            kernels: the compiled kernel module (``kernels_for``).
        """
        return None

    def layer_name(self, layer: nn.Module) -> str:
        """How ``describe_compute_path`` names what this method runs for ``layer``: ``name``,
        or for a layer whose shape the method's kernel cannot hold, the fallback that
        computes it instead (a method shared by every layer may run another kernel for
        one of them)."""
        return self.name


class UnquantizedLinearMethod(LinearMethod):
    """The dense weight and ``F.linear``. ``apply_float32`` in a 16-bit dtype: on CUDA
    ``torch.mm`` with a float32 output (``mm_float32_out_works``); elsewhere (or without
    that op) a float32 product of x and a float32 copy of the weight (bf16 and fp16 values
    are exact in float32, so only the accumulation differs), the copy kept as
    ``layer.weight_float32`` from ``process_weights_after_loading`` when the layer has
    ``float32_out`` set (the LM head), else made per call."""

    name = "F.linear"
    float_weight = True

    def process_weights_after_loading(self, layer):
        dense = layer.weight.data
        if (getattr(layer, "float32_out", False) and dense.dtype != torch.float32
                and not mm_float32_out_works(dense.device, dense.dtype)):
            layer.weight_float32 = dense.float()

    def apply(self, layer, x, bias=None):
        return F.linear(x, layer.weight, bias)

    def apply_float32(self, layer, x, bias=None):
        if x.dtype == torch.float32:
            return self.apply(layer, x, bias)
        b = None if bias is None else bias.float()
        if mm_float32_out_works(x.device, x.dtype):
            out = torch.mm(x, layer.weight.t(), out_dtype=torch.float32)
            return out if b is None else out + b
        w = getattr(layer, "weight_float32", None)
        return F.linear(x.float(), layer.weight.float() if w is None else w, b)


@functools.lru_cache(maxsize=8)
def mm_float32_out_works(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether ``torch.mm(a, b, out_dtype=torch.float32)`` multiplies ``dtype`` operands on
    ``device`` (CUDA in 16-bit dtypes; torch has no CPU kernel for it): a one-time probe of a
    2 x 32 by 32 x 16 product against the float32 product of the same values, cached.
    Never raises."""
    device = torch.device(device)
    if device.type == "cpu" or dtype == torch.float32:
        return False
    try:
        g = torch.Generator().manual_seed(0)
        a = torch.randn(2, 32, generator=g).to(device=device, dtype=dtype)
        b = torch.randn(32, 16, generator=g).to(device=device, dtype=dtype)
        out = torch.mm(a, b, out_dtype=torch.float32)
        return out.dtype == torch.float32 and bool(torch.allclose(out, a.float() @ b.float(), atol=1e-4))
    except Exception:  # RuntimeError/TypeError where the op or the dtype is missing
        return False


def onednn_packing_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether weights for ``device``/``dtype`` are packed for oneDNN: on the CPU with
    mkldnn, unless ``PAGEDLLM_ONEDNN=0``; float32 always, bfloat16 where
    ``onednn_bf16_packing_works()`` (float16 never)."""
    if not (torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()
            and envs.onednn_enabled()):
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and onednn_bf16_packing_works()


@functools.lru_cache(maxsize=1)
def onednn_bf16_packing_works() -> bool:
    """Whether oneDNN can reorder a bf16 weight and multiply with it on this CPU: a one-time
    probe (a 32 x 64 weight, 2 rows; well under a millisecond), cached per process.
    False on CPUs without AVX512-BW/VL/DQ or AVX-NE-CONVERT, where torch raises
    ("bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and
    avx512dq"), and when the product differs from ``F.linear``'s by more than bf16 rounding.
    Never raises."""
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(32, 64, generator=g).to(torch.bfloat16)
        x = torch.randn(2, 64, generator=g).to(torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.allclose(y.float(), F.linear(x.float(), w.float()), rtol=0.05, atol=0.1))
    except Exception:   # RuntimeError on CPUs without the ISA; anything else: don't pack
        return False


class OneDNNPackedLinearMethod(LinearMethod):
    """The weight reordered once into oneDNN's blocked layout, multiplied by oneDNN's inner
    product (see the module docstring); CPU float32, and bfloat16 where
    ``onednn_bf16_packing_works()``.

    After ``process_weights_after_loading``, ``layer.packed_weight`` is the opaque oneDNN
    tensor and ``layer.weight`` an empty placeholder (the dense copy is released) unless
    ``layer.keep_dense_weight`` is true (a tied LM head, whose weight is also the
    embedding table).
    """

    name = "oneDNN-packed"
    float_weight = True

    def process_weights_after_loading(self, layer):
        layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight.data.contiguous(), None)
        if getattr(layer, "float32_out", False) and layer.weight.dtype != torch.float32:
            layer.packed_weight_float32 = _pack_float32_copy(layer)
        if not getattr(layer, "keep_dense_weight", False):
            layer.weight.data = layer.weight.data.new_empty(0)

    def apply(self, layer, x, bias=None):
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), layer.packed_weight, bias, "none", [], "")

    def apply_float32(self, layer, x, bias=None):
        """oneDNN writes x's dtype only (through torch): for bfloat16 x, the float32 product
        of x and a float32 copy of the weight packed once (``layer.packed_weight_float32``,
        made when the layer has ``float32_out``, else here on first use). Only CPUs with
        oneDNN bf16 but neither AVX512-BF16 nor AMX come here in bf16 (others take
        ``AVX512BF16LinearMethod`` or ``AMXBF16LinearMethod``)."""
        if x.dtype == torch.float32:
            return self.apply(layer, x, bias)
        if getattr(layer, "packed_weight_float32", None) is None:
            layer.packed_weight_float32 = _pack_float32_copy(layer)
        return torch.ops.mkldnn._linear_pointwise(x.float().contiguous(), layer.packed_weight_float32,
                                                  None if bias is None else bias.float(), "none", [], "")


def _pack_float32_copy(layer: nn.Module) -> torch.Tensor:
    """A float32 copy of ``layer``'s dense weight in oneDNN's packed layout.

    Raises:
        RuntimeError: the dense weight was already released (a layer without
            ``keep_dense_weight`` or ``float32_out`` set before loading)."""
    if layer.weight.numel() == 0:
        raise RuntimeError("a float32 output needs the dense weight: set float32_out before loading")
    return torch.ops.mkldnn._reorder_linear_weight(layer.weight.data.float().contiguous(), None)


def amx_ops(device: torch.device | str, query: str):
    """The compiled kernel module where its AMX query ``query`` ("amx_bf16_available" or
    "amx_int8_available") holds for ``device``: the CPU, the C++ kernels built with those
    AMX extensions (``-march=native`` on a CPU that has them) and the process granted AMX
    state by Linux, unless ``PAGEDLLM_AMX=0``; else None. Never raises."""
    if torch.device(device).type != "cpu" or not envs.amx_enabled():
        return None
    ops = cpu_kernels_for(device, torch.float32)     # one module for every dtype
    return ops if ops is not None and hasattr(ops, query) and getattr(ops, query)() else None


def amx_bf16_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether ``AMXBF16LinearMethod`` runs for ``device``/``dtype``: bfloat16 and
    ``amx_ops(device, "amx_bf16_available")``. Never raises."""
    return dtype == torch.bfloat16 and amx_ops(device, "amx_bf16_available") is not None


def amx_tiles_fit(out_features: int, in_features: int, dtype: torch.dtype) -> bool:
    """Whether an [out, in] weight of ``dtype`` (bfloat16 or int8) fits AMX's B tiles: out
    a multiple of 16 and in a multiple of one 64-byte tile row (32 bf16, 64 int8)."""
    return out_features % 16 == 0 and in_features % (64 // dtype.itemsize) == 0


def pack_amx_tiles(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A weight [N, K] as ``dtype`` (bfloat16 for TDPBF16PS, int8 for TDPBUSD;
    ``amx_tiles_fit``) in AMX's B-tile ("VNNI") layout, [N/16, K/g, 16, g] with g = 64 /
    element size (32 bf16, 64 int8) and p = 4 / element size (2 or 4) inputs per group:
    tile (nb, kb) row r holds, for the 16 outputs n of block nb, the inputs pr .. pr + p - 1
    of block kb, i.e. element [nb, kb, r, p n + j] = weight[16 nb + n, g kb + p r + j]
    (Intel's AMX programming reference, TDPBF16PS / TDPBUSD).

    Raises:
        ValueError: a shape the layout cannot hold.
    """
    n, k = weight.shape
    g = 64 // dtype.itemsize
    if not amx_tiles_fit(n, k, dtype):
        raise ValueError(f"pack_amx_tiles needs N % 16 == 0 and K % {g} == 0 for {dtype}, "
                         f"got a [{n}, {k}] weight")
    p = 4 // dtype.itemsize
    w = weight.to(dtype).reshape(n // 16, 16, k // g, 16, p)
    return w.permute(0, 2, 3, 1, 4).contiguous().view(n // 16, k // g, 16, g)


class _TiledBF16LinearMethod(LinearMethod):
    """A bfloat16 C++ kernel over weights packed once at load by ``pack_amx_tiles``
    ([N/16, K/32, 16, 32]), each output element one float32 chain over K in a fixed order
    from zero, so rows are batch-invariant by construction; ``apply`` rounds it to
    bfloat16 once, ``apply_float32`` returns it. Layers whose shape the layout cannot hold
    (out % 16 or in % 32 not 0) compute with ``OneDNNPackedLinearMethod`` (or ``F.linear``
    where oneDNN cannot pack bf16) instead (``layer.tiled_weight`` is then None), which
    the batch-invariance probe checks as it checks every layer.

    x: [T, in] bfloat16 (made contiguous); bias [out] or None.

    Subclasses set ``name`` and ``_kernel``, the kernel module's function name (called as
    ``f(x, w_packed, bias, out_float32)``).
    """

    float_weight = True
    _kernel: str

    def __init__(self):
        self._ops = cpu_kernels_for("cpu", torch.bfloat16)
        self._fallback = _dense_linear_method("cpu", torch.bfloat16)

    def layer_name(self, layer):
        return self._fallback.layer_name(layer) if getattr(layer, "tiled_weight", True) is None else self.name

    def process_weights_after_loading(self, layer):
        if not amx_tiles_fit(*layer.weight.shape, torch.bfloat16):
            layer.tiled_weight = None
            self._fallback.process_weights_after_loading(layer)
            return
        layer.tiled_weight = pack_amx_tiles(layer.weight.data, torch.bfloat16)
        if not getattr(layer, "keep_dense_weight", False):
            layer.weight.data = layer.weight.data.new_empty(0)

    def _run(self, layer, x, bias, out_float32: bool):
        lead = x.shape[:-1]
        with trace(f"pagedllm::{self._kernel}"):
            y = getattr(self._ops, self._kernel)(x.reshape(-1, x.shape[-1]).contiguous(), layer.tiled_weight,
                                                 bias, out_float32)
        return y.view(*lead, y.shape[-1])

    def apply(self, layer, x, bias=None):
        if layer.tiled_weight is None:
            return self._fallback.apply(layer, x, bias)
        return self._run(layer, x, bias, False)

    def apply_float32(self, layer, x, bias=None):
        if layer.tiled_weight is None:
            return self._fallback.apply_float32(layer, x, bias)
        return self._run(layer, x, bias, True)


class AMXBF16LinearMethod(_TiledBF16LinearMethod):
    """bfloat16 ``x @ W.T + b`` on Intel AMX tiles (TDPBF16PS) through the C++ kernel
    ``amx_bf16_linear`` (``kernels/csrc/amx_linear.cpp``). oneDNN's bf16 inner product on
    an AMX Xeon gives other bits at <= 32 rows than at 33-384 and needs 16-row chunks to
    be invariant; this kernel needs none (docs/cpu-kernels.md)."""

    name = "AMX bf16 (C++)"
    _kernel = "amx_bf16_linear"


class AVX512BF16LinearMethod(_TiledBF16LinearMethod):
    """bfloat16 ``x @ W.T + b`` with AVX512-BF16's VDPBF16PS through the C++ kernel
    ``avx512_bf16_linear`` (``kernels/csrc/bf16_linear_avx512.cpp``), for CPUs with
    AVX512-BF16 and no AMX (AMD Zen 4/5): batch-invariant without padding or chunks,
    and as fast as oneDNN's packed bf16 or faster (docs/cpu-kernels.md)."""

    name = "AVX512-BF16 (C++)"
    _kernel = "avx512_bf16_linear"


def avx512_bf16_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether ``AVX512BF16LinearMethod`` runs for ``device``/``dtype``: bfloat16 on the
    CPU, the C++ kernels built with AVX512-BF16 (``-march=native`` on a CPU that has it),
    unless ``PAGEDLLM_AVX512_BF16=0``. Never raises."""
    if dtype != torch.bfloat16 or torch.device(device).type != "cpu" or not envs.avx512_bf16_enabled():
        return False
    ops = cpu_kernels_for(device, torch.float32)
    return ops is not None and hasattr(ops, "avx512_bf16_available") and ops.avx512_bf16_available()


def bf16_kernel_name(device: torch.device | str) -> str | None:
    """The name of the project's bf16 linear kernel that ``get_linear_method`` would pick
    for ``device`` in bfloat16 ("AMX bf16 (C++)", "AVX512-BF16 (C++)"), or None. Never
    raises."""
    if amx_bf16_available(device, torch.bfloat16):
        return AMXBF16LinearMethod.name
    if avx512_bf16_available(device, torch.bfloat16):
        return AVX512BF16LinearMethod.name
    return None


def get_linear_method(device: torch.device | str, dtype: torch.dtype) -> LinearMethod:
    """The method every linear layer of a model on ``device`` in ``dtype`` uses: the AMX
    kernel where ``amx_bf16_available``, else the AVX512-BF16 kernel where
    ``avx512_bf16_available``, else oneDNN-packed where ``onednn_packing_available``,
    else dense ``F.linear``."""
    if amx_bf16_available(device, dtype):
        return AMXBF16LinearMethod()
    if avx512_bf16_available(device, dtype):
        return AVX512BF16LinearMethod()
    return _dense_linear_method(device, dtype)


def _dense_linear_method(device: torch.device | str, dtype: torch.dtype) -> LinearMethod:
    """``get_linear_method`` without the AMX kernel: oneDNN-packed where
    ``onednn_packing_available``, else dense ``F.linear``."""
    if onednn_packing_available(device, dtype):
        return OneDNNPackedLinearMethod()
    return UnquantizedLinearMethod()


class _WrappingLinearMethod(LinearMethod):
    """A method that computes through ``inner`` (the batch-invariance wrappers below): the
    weights are ``inner``'s, created and prepared by it."""

    def __init__(self, inner: LinearMethod, suffix: str):
        self.inner = inner
        self.float_weight = inner.float_weight
        self.suffix = suffix            # what the wrapper adds to the inner method's name
        self.name = inner.name + suffix

    def layer_name(self, layer):
        return self.inner.layer_name(layer) + self.suffix

    @property
    def input_shard_multiple(self) -> int:
        return self.inner.input_shard_multiple

    def shard_input(self, loaded, start, size):
        return self.inner.shard_input(loaded, start, size)

    def create_weights(self, layer, input_size, output_partition_sizes, params_dtype, device):
        self.inner.create_weights(layer, input_size, output_partition_sizes, params_dtype, device)

    def process_weights_after_loading(self, layer):
        self.inner.process_weights_after_loading(layer)

    def apply(self, layer, x, bias=None):
        return self._wrap(self.inner.apply, layer, x, bias)

    def apply_float32(self, layer, x, bias=None):
        return self._wrap(self.inner.apply_float32, layer, x, bias)

    @abstractmethod
    def _wrap(self, fn, layer, x, bias):
        """``fn(layer, x, bias)`` (the inner method's ``apply`` or ``apply_float32``) with
        the wrapper's calls."""


class RowChunkedLinearMethod(_WrappingLinearMethod):
    """``inner`` computed in fixed-size row chunks, so that each output row is bitwise
    independent of how many rows the batch has (Thinking Machines, "Defeating
    Nondeterminism in LLM Inference", 2025; vLLM's batch-invariant mode): x [T, in] is cut
    into ``ceil(T / chunk_rows)`` chunks of ``chunk_rows`` rows, the last one padded with
    zero rows, and ``inner.apply`` is called once per chunk, always with ``chunk_rows`` rows.
    Kernels that pick another algorithm (or split the reduction differently) for another
    row count then see one row count only. A row's result can still depend on its place
    within its chunk; ``batch_invariance.probe_row_invariance`` checks the wrapped method too.

    Cost: up to ``chunk_rows - 1`` padded rows per call (a one-row decode step computes
    ``chunk_rows`` rows; at small row counts a linear layer is bound by reading its weight,
    so this costs less than the factor suggests) and one ``inner.apply`` per chunk.

    Args:
        inner: the method that computes each chunk (its weights are the layer's, prepared
            by ``inner.process_weights_after_loading``, which this delegates to).
        chunk_rows: rows per call, >= 1.
    """

    def __init__(self, inner: LinearMethod, chunk_rows: int):
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
        super().__init__(inner, f" in {chunk_rows}-row chunks")
        self.chunk_rows = chunk_rows

    def _wrap(self, fn, layer, x, bias):
        rows, c = x.shape[0], self.chunk_rows
        if rows == c:
            return fn(layer, x, bias)
        pad = -rows % c
        if pad or rows == 0:
            x = torch.cat([x, x.new_zeros(pad or c, x.shape[1])])
        outs = [fn(layer, x[i:i + c], bias) for i in range(0, x.shape[0], c)]
        return torch.cat(outs)[:rows]


class PaddedRowsLinearMethod(_WrappingLinearMethod):
    """``inner`` with every call of fewer than ``min_rows`` rows padded with zero rows up to
    ``min_rows`` (the result cut back), for kernels whose rows depend on M only at a few
    small row counts: on an AVX512-BF16 AMD EPYC (family 26) oneDNN's packed bf16
    1536 -> 576 inner product sums a one-row call in another order than any bigger one
    (``batch_invariance.py``). Calls of ``min_rows`` rows or more go to ``inner`` as they
    are, so unlike ``RowChunkedLinearMethod`` a prefill of thousands of rows stays one call.

    Args:
        inner: the method that computes (its weights are the layer's, prepared by
            ``inner.process_weights_after_loading``, which this delegates to).
        min_rows: the fewest rows a call to ``inner`` has, >= 2.
    """

    def __init__(self, inner: LinearMethod, min_rows: int):
        if min_rows < 2:
            raise ValueError(f"min_rows must be >= 2, got {min_rows}")
        super().__init__(inner, f", calls under {min_rows} rows padded")
        self.min_rows = min_rows

    def _wrap(self, fn, layer, x, bias):
        rows = x.shape[0]
        if rows >= self.min_rows:
            return fn(layer, x, bias)
        x = torch.cat([x, x.new_zeros(self.min_rows - rows, x.shape[1])])
        return fn(layer, x, bias)[:rows]


def measure_linear_gflops(in_features: int, out_features: int, rows: int, dtype: torch.dtype,
                          device: torch.device | str = "cpu", reps: int = 5,
                          max_weight_elements: int = 1 << 24) -> tuple[float, str]:
    """Throughput of one linear layer computed the way the engine would (``get_linear_method``:
    oneDNN-packed where available), for choosing a dtype.

    A [rows, in_features] input times an [out, in_features] weight, one warm-up call, then
    the best of ``reps`` timed calls. To bound the cost for big models, ``out`` is
    ``out_features`` capped so the weight has at most ``max_weight_elements`` elements
    (GFLOP/s barely depend on it past a few MB). The weight is small constants, not random
    (generating it costs more than timing it; speed does not depend on the values, and
    they are far from denormals).

    Args:
        in_features, out_features, rows: the shape; dtype, device: what is timed.
        reps: timed calls (>= 1).

    Returns:
        (GFLOP/s as 2 * rows * in * out / best seconds / 1e9, the method's name).
    """
    out = max(1, min(out_features, max_weight_elements // max(in_features, 1)))
    layer = ReplicatedLinear(in_features, out, False, dtype, torch.device(device))
    with torch.inference_mode():
        layer.weight.data.fill_(0.01)
        layer.linear_method.process_weights_after_loading(layer)
        x = torch.full((rows, in_features), 0.5, dtype=dtype, device=device)
        layer(x)
        best = float("inf")
        for _ in range(max(1, reps)):
            t = time.perf_counter()
            layer(x)
            best = min(best, time.perf_counter() - t)
    return 2.0 * rows * in_features * out / max(best, 1e-9) / 1e9, layer.linear_method.layer_name(layer)


class LinearBase(nn.Module):
    """A linear layer y = x @ W.T (+ b): W [output_size, input_size] in ``params_dtype``,
    optional bias [output_size] (zeros until loaded). The sizes are this tensor-parallel
    rank's (``distributed``); subclasses take the model's and split them, and their
    weight loaders narrow each whole checkpoint tensor to this rank's part.

    Args:
        input_size: in features; output_sizes: out features of each fused part (one part
            for a plain layer), stacked in this order in W's rows.
        bias: whether the layer has a bias.
        params_dtype, device: of the parameters.
        linear_method: how W is stored and multiplied (default: what ``quant_config``
            answers for this layer, else ``get_linear_method``).
        prefix: the layer's parameter name prefix, e.g. ``model.layers.0.self_attn.qkv_proj``
            (for error messages, and how ``quant_config`` knows the layer).
        quant_config: the model's ``QuantizationConfig``, or None (dense weights).

    Attributes:
        params_dtype: the dtype of the activations (and of a dense weight); a quantized
            method may store ``weight`` in another dtype.
        tp_rank, tp_size: this process's tensor-parallel rank and the group's size.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, params_dtype: torch.dtype,
                 device: torch.device, linear_method: LinearMethod | None = None, prefix: str = "",
                 quant_config=None):
        super().__init__()
        self.input_size, self.output_sizes, self.prefix = input_size, list(output_sizes), prefix
        self.params_dtype = params_dtype
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        if linear_method is None and quant_config is not None:
            linear_method = quant_config.get_linear_method(prefix, input_size, self.output_sizes,
                                                           params_dtype, device)
        self.linear_method = linear_method or get_linear_method(device, params_dtype)
        self._check_shard()
        self.linear_method.create_weights(self, input_size, self.output_sizes, params_dtype, device)
        self.bias = (nn.Parameter(torch.zeros(sum(output_sizes), dtype=params_dtype, device=device),
                                  requires_grad=False) if bias else None)
        for p in (self.weight, self.bias):
            if p is not None:
                p.weight_loader = self.weight_loader
        self.output_size = sum(self.output_sizes)

    def _check_shard(self) -> None:
        """Raises InvalidParameterError("tensor_parallel_size") where this rank's part cannot
        be stored by the method (a subclass that splits input features checks it)."""

    @property
    def compute_path(self) -> tuple[str, str, str]:
        """("linear", the method's name for this layer (``LinearMethod.layer_name``), the
        layer's short name such as "qkv_proj"), for ``describe_compute_path``; follows the
        method if it is replaced (wrapped) later."""
        return ("linear", self.linear_method.layer_name(self), self.prefix.rpartition(".")[2] or "linear")

    def _param_name(self, param: nn.Parameter) -> str:
        return f"{self.prefix}.{'bias' if param is self.bias else 'weight'}"

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        """Copy the checkpoint tensor ``loaded_weight`` into ``param`` (this layer's weight
        or bias): whole here; fused layers place it by ``shard_id``.

        Raises:
            ValueError: the shape differs from the destination's (named in the message).
        """
        default_weight_loader(param, loaded_weight, self._param_name(param))

    def _load_shard(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard: int, label,
                    rows: tuple[int, int, int] | None = None) -> None:
        """Copy ``loaded_weight``'s rows [start, start + n) (``rows`` = (start, n, the
        checkpoint's row count); all of them at one rank) into the rows of part ``shard``
        of ``param``."""
        if rows is not None and self.tp_size > 1:
            loaded_weight = _narrow_rows(loaded_weight, *rows, f"{self._param_name(param)} shard {label!r}")
        offset = sum(self.output_sizes[:shard])
        target = param.data.narrow(0, offset, self.output_sizes[shard])
        check_shape(f"{self._param_name(param)} shard {label!r}", target, loaded_weight)
        target.copy_(loaded_weight.to(param.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, input_size] → [T, output_size] in x's dtype."""
        return self.linear_method.apply(self, x, self.bias)


def _narrow_rows(loaded: torch.Tensor, start: int, n: int, full: int, name: str) -> torch.Tensor:
    """Rows [start, start + n) of a checkpoint tensor of ``full`` rows; ValueError naming
    it when it has another number of rows."""
    if loaded.shape[0] != full:
        raise ValueError(f"weight {name}: shape {tuple(loaded.shape)} has {loaded.shape[0]} rows, expected {full}")
    return loaded.narrow(0, start, n)


class ReplicatedLinear(LinearBase):
    """A plain linear layer: input_size → output_size (a full copy on every rank)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, params_dtype: torch.dtype,
                 device: torch.device, linear_method: LinearMethod | None = None, prefix: str = "",
                 quant_config=None):
        super().__init__(input_size, [output_size], bias, params_dtype, device, linear_method, prefix,
                         quant_config)


class RowParallelLinear(LinearBase):
    """A linear layer whose input features are split over the tensor-parallel ranks
    (o_proj, down_proj): each rank multiplies its ``input_size / tp`` features and the
    partial outputs are summed by an all-reduce (Megatron-LM's row-parallel layer; the
    bias is added once, after the sum).

    Args:
        input_size, output_size: the model's (whole) sizes.
        reduce_results: all-reduce the output (False: the caller sums several layers'
            partial outputs once, as ``FusedMoE`` does; the bias is then added on rank 0).

    Raises:
        InvalidParameterError("tensor_parallel_size"): the split is uneven or falls inside
            the method's blocks (``LinearMethod.input_shard_multiple``).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool, params_dtype: torch.dtype,
                 device: torch.device, linear_method: LinearMethod | None = None, prefix: str = "",
                 quant_config=None, reduce_results: bool = True):
        self.reduce_results = reduce_results
        self.full_input_size = input_size
        super().__init__(divide(input_size, get_tp_size(), f"{prefix or 'linear'} input features"),
                         [output_size], bias, params_dtype, device, linear_method, prefix, quant_config)

    def _check_shard(self) -> None:
        mult = self.linear_method.input_shard_multiple
        if self.tp_size > 1 and self.input_size % mult:
            raise InvalidParameterError(
                "tensor_parallel_size",
                f"tensor_parallel_size {self.tp_size} splits {self.prefix}'s {self.full_input_size} input "
                f"features into {self.input_size} per rank, not a multiple of {self.linear_method.name}'s "
                f"{mult}-weight blocks")

    def weight_loader(self, param, loaded_weight, shard_id=None):
        """Copy this rank's input features of the checkpoint weight (the whole bias).

        Raises:
            ValueError: a shape that differs from the layer's (named).
        """
        if param is self.weight and self.tp_size > 1:
            loaded_weight = self.linear_method.shard_input(loaded_weight, self.tp_rank * self.input_size,
                                                           self.input_size)
        default_weight_loader(param, loaded_weight, self._param_name(param))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, input_size / tp] → [T, output_size] in x's dtype, summed over the ranks."""
        if self.tp_size == 1:
            return self.linear_method.apply(self, x, self.bias)
        y = self.linear_method.apply(self, x).contiguous()
        if self.reduce_results:
            y = tensor_model_parallel_all_reduce(y)
        if self.bias is not None and (self.reduce_results or self.tp_rank == 0):
            y = y + self.bias
        return y


class MergedColumnParallelLinear(LinearBase):
    """Several linear layers over the same input with their outputs concatenated (gate|up:
    one matmul instead of two), each part's output features split over the
    tensor-parallel ranks. Checkpoint tensors are loaded with ``shard_id`` = the part's
    index (0 for gate, 1 for up).

    Args:
        output_sizes: the model's (whole) size of each part.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, params_dtype: torch.dtype,
                 device: torch.device, linear_method: LinearMethod | None = None, prefix: str = "",
                 quant_config=None):
        tp = get_tp_size()
        super().__init__(input_size, [divide(n, tp, f"{prefix or 'linear'} output features") for n in output_sizes],
                         bias, params_dtype, device, linear_method, prefix, quant_config)

    def weight_loader(self, param, loaded_weight, shard_id=None):
        """Copy this rank's rows of part ``shard_id`` (int index into ``output_sizes``)
        into its rows of ``param``.

        Raises:
            ValueError: a shape that differs from that part's (layer and shard named).
        """
        n = self.output_sizes[shard_id]
        self._load_shard(param, loaded_weight, shard_id, shard_id, (self.tp_rank * n, n, n * self.tp_size))


class QKVParallelLinear(LinearBase):
    """The fused q|k|v projection: hidden_size → (heads + 2 * kv_heads) * head_dim of this
    rank (query heads split over the tensor-parallel ranks; KV heads split, or
    replicated when there are fewer than ranks: ``distributed.kv_head_shard``), q's rows
    first, then k's, then v's. Checkpoint tensors are loaded with ``shard_id`` "q", "k"
    or "v".

    Attributes:
        num_heads, num_kv_heads: this rank's query and KV heads.
        q_size, kv_size: output features of q and of each of k and v on this rank.
    """

    _SHARDS = {"q": 0, "k": 1, "v": 2}

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 params_dtype: torch.dtype, device: torch.device, linear_method: LinearMethod | None = None,
                 prefix: str = "", quant_config=None):
        tp, rank = get_tp_size(), get_tp_rank()
        self.num_heads = divide(num_heads, tp, "attention heads")
        self.kv_head_start, self.num_kv_heads = kv_head_shard(num_kv_heads, rank, tp)
        self.total_num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        super().__init__(hidden_size, [self.q_size, self.kv_size, self.kv_size], bias, params_dtype,
                         device, linear_method, prefix, quant_config)

    def weight_loader(self, param, loaded_weight, shard_id=None):
        """Copy this rank's heads of the ``shard_id`` ("q", "k" or "v") projection into
        its rows of ``param``.

        Raises:
            ValueError: a shape that differs from that projection's (layer and shard named).
        """
        if shard_id == "q":
            rows = (self.tp_rank * self.q_size, self.q_size, self.q_size * self.tp_size)
        else:
            rows = (self.kv_head_start * self.head_dim, self.kv_size, self.total_num_kv_heads * self.head_dim)
        self._load_shard(param, loaded_weight, self._SHARDS[shard_id], shard_id, rows)
