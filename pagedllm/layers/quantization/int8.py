"""int8 W8A8 (``Int8W8A8LinearMethod``): int8 weights with per-output-channel scales, int8
activations with per-token scales, multiplied in integers (LLM.int8()'s vector-wise
quantization without the outlier split, Dettmers et al. 2022; SmoothQuant's W8A8, Xiao et al. 2023).

Activations are stored as uint8 ``u = xq + zp``; with ``acc = sum_k u[m, k] * Wq[n, k]``
(exact integers) and ``comp[n] = zp * sum_k Wq[n, k]``,
``y[m, n] = (((float(acc) - comp[n]) * w_scale[n]) * s[m]) + bias[n]`` in float32, rounded
to the output dtype. Integer sums make rows batch-invariant. Backends (AMX, AVX2, oneDNN,
torch): docs/cpu-kernels.md; maths, widths, measurements: docs/notes/layers-quantization-int8.md."""
from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from pagedllm import envs
from pagedllm.kernels.cpu import kernels_for, trace
from pagedllm.layers.linear import LinearMethod, amx_ops, amx_tiles_fit, pack_amx_tiles
from pagedllm.layers.quantization.smoothquant import smoothing_factors

logger = logging.getLogger("pagedllm")

# Weights: largest |Wq| for 8- and 7-bit weights (symmetric: no -128, so that negating a
# weight cannot overflow).
WEIGHT_QMAX = {8: 127, 7: 63}
# Activation ranges: (qmax, zero point) for 8-bit and 7-bit activations stored as uint8.
ACT_RANGES = {8: (127, 128), 7: (63, 64)}
# (weight bits, activation bits) the oneDNN backend tries, most accurate first.
ONEDNN_BITS_ORDER = ((8, 8), (7, 8), (8, 7))
# K-chunk of ``int8_matmul_ref``: 512 * 255 * 127 < 2**24, so float32 sums stay exact.
REF_CHUNK_K = 512


def quantize_weight_per_channel(weight: torch.Tensor, qmax: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel quantization of weight [N, K] (any float dtype):
    (int8 [N, K] in [-qmax, qmax], float32 scale [N] = amax / qmax), rounding half to even; a
    zero row gets scale 0. Raises ValueError for a non-2-D/non-float weight or qmax outside 1..127."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a 2-D float tensor, got {tuple(weight.shape)} {weight.dtype}")
    if not 1 <= qmax <= 127:
        raise ValueError(f"qmax must be in [1, 127], got {qmax}")
    w = weight.float()
    amax = w.abs().amax(dim=1) if w.shape[1] else w.new_zeros(w.shape[0])
    scale = torch.div(amax, torch.full_like(amax, qmax))
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / safe[:, None]).clamp_(-qmax, qmax).to(torch.int8)
    return q, scale


def _check_act_range(qmax: int, zero_point: int) -> None:
    if not 1 <= qmax <= 127:
        raise ValueError(f"qmax must be in [1, 127], got {qmax}")
    if not qmax <= zero_point <= 255 - qmax:
        raise ValueError(f"zero_point must be in [qmax, 255 - qmax] = [{qmax}, {255 - qmax}], got {zero_point}")


def quantize_per_token_ref(x: torch.Tensor, qmax: int, zero_point: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric quantization in torch ops (the C++ ``quantize_per_token``'s
    reference, same bits): x [M, K] float → (uint8 [M, K] = q + zero_point, float32 scales [M]),
    q = clamp(round(x * qmax / amax), -qmax, qmax), one IEEE rounding per step; a zero row gets
    0, a non-finite row unspecified values. Raises ValueError for x not 2-D or qmax (1..127) /
    zero_point (qmax..255-qmax) out of range."""
    _check_act_range(qmax, zero_point)
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    xf = x.float()
    amax = xf.abs().amax(dim=1) if xf.shape[1] else xf.new_zeros(xf.shape[0])
    qm = torch.full_like(amax, qmax)
    scale = torch.div(amax, qm)
    inv = torch.div(qm, amax)
    inv = torch.where(torch.isfinite(inv), inv, torch.zeros_like(inv))
    q = torch.round(xf * inv[:, None]).clamp_(-qmax, qmax).add_(zero_point)
    return q.nan_to_num_(0.0).to(torch.uint8), scale


def quantize_per_token(x: torch.Tensor, qmax: int, zero_point: int,
                       smooth: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_per_token_ref(x * smooth if smooth is given else x)`` by the C++ kernel where it
    serves x (smooth: [K] in x's dtype), else by the torch ops; same returns and errors."""
    ops = kernels_for(x.device, x.dtype)
    if (ops is None or x.dim() != 2 or x.stride(-1) != 1
            or (smooth is not None and (smooth.dtype != x.dtype or not smooth.is_contiguous()))):
        return quantize_per_token_ref(x if smooth is None else x * smooth, qmax, zero_point)
    _check_act_range(qmax, zero_point)
    out = torch.empty(x.shape, dtype=torch.uint8)
    scales = torch.empty(x.shape[0], dtype=torch.float32)
    with trace("pagedllm::quantize_per_token"):
        ops.quantize_per_token(out, scales, x, qmax, zero_point, smooth)
    return out, scales


def epilogue_ref(acc: torch.Tensor, compensation: torch.Tensor, weight_scale: torch.Tensor,
                 row_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """Torch reference of the C++ ``int8_epilogue`` (same bits): ``(((acc - compensation) *
    weight_scale) * row_scale[:, None]) + bias`` in float32, then ``out_dtype``. acc float32
    [M, N]; compensation, weight_scale float32 [N]; row_scale float32 [M]; bias [N] or None."""
    y = acc - compensation
    y = y * weight_scale
    y = y * row_scale[:, None]
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def weight_compensation(qweight: torch.Tensor, zero_point: int) -> torch.Tensor:
    """``zero_point * sum_k qweight[n, k]`` as float32 [N] for int8 qweight [N, K]."""
    return (qweight.to(torch.int64).sum(dim=1) * zero_point).to(torch.float64).to(torch.float32)


def int8_matmul_ref(xq: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    """``float32(sum_k xq[m, k] * qweight[n, k])`` for uint8 xq [M, K] and int8 qweight [N, K]
    → float32 [M, N], the sums exact (float32 matmuls over ``REF_CHUNK_K`` chunks, added in
    float64), as oneDNN's ``qlinear_pointwise``; any device."""
    x = xq.to(torch.float32)
    acc = None
    for k0 in range(0, max(x.shape[1], 1), REF_CHUNK_K):
        part = x[:, k0:k0 + REF_CHUNK_K] @ qweight[:, k0:k0 + REF_CHUNK_K].to(torch.float32).t()
        acc = part.double() if acc is None else acc + part.double()
    return acc.float()


def _qlinear(xq: torch.Tensor, packed: torch.Tensor, ones: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """oneDNN's u8 x s8 matmul (scale 1, zero point 0) of uint8 [M, K] with a prepacked weight
    → float32 [M, N]."""
    return torch.ops.onednn.qlinear_pointwise(xq, 1.0, 0, packed, ones, zeros, None, 1.0, 0,
                                              torch.float32, "none", [None], "")


@functools.lru_cache(maxsize=None)
def onednn_exact(weight_bits: int, act_bits: int) -> bool:
    """Whether oneDNN's qlinear sums exactly on this CPU at these widths (cached probe with
    worst-case and random inputs at 1, 5 and 64 rows). Raises what oneDNN raises."""
    wmax, (qmax, zp) = WEIGHT_QMAX[weight_bits], ACT_RANGES[act_bits]
    g = torch.Generator().manual_seed(0)
    K, N = 256, 40
    w = torch.where(torch.rand(N, K, generator=g) < 0.5, -wmax, wmax).to(torch.int8)
    w[0] = wmax
    packed = torch.ops.onednn.qlinear_prepack(w, None)
    ones, zeros = torch.ones(N), torch.zeros(N, dtype=torch.int64)
    for m in (1, 5, 64):
        x = torch.randint(-qmax, qmax + 1, (m, K), generator=g)
        x[0] = torch.where(w[m % N] > 0, qmax, -qmax)    # aligned with a weight row's signs
        if m > 1:
            x[1] = qmax
        u = x + zp
        got = _qlinear(u.to(torch.uint8), packed, ones, zeros)
        want = (u @ w.long().t()).float()    # |sums| <= 256 * 255 * 127 < 2**24: exact
        if not torch.equal(got, want):
            return False
    return True


@functools.lru_cache(maxsize=1)
def onednn_exact_bits() -> tuple[int, int] | None:
    """The first (weight bits, activation bits) of ``ONEDNN_BITS_ORDER`` at which oneDNN is
    exact here (cached), or None. Never raises."""
    try:
        return next((bits for bits in ONEDNN_BITS_ORDER if onednn_exact(*bits)), None)
    except Exception as e:   # no mkldnn build, no onednn ops, an ISA oneDNN rejects
        logger.info("oneDNN int8 matmul unavailable (%s)", " ".join(str(e).split()))
        return None


def onednn_int8_available(device: torch.device | str) -> bool:
    """Whether int8 can go through oneDNN on ``device`` (CPU, mkldnn, ``PAGEDLLM_ONEDNN``
    on, some width exact). Never raises."""
    return (torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()
            and envs.onednn_enabled() and onednn_exact_bits() is not None)


def amx_int8_available(device: torch.device | str) -> bool:
    """Whether the AMX-INT8 kernels (``csrc/amx_linear.cpp``) run on ``device``. Never raises."""
    return amx_ops(device, "amx_int8_available") is not None


def avx2_int8_available(device: torch.device | str) -> bool:
    """Whether the AVX2 int8 kernel (``csrc/int8_linear_avx2.cpp``) runs on ``device``
    (``PAGEDLLM_AVX2_INT8`` on). Never raises."""
    if torch.device(device).type != "cpu" or not envs.avx2_int8_enabled():
        return False
    ops = kernels_for(torch.device(device), torch.float32)
    return ops is not None and hasattr(ops, "avx2_int8_available") and bool(ops.avx2_int8_available())


def avx2_int8_vnni(device: torch.device | str) -> bool:
    """Whether the AVX2 int8 kernel runs on ``device`` with AVX512-VNNI sums (8-bit weights
    as fast as 7-bit ones). Never raises."""
    return avx2_int8_available(device) and bool(kernels_for(torch.device(device), torch.float32).avx2_int8_vnni())


def avx2_int8_fits(in_features: int) -> bool:
    """Whether the AVX2 kernel's layout holds ``in_features`` (a multiple of 4)."""
    return in_features % 4 == 0


def pack_int8_avx2(qweight: torch.Tensor) -> torch.Tensor:
    """int8 weight [N, K] in the AVX2 kernel's layout [ceil(N/16), K/4, 16, 4]: element
    [t, g, j, i] = qweight[16 t + j, 4 g + i], zero past N. Raises ValueError for a non-2-D or
    non-int8 tensor or K % 4 != 0."""
    if qweight.dim() != 2 or qweight.dtype != torch.int8:
        raise ValueError(f"qweight must be a 2-D int8 tensor, got {tuple(qweight.shape)} {qweight.dtype}")
    n, k = qweight.shape
    if not avx2_int8_fits(k):
        raise ValueError(f"pack_int8_avx2 needs K % 4 == 0, got a [{n}, {k}] weight")
    tiles = -(-n // 16)
    w = torch.zeros(tiles * 16, k, dtype=torch.int8)
    w[:n] = qweight
    return w.reshape(tiles, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()


# how ``Int8W8A8LinearMethod.name`` calls each backend's kernel
INT8_KERNEL_LABELS = {"amx": "AMX u8s8", "avx2": "AVX2 u8s8", "onednn": "oneDNN u8s8", "torch": "torch reference"}


class Int8W8A8LinearMethod(LinearMethod):
    """int8 weights quantized at load from the float weight (loaded as the dense method's) times
    per-token int8 activations; ``apply``: x [T, in] → [T, out] in x's dtype. ``device`` picks
    the backend once (AMX, else the AVX2 kernel, else oneDNN, else torch) unless ``backend``
    names one; ``weight_bits``/``act_bits``: 7, 8 or None (most accurate exact widths);
    ``smooth_alpha``: SmoothQuant's alpha (then ``needs_calibration``) or None. After loading,
    the layer holds ``int8_weight_scale``, ``int8_compensation`` (float32 [N]), ``int8_backend``
    and that backend's packed weight; the dense weight is released unless ``keep_dense_weight``.

    Raises:
        ValueError: bits not 7/8/None; smooth_alpha outside [0, 1]; an unknown backend, or one
            not available on ``device``; widths at which oneDNN is not exact here."""

    def __init__(self, device: torch.device | str = "cpu", weight_bits: int | None = None,
                 act_bits: int | None = None, backend: str | None = None, smooth_alpha: float | None = None):
        for label, bits in (("weight_bits", weight_bits), ("act_bits", act_bits)):
            if bits not in (None, 7, 8):
                raise ValueError(f"{label} must be 7, 8 or None, got {bits!r}")
        if backend not in (None, "onednn", "torch", "amx", "avx2"):
            raise ValueError(f"backend must be 'amx', 'avx2', 'onednn', 'torch' or None, got {backend!r}")
        available = onednn_int8_available(device)
        if backend == "onednn" and not available:
            raise ValueError(f"backend='onednn': oneDNN's int8 matmul does not serve {device} here "
                             "(not the CPU, no mkldnn, PAGEDLLM_ONEDNN=0, or not exact)")
        if backend == "amx" and not amx_int8_available(device):
            raise ValueError(f"backend='amx': the AMX-INT8 kernel does not run on {device} here "
                             "(no AMX-INT8, PAGEDLLM_AMX=0, or no C++ kernels)")
        if backend == "avx2" and not avx2_int8_available(device):
            raise ValueError(f"backend='avx2': the AVX2 int8 kernel does not run on {device} here "
                             "(not an AVX2 CPU, PAGEDLLM_AVX2_INT8=0, or no C++ kernels)")
        if backend is None:
            if amx_int8_available(device):
                backend = "amx"
            elif avx2_int8_available(device) and (not available or onednn_exact_bits() != (8, 8)
                                                  or avx2_int8_vnni(device)):
                # without VNNI oneDNN's AVX2 path saturates at 8 and 8 bits, this kernel does
                # not; with AVX512-VNNI it sums as fast and runs inside the C++ decoder stack
                backend = "avx2"
        # where the kernel's layout cannot hold a layer's shape (AMX: N % 16, K % 64; AVX2:
        # K % 4), it computes thus
        self.fallback_backend = "onednn" if available else "torch"
        self.backend = backend or self.fallback_backend
        if self.backend in ("amx", "avx2"):          # int32 sums: exact at 8 and 8
            # AVX2: 7-bit weights by default, no sign trick (why: docs/notes/layers-quantization-int8.md)
            # (with VNNI 8-bit weights cost nothing more)
            weight_bits = weight_bits or (7 if self.backend == "avx2" and not avx2_int8_vnni(device) else 8)
            act_bits = act_bits or 8
            if available and not onednn_exact(weight_bits, act_bits):
                self.fallback_backend = "torch"
            if self.fallback_backend == "torch" and self.backend == "amx" and avx2_int8_available(device):
                # the AVX2 kernel multiplies exactly at any width too (8-bit weights by
                # its sign trick), far faster than the torch reference
                self.fallback_backend = "avx2"
        elif self.backend == "onednn":
            if weight_bits is None and act_bits is None:
                weight_bits, act_bits = onednn_exact_bits()
            else:
                weight_bits, act_bits = weight_bits or 8, act_bits or 8
                if not onednn_exact(weight_bits, act_bits):
                    raise ValueError(f"weight_bits={weight_bits}, act_bits={act_bits}: oneDNN's int8 "
                                     f"matmul is not exact at these widths on this CPU; "
                                     f"{onednn_exact_bits()} is")
        self.weight_bits, self.act_bits = weight_bits or 8, act_bits or 8
        self.weight_qmax = WEIGHT_QMAX[self.weight_bits]
        self.qmax, self.zero_point = ACT_RANGES[self.act_bits]
        kernel = INT8_KERNEL_LABELS[self.backend]
        if self.backend == "avx2" and avx2_int8_vnni(device):
            kernel += " with AVX512-VNNI"
        narrow = [f"{b}-bit {what}" for b, what in ((self.weight_bits, "weights"), (self.act_bits, "activations"))
                  if b != 8]
        if smooth_alpha is not None and not 0.0 <= smooth_alpha <= 1.0:
            raise ValueError(f"smooth_alpha must be in [0, 1] or None, got {smooth_alpha!r}")
        self.smooth_alpha = smooth_alpha
        self.needs_calibration = smooth_alpha is not None
        smooth = [] if smooth_alpha is None else [f"SmoothQuant alpha {smooth_alpha:g}"]
        self.name = f"int8 W8A8 ({', '.join([kernel, *narrow, *smooth])})"

    def layer_name(self, layer: nn.Module) -> str:
        """``name`` with the kernel of ``layer``'s own (maybe fallback) backend."""
        backend = getattr(layer, "int8_backend", self.backend)
        if backend == self.backend:
            return self.name
        return self.name.replace(INT8_KERNEL_LABELS[self.backend], INT8_KERNEL_LABELS[backend], 1)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight.data
        amax = getattr(layer, "int8_act_amax", None)
        if self.smooth_alpha is not None and amax is not None:
            # 1 / s in the activations' dtype, and the weight divided by that same value, so
            # x * inv times W / inv is the identity up to float rounding in every dtype
            inv = (1.0 / smoothing_factors(amax, w, self.smooth_alpha)).to(w.dtype)
            layer.int8_smooth = inv
            w = w.float() / inv.float()          # out of place: a tied LM head's table is the embedding's
        elif self.smooth_alpha is not None:
            self.name = self.name.replace(f"SmoothQuant alpha {self.smooth_alpha:g}",
                                          "SmoothQuant: not calibrated, not smoothed")
        q, scale = quantize_weight_per_channel(w, self.weight_qmax)
        layer.int8_weight_scale = scale
        layer.int8_compensation = weight_compensation(q, self.zero_point)
        backend = self.backend
        if ((backend == "amx" and not amx_tiles_fit(*q.shape, torch.int8))
                or (backend == "avx2" and not avx2_int8_fits(q.shape[1]))):
            backend = self.fallback_backend
            if backend == "avx2" and not avx2_int8_fits(q.shape[1]):
                backend = "torch"
        layer.int8_backend = backend
        if backend == "amx":
            layer.int8_amx_weight = pack_amx_tiles(q, torch.int8)
        elif backend == "avx2":
            layer.int8_avx2_weight = pack_int8_avx2(q)
            layer.int8_colsum = q.to(torch.int32).sum(dim=1, dtype=torch.int32)
        elif backend == "onednn":
            layer.int8_packed_weight = torch.ops.onednn.qlinear_prepack(q.contiguous(), None)
            layer.int8_ones = torch.ones_like(scale)
            layer.int8_zero_points = torch.zeros(scale.shape, dtype=torch.int64)
        else:
            layer.int8_weight = q
        if not getattr(layer, "keep_dense_weight", False):
            layer.weight.data = layer.weight.data.new_empty(0)

    def stack_linear(self, layer, kernels):
        """``kernels.StackLinear.int8_avx2`` / ``int8_amx`` for a layer on those backends, else None."""
        dtype = layer.weight.dtype
        smooth = getattr(layer, "int8_smooth", None)
        backend = getattr(layer, "int8_backend", None)
        if (backend not in ("avx2", "amx") or kernels_for(layer.weight.device, dtype) is None
                or (smooth is not None and (smooth.dtype != dtype or not smooth.is_contiguous()))):
            return None
        bias = None if layer.bias is None else layer.bias.float().contiguous()
        if backend == "amx":
            return kernels.StackLinear.int8_amx(layer.int8_amx_weight, layer.int8_compensation,
                                                layer.int8_weight_scale, smooth, self.qmax, self.zero_point, bias)
        return kernels.StackLinear.int8_avx2(layer.int8_avx2_weight, layer.int8_colsum, layer.int8_compensation,
                                             layer.int8_weight_scale, smooth, self.qmax, self.zero_point,
                                             self.weight_bits == 7, bias)

    def apply(self, layer, x, bias=None):
        return self._apply(layer, x, bias, x.dtype)

    def apply_float32(self, layer, x, bias=None):
        return self._apply(layer, x, bias, torch.float32)

    def _apply(self, layer, x, bias, out_dtype: torch.dtype):
        """``apply`` with the result in ``out_dtype``."""
        if x.dim() != 2:
            return self._apply(layer, x.reshape(-1, x.shape[-1]), bias, out_dtype).reshape(*x.shape[:-1], -1)
        scale = layer.int8_weight_scale
        if x.shape[0] == 0:
            return x.new_empty(0, scale.shape[0], dtype=out_dtype)
        smooth = getattr(layer, "int8_smooth", None)
        xq, row_scale = quantize_per_token(x, self.qmax, self.zero_point, smooth)
        ops = kernels_for(x.device, x.dtype)
        backend = layer.int8_backend
        comp = layer.int8_compensation
        if backend == "amx" and ops is not None:     # the matmul and the epilogue in one kernel
            with trace("pagedllm::amx_int8_linear"):
                return ops.amx_int8_linear(xq, layer.int8_amx_weight, comp, scale, row_scale,
                                           None if bias is None else bias.float(), out_dtype == torch.bfloat16)
        if backend == "avx2":     # the matmul and the epilogue in one kernel
            fused = ops or kernels_for(x.device, torch.float32)   # float16 x: float32 out, rounded below
            with trace("pagedllm::avx2_int8_linear"):
                out = fused.avx2_int8_linear(xq, layer.int8_avx2_weight, layer.int8_colsum, self.zero_point, comp,
                                             scale, row_scale, None if bias is None else bias.float(),
                                             out_dtype == torch.bfloat16, self.weight_bits == 7)
            return out if out.dtype == out_dtype else out.to(out_dtype)
        if backend == "amx":
            with trace("pagedllm::amx_u8s8_matmul"):
                acc = kernels_for(x.device, torch.float32).amx_u8s8_matmul(xq, layer.int8_amx_weight)
        elif backend == "onednn":
            acc = _qlinear(xq, layer.int8_packed_weight, layer.int8_ones, layer.int8_zero_points)
        else:
            acc = int8_matmul_ref(xq, layer.int8_weight)
        if ops is None:
            return epilogue_ref(acc, comp, scale, row_scale, bias, out_dtype)
        out = acc if out_dtype == torch.float32 else torch.empty(acc.shape, dtype=out_dtype)
        with trace("pagedllm::int8_epilogue"):
            ops.int8_epilogue(out, acc, comp, scale, row_scale, None if bias is None else bias.float())
        return out
