"""Linear layers that own their weights' loading, and the methods that compute them.

A layer (``ReplicatedLinear``, ``QKVParallelLinear``, ... after vLLM's) knows where each
checkpoint tensor goes in its fused weight; a ``LinearMethod`` (``get_linear_method`` or
the model's ``QuantizationConfig``) creates, prepares and multiplies it (``x @ W.T + b``).
Per-CPU choice: docs/cpu-kernels.md; why each path: docs/notes/layers-linear.md."""
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
    """How a linear layer's weight is stored and multiplied. ``name`` is shown by
    ``describe_compute_path``; ``float_weight``: prepared from a dense float weight alone."""

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
        """Register ``layer.weight`` [sum(output_partition_sizes), input_size], uninitialised."""
        weight = torch.empty(sum(output_partition_sizes), input_size, dtype=params_dtype, device=device)
        layer.weight = nn.Parameter(weight, requires_grad=False)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn the loaded dense weight into what ``apply`` needs (once, after loading)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T + bias``: x [T, in] → [T, out] in x's dtype; bias [out] or None."""

    def apply_float32(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T + bias`` as float32 [T, out] (maybe a view), never rounded to x's dtype.
        Raises NotImplementedError where x is not float32 and the method has no such path."""
        if x.dtype != torch.float32:
            raise NotImplementedError(f"{self.name} has no float32-output path for {x.dtype} inputs")
        return self.apply(layer, x, bias)

    def stack_linear(self, layer: nn.Module, kernels) -> object | None:
        """A ``kernels.StackLinear`` bitwise equal to ``apply`` for the C++ decoder stack, or None."""
        return None

    def layer_name(self, layer: nn.Module) -> str:
        """``name``, or the fallback's for a layer the kernel cannot hold."""
        return self.name


class UnquantizedLinearMethod(LinearMethod):
    """Dense weight and ``F.linear``; ``apply_float32`` in 16 bits via ``torch.mm(out_dtype=
    float32)`` where it works, else a float32 weight copy (kept when ``layer.float32_out``)."""

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
    """Whether ``torch.mm(..., out_dtype=torch.float32)`` works here (cached probe). Never raises."""
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
    """Whether weights are oneDNN-packed: CPU, mkldnn, ``PAGEDLLM_ONEDNN`` on; fp32, or bf16 if probed."""
    if not (torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()
            and envs.onednn_enabled()):
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and onednn_bf16_packing_works()


@functools.lru_cache(maxsize=1)
def onednn_bf16_packing_works() -> bool:
    """Whether oneDNN reorders and multiplies a bf16 weight here (cached probe). Never raises."""
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
    """Weight reordered once into oneDNN's blocked layout (``layer.packed_weight``; the dense
    copy released unless ``layer.keep_dense_weight``); CPU float32, and bf16 where probed."""

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
        """bf16 x: multiplied with a float32 copy of the weight, packed once."""
        if x.dtype == torch.float32:
            return self.apply(layer, x, bias)
        if getattr(layer, "packed_weight_float32", None) is None:
            layer.packed_weight_float32 = _pack_float32_copy(layer)
        return torch.ops.mkldnn._linear_pointwise(x.float().contiguous(), layer.packed_weight_float32,
                                                  None if bias is None else bias.float(), "none", [], "")


def _pack_float32_copy(layer: nn.Module) -> torch.Tensor:
    """Float32 copy of the dense weight, oneDNN-packed. Raises RuntimeError if it was released."""
    if layer.weight.numel() == 0:
        raise RuntimeError("a float32 output needs the dense weight: set float32_out before loading")
    return torch.ops.mkldnn._reorder_linear_weight(layer.weight.data.float().contiguous(), None)


def amx_ops(device: torch.device | str, query: str):
    """The kernel module where its AMX query holds for ``device`` (``PAGEDLLM_AMX`` on), else None."""
    if torch.device(device).type != "cpu" or not envs.amx_enabled():
        return None
    ops = cpu_kernels_for(device, torch.float32)     # one module for every dtype
    return ops if ops is not None and hasattr(ops, query) and getattr(ops, query)() else None


def amx_bf16_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether ``AMXBF16LinearMethod`` runs for ``device``/``dtype``. Never raises."""
    return dtype == torch.bfloat16 and amx_ops(device, "amx_bf16_available") is not None


def amx_tiles_fit(out_features: int, in_features: int, dtype: torch.dtype) -> bool:
    """Whether an [out, in] ``dtype`` weight fits AMX B tiles: out % 16 == 0, in of 64-byte rows."""
    return out_features % 16 == 0 and in_features % (64 // dtype.itemsize) == 0


def pack_amx_tiles(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Weight [N, K] as ``dtype`` (bf16/int8) in AMX's B-tile layout (Intel's AMX reference):
    [N/16, K/g, 16, g] with g = 64 / itemsize, p = 4 / itemsize, element [nb, kb, r, p n + j] =
    weight[16 nb + n, g kb + p r + j]. Raises ValueError if not ``amx_tiles_fit``."""
    n, k = weight.shape
    g = 64 // dtype.itemsize
    if not amx_tiles_fit(n, k, dtype):
        raise ValueError(f"pack_amx_tiles needs N % 16 == 0 and K % {g} == 0 for {dtype}, "
                         f"got a [{n}, {k}] weight")
    p = 4 // dtype.itemsize
    w = weight.to(dtype).reshape(n // 16, 16, k // g, 16, p)
    return w.permute(0, 2, 3, 1, 4).contiguous().view(n // 16, k // g, 16, g)


class _TiledBF16LinearMethod(LinearMethod):
    """A bf16 C++ kernel over ``pack_amx_tiles`` weights, one fixed-order float32 chain per
    output (batch-invariant); shapes that do not fit use the dense method. Subclasses set
    ``name`` and ``_kernel`` (called ``f(x, w_packed, bias, out_float32)``)."""

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

    def stack_linear(self, layer, kernels):
        """``kernels.StackLinear.bf16_tiled`` over the packed weight, or None where the layer
        runs the dense fallback."""
        if layer.tiled_weight is None:
            return None
        bias = None if layer.bias is None else layer.bias.data
        return kernels.StackLinear.bf16_tiled(layer.tiled_weight, self._kernel == "amx_bf16_linear", bias)

    def apply(self, layer, x, bias=None):
        if layer.tiled_weight is None:
            return self._fallback.apply(layer, x, bias)
        return self._run(layer, x, bias, False)

    def apply_float32(self, layer, x, bias=None):
        if layer.tiled_weight is None:
            return self._fallback.apply_float32(layer, x, bias)
        return self._run(layer, x, bias, True)


class AMXBF16LinearMethod(_TiledBF16LinearMethod):
    """bf16 linear on AMX tiles (TDPBF16PS), ``csrc/amx_linear.cpp``."""

    name = "AMX bf16 (C++)"
    _kernel = "amx_bf16_linear"


class AVX512BF16LinearMethod(_TiledBF16LinearMethod):
    """bf16 linear with VDPBF16PS (AVX512-BF16, no AMX), ``csrc/bf16_linear_avx512.cpp``."""

    name = "AVX512-BF16 (C++)"
    _kernel = "avx512_bf16_linear"


def avx512_bf16_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether ``AVX512BF16LinearMethod`` runs for ``device``/``dtype``. Never raises."""
    if dtype != torch.bfloat16 or torch.device(device).type != "cpu" or not envs.avx512_bf16_enabled():
        return False
    ops = cpu_kernels_for(device, torch.float32)
    return ops is not None and hasattr(ops, "avx512_bf16_available") and ops.avx512_bf16_available()


def bf16_kernel_name(device: torch.device | str) -> str | None:
    """The bf16 kernel ``get_linear_method`` would pick on ``device``, or None."""
    if amx_bf16_available(device, torch.bfloat16):
        return AMXBF16LinearMethod.name
    if avx512_bf16_available(device, torch.bfloat16):
        return AVX512BF16LinearMethod.name
    return None


def get_linear_method(device: torch.device | str, dtype: torch.dtype) -> LinearMethod:
    """The method for every linear on ``device``/``dtype``: AMX bf16, AVX512-BF16, oneDNN-packed,
    else ``F.linear``."""
    if amx_bf16_available(device, dtype):
        return AMXBF16LinearMethod()
    if avx512_bf16_available(device, dtype):
        return AVX512BF16LinearMethod()
    return _dense_linear_method(device, dtype)


def _dense_linear_method(device: torch.device | str, dtype: torch.dtype) -> LinearMethod:
    if onednn_packing_available(device, dtype):
        return OneDNNPackedLinearMethod()
    return UnquantizedLinearMethod()


class _WrappingLinearMethod(LinearMethod):
    """Computes through ``inner``, whose weights it uses."""

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
        """``fn(layer, x, bias)`` with the wrapper's calls."""


class RowChunkedLinearMethod(_WrappingLinearMethod):
    """``inner`` called with exactly ``chunk_rows`` rows per call (last chunk zero-padded), so
    rows do not depend on the batch (vLLM's batch-invariant mode). Raises ValueError if chunk_rows < 1."""

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
    """``inner`` with calls under ``min_rows`` rows zero-padded to ``min_rows``; bigger calls
    whole. Raises ValueError if min_rows < 2."""

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
    """(GFLOP/s, method name) of a [rows, in] x [out, in]^T linear as the engine runs it,
    best of ``reps``; out capped to ``max_weight_elements`` weights."""
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
    """y = x @ W.T (+ b): W [sum(output_sizes), input_size] in ``params_dtype``, fused parts
    stacked in order; ``linear_method`` defaults to ``quant_config``'s, else ``get_linear_method``.
    Sizes are this tensor-parallel rank's (``tp_rank`` of ``tp_size``): subclasses split the
    model's and their weight loaders narrow each whole checkpoint tensor to this rank's part."""

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
        """("linear", the method's name for this layer, the layer's short name)."""
        return ("linear", self.linear_method.layer_name(self), self.prefix.rpartition(".")[2] or "linear")

    def _param_name(self, param: nn.Parameter) -> str:
        return f"{self.prefix}.{'bias' if param is self.bias else 'weight'}"

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        """Copy a checkpoint tensor in whole. Raises ValueError on a shape mismatch."""
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
    """A plain linear layer: input_size → output_size."""

    def __init__(self, input_size: int, output_size: int, bias: bool, params_dtype: torch.dtype,
                 device: torch.device, linear_method: LinearMethod | None = None, prefix: str = "",
                 quant_config=None):
        super().__init__(input_size, [output_size], bias, params_dtype, device, linear_method, prefix,
                         quant_config)


class RowParallelLinear(LinearBase):
    """Input features split over the tensor-parallel ranks (o_proj, down_proj; Megatron-LM's
    row-parallel layer): partial outputs summed by an all-reduce, the bias added once.
    ``reduce_results=False`` leaves the sum to the caller (``FusedMoE``; bias on rank 0).
    Raises InvalidParameterError("tensor_parallel_size") when the split is uneven or cuts
    the method's blocks (``LinearMethod.input_shard_multiple``)."""

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
        """Copy this rank's input features of the weight (the whole bias). Raises ValueError on a shape mismatch."""
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
    """Linears over one input, outputs concatenated (gate|up), each part's (whole) output
    size split over the tensor-parallel ranks; ``shard_id`` is the part index."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, params_dtype: torch.dtype,
                 device: torch.device, linear_method: LinearMethod | None = None, prefix: str = "",
                 quant_config=None):
        tp = get_tp_size()
        super().__init__(input_size, [divide(n, tp, f"{prefix or 'linear'} output features") for n in output_sizes],
                         bias, params_dtype, device, linear_method, prefix, quant_config)

    def weight_loader(self, param, loaded_weight, shard_id=None):
        """Copy this rank's rows of part ``shard_id``. Raises ValueError on a shape mismatch."""
        n = self.output_sizes[shard_id]
        self._load_shard(param, loaded_weight, shard_id, shard_id, (self.tp_rank * n, n, n * self.tp_size))


class QKVParallelLinear(LinearBase):
    """Fused q|k|v: hidden_size → (num_heads + 2 * num_kv_heads) * head_dim of this rank
    (query heads split; KV heads split or replicated, ``distributed.kv_head_shard``);
    shards "q", "k", "v". ``num_heads``, ``num_kv_heads``, ``q_size``, ``kv_size``: this rank's."""

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
        """Copy this rank's heads of projection ``shard_id``. Raises ValueError on a shape mismatch."""
        if shard_id == "q":
            rows = (self.tp_rank * self.q_size, self.q_size, self.q_size * self.tp_size)
        else:
            rows = (self.kv_head_start * self.head_dim, self.kv_size, self.total_num_kv_heads * self.head_dim)
        self._load_shard(param, loaded_weight, self._SHARDS[shard_id], shard_id, rows)
