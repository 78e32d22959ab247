"""int8 W8A8: int8 weights with per-output-channel scales, int8 activations with per-token
scales, multiplied in integers (``Int8W8A8LinearMethod``).

The maths (symmetric quantization: the zero point below only offsets the activations into
uint8 storage; as in LLM.int8()'s vector-wise quantization without its outlier split,
Dettmers et al. 2022, and SmoothQuant's per-token/per-channel W8A8 without its smoothing,
Xiao et al. 2023):

- weights, once at load: ``w_scale[n] = amax_k |W[n, k]| / wmax`` and
  ``Wq[n, k] = round(W[n, k] / w_scale[n])`` in [-wmax, wmax] (round half to even; a zero
  row gets scale 0 and zeros), wmax = 127 (8 bits) or 63 (7 bits, below);
- activations, every call, per row m: ``s[m] = amax_k |x[m, k]| / qmax`` and
  ``xq[m, k] = clamp(round(x[m, k] * inv[m]), -qmax, qmax)`` with
  ``inv[m] = qmax / amax_k |x[m, k]|`` (0 for a zero row), qmax = 127 (or 63: 7 bits);
- the activations are stored as uint8 ``u[m, k] = xq[m, k] + zp`` (zp = qmax + 1), and
  ``sum_k xq[m, k] * Wq[n, k] = acc[m, n] - comp[n]`` with ``acc = sum_k u[m, k] * Wq[n, k]``
  summed exactly in integers and ``comp[n] = zp * sum_k Wq[n, k]``; in float32
  ``y[m, n] = (((float(acc[m, n]) - comp[n]) * w_scale[n]) * s[m]) + bias[n]``, rounded
  to x's dtype. ``float(acc)`` is exact while |acc| < 2**24 (always for K <= 1044 with
  7-bit weights, K <= 518 with 8-bit ones), else rounded to nearest even once, which
  moves a result by at most ~1e-7 of |acc| (far below the quantization error).

oneDNN computes ``float(acc)`` (``torch.ops.onednn.qlinear_pointwise``, the int8 matmul
torch's PT2E quantization emits on the CPU; AMX-INT8 or AVX512-VNNI where present, AVX2
otherwise) with activation scale 1 and zero point 0: it takes a single activation scale
per tensor, so the per-row scales are applied after it, by the epilogue, and the zero
point is too (``comp``, from the weights at load: given the zero point, oneDNN recomputes
that correction from the weights every call; measured on the AVX2 machine, 576 -> 960 at
1 row 119 us instead of 76, at 64 rows ~10 % longer). The C++ kernels (``csrc/quant_act.cpp``) quantize
the activations and run the epilogue in one pass each; ``quantize_per_token_ref`` and
``epilogue_ref`` are their torch twins, bit for bit.

Weight range. On CPUs without VNNI or AMX, oneDNN's u8 x s8 kernel multiplies with
``vpmaddubsw``, which adds adjacent pairs of products into int16 with saturation: with
8-bit activations (u8 up to 255) and weights of 127, 2 x 255 x 127 = 64770 > 32767, and
results were wrong (measured on the project's AVX2 AMD EPYC: off by up to 1.5e6 on
adversarial inputs, by ~4e4 on random ones). One operand must lose a bit: 7-bit weights
(|Wq| <= 63: 2 x 255 x 63 = 32130) or 7-bit activations (u8 <= 127: 2 x 127 x 127 = 32258)
make every sum exact. Weights lose less: measured on SmolLM2-135M's prefill activations
(4 prompts, relative error of each layer's output against float64, mean over layers)
qkv_proj 3.2 % at W8A8, 3.4 % with 7-bit weights, 6.2 % with 7-bit activations;
gate_up_proj 2.3 / 2.6 / 4.3 %; down_proj 3.1 / 3.4 / 5.6 %; o_proj 1.6 / 2.2 / 2.9 %
(per-token scales are set by outlier channels, 15-35x the mean |x|, so activation
steps are coarse already; weights are smoother). Which widths this CPU computes exactly
is found by a probe at first use (``onednn_exact_bits``), not from a list of CPU flags:
8 and 8 where VNNI's ``vpdpbusd`` or AMX accumulate in int32, else 7-bit weights.

AMX. On a CPU with AMX-INT8 (the Intel Xeon) the project's own kernel computes
``float(acc)`` instead (``amx_u8s8_matmul``, ``kernels/csrc/amx_linear.cpp``: TDPBUSD
tiles, int32 sums, exact at 8 and 8 bits): the same values as oneDNN's, without the
oneDNN primitive torch builds on every ``qlinear_pointwise`` call.

AVX2. On a CPU without AMX-INT8 or VNNI (the project's AMD EPYC: AVX2 only) the project's
AVX2 kernel (``avx2_int8_linear``, ``kernels/csrc/int8_linear_avx2.cpp``) computes the
sums and fuses the epilogue: the same values as the torch reference's, without oneDNN's
per-call primitive. By default it takes 7-bit weights, as oneDNN must here, and multiplies
the uint8 activations directly (1.1-1.5x oneDNN's u8s8 at 64-2048 rows, ~6x at one row);
with ``weight_bits=8`` it keeps all 8 bits through the sign trick of ggml's q8_0 dot (|w|
times q with w's sign, each pair at most 2 x 127 x 127: no saturation), one operation a
pair more (0.8-1.0x oneDNN's speed). ``PAGEDLLM_AVX2_INT8=0`` sends the method back to
oneDNN. Where VNNI is present, oneDNN (``vpdpbusd``) stays the default.

Elsewhere (CUDA, a torch without oneDNN, ``PAGEDLLM_ONEDNN=0``, or a CPU where no width is
exact) ``int8_matmul_ref`` computes the same ``float(acc)`` with float32 matmuls of
integer-valued tensors in K-chunks small enough to be exact, at 8 and 8 bits.

Batch invariance: the integer sums are exact whatever blocking or reduction split the
matmul picks for a given row count (rounded to float32 only once complete), and the rest
is per row and per element, so every output row is bitwise independent of the batch
(``tests/layers/test_int8_linear.py`` checks it).
"""
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
    """Symmetric per-output-channel int8 quantization of a linear weight.

    Args:
        weight: [N, K], any float dtype, any device.
        qmax: largest |q|, 1..127 (127: 8 bits, 63: 7 bits).

    Returns:
        (qweight int8 [N, K] in [-qmax, qmax], scale float32 [N]) with
        ``scale[n] = max_k |weight[n, k]| / qmax`` and ``qweight = round(weight / scale)``,
        rounding half to even (``torch.round``); a row of zeros gets scale 0 and zeros.

    Raises:
        ValueError: ``weight`` is not a 2-D float tensor, or ``qmax`` is out of range.
    """
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
    """Per-row (per-token) symmetric int8 quantization in torch ops: the reference for the
    C++ ``quantize_per_token`` (same bits on the CPU) and the path elsewhere.

    Per row m, in float32: ``amax = max_k |x[m, k]|``, ``scale[m] = amax / qmax``,
    ``inv = qmax / amax`` (0 when not finite: a zero row), ``q = clamp(round(x * inv),
    -qmax, qmax)`` rounding half to even, stored as ``q + zero_point``. Each step is one
    IEEE operation (true divisions of tensors: torch turns ``scalar / tensor`` into a
    reciprocal and a multiply, which would round twice). A row holding inf or NaN gets a
    non-finite scale; its stored values are then unspecified.

    Args:
        x: [M, K] float32/bfloat16/float16, any device.
        qmax: largest |q|, 1..127; zero_point: qmax..255-qmax.

    Returns:
        (uint8 [M, K] = q + zero_point, float32 scales [M]).

    Raises:
        ValueError: x not 2-D, or qmax/zero_point out of range (named).
    """
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
    """``quantize_per_token_ref(x if smooth is None else x * smooth, ...)``'s result, by the
    C++ kernel where it serves x (CPU float32 or bfloat16, kernels built; the product
    rounded to x's dtype in the kernel, as torch's ``x * smooth`` rounds it, without the
    [M, K] tensor), else by the torch ops. ``smooth``: [K] in x's dtype. Same returns and
    errors as ``quantize_per_token_ref``."""
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
    """The dequantizing epilogue in torch ops (the reference for the C++ ``int8_epilogue``,
    same bits): ``(((acc - compensation[n]) * weight_scale[n]) * row_scale[m]) + bias[n]``
    in float32, one rounding per operation, then rounded to ``out_dtype``.

    Args:
        acc: float32 [M, N], the integer sums of the uint8 activations; compensation:
            float32 [N], the zero point times each weight row's sum; weight_scale: float32
            [N]; row_scale: float32 [M]; bias: [N] (any float dtype, used as float32) or None.

    Returns:
        [M, N] in ``out_dtype``.
    """
    y = acc - compensation
    y = y * weight_scale
    y = y * row_scale[:, None]
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def weight_compensation(qweight: torch.Tensor, zero_point: int) -> torch.Tensor:
    """``zero_point * sum_k qweight[n, k]`` as float32 [N] (exact integers, rounded to
    float32 only past 2**24): what the uint8 activations' offset adds to each output column.

    Args:
        qweight: int8 [N, K]; zero_point: the activations' offset (0..255).
    """
    return (qweight.to(torch.int64).sum(dim=1) * zero_point).to(torch.float64).to(torch.float32)


def int8_matmul_ref(xq: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    """``float32(sum_k xq[m, k] * qweight[n, k])``, the sums exact, rounded once to nearest
    even (where past 2**24): the same values as oneDNN's ``qlinear_pointwise``, on any device.

    Computed with float32 matmuls of integer-valued tensors over K-chunks of
    ``REF_CHUNK_K`` (each chunk's partial sums are integers below 2**24 in magnitude, so
    exact whatever order or blocking the BLAS uses, TF32 included: |values| <= 255 fit its
    mantissa), the chunks added in float64 (exact below 2**53).

    Args:
        xq: uint8 [M, K]; qweight: int8 [N, K].

    Returns:
        float32 [M, N].
    """
    x = xq.to(torch.float32)
    acc = None
    for k0 in range(0, max(x.shape[1], 1), REF_CHUNK_K):
        part = x[:, k0:k0 + REF_CHUNK_K] @ qweight[:, k0:k0 + REF_CHUNK_K].to(torch.float32).t()
        acc = part.double() if acc is None else acc + part.double()
    return acc.float()


def _qlinear(xq: torch.Tensor, packed: torch.Tensor, ones: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """oneDNN's u8 x s8 matmul of uint8 [M, K] activations (scale 1, zero point 0) with a
    ``qlinear_prepack``-ed int8 weight (scales ``ones``, zero points ``zeros``): float32
    [M, N], each the row's integer sum converted to float32 (round to nearest even)."""
    return torch.ops.onednn.qlinear_pointwise(xq, 1.0, 0, packed, ones, zeros, None, 1.0, 0,
                                              torch.float32, "none", [None], "")


@functools.lru_cache(maxsize=None)
def onednn_exact(weight_bits: int, act_bits: int) -> bool:
    """Whether oneDNN's qlinear gives exact integer sums with ``weight_bits``-bit weights and
    ``act_bits``-bit activations on this CPU: weights of +-wmax and activations of +-qmax
    with matching signs (every adjacent pair of products at its largest), all-positive
    rows, and random ones, at 1, 5 and 64 rows (oneDNN may pick other kernels for few
    rows), called as ``apply`` calls it (uint8 ``xq + zero_point``, oneDNN zero point 0).
    About a millisecond; cached per process. Raises what oneDNN raises (no mkldnn build,
    an ISA it rejects)."""
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
    """(weight bits, activation bits): the first of ``ONEDNN_BITS_ORDER`` at which oneDNN's
    u8 x s8 int8 matmul is exact on this CPU (``onednn_exact``), found once per process:
    (8, 8) where the CPU accumulates int8 products in int32 (AVX512-VNNI, AVX-VNNI,
    AMX-INT8), (7, 8) where it saturates int16 pair sums (AVX2, AVX-512 without VNNI).
    None when oneDNN's int8 ops are missing or raise, or no width is exact. Never raises."""
    try:
        return next((bits for bits in ONEDNN_BITS_ORDER if onednn_exact(*bits)), None)
    except Exception as e:   # no mkldnn build, no onednn ops, an ISA oneDNN rejects
        logger.info("oneDNN int8 matmul unavailable (%s)", " ".join(str(e).split()))
        return None


def onednn_int8_available(device: torch.device | str) -> bool:
    """Whether ``Int8W8A8LinearMethod`` on ``device`` multiplies through oneDNN: CPU, torch
    built with mkldnn, ``PAGEDLLM_ONEDNN`` not 0, and exact at some widths
    (``onednn_exact_bits``). Never raises."""
    return (torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()
            and envs.onednn_enabled() and onednn_exact_bits() is not None)


def amx_int8_available(device: torch.device | str) -> bool:
    """Whether ``Int8W8A8LinearMethod`` on ``device`` multiplies through the project's AMX-INT8
    kernels (``amx_int8_linear``, ``kernels/csrc/amx_linear.cpp``):
    ``linear.amx_ops(device, "amx_int8_available")``. Never raises."""
    return amx_ops(device, "amx_int8_available") is not None


def avx2_int8_available(device: torch.device | str) -> bool:
    """Whether ``Int8W8A8LinearMethod`` on ``device`` can multiply through the project's AVX2
    kernel (``avx2_int8_linear``, ``kernels/csrc/int8_linear_avx2.cpp``): the CPU, the C++
    kernels built with AVX2 and FMA, and ``PAGEDLLM_AVX2_INT8`` not 0. Never raises."""
    if torch.device(device).type != "cpu" or not envs.avx2_int8_enabled():
        return False
    ops = kernels_for(torch.device(device), torch.float32)
    return ops is not None and hasattr(ops, "avx2_int8_available") and bool(ops.avx2_int8_available())


def avx2_int8_fits(in_features: int) -> bool:
    """Whether the AVX2 kernel's layout holds a weight with ``in_features`` inputs (groups
    of 4; any number of outputs)."""
    return in_features % 4 == 0


def pack_int8_avx2(qweight: torch.Tensor) -> torch.Tensor:
    """An int8 weight [N, K] (K % 4 == 0) in the AVX2 kernel's layout,
    [ceil(N/16), K/4, 16, 4]: element [t, g, j, i] = qweight[16 t + j, 4 g + i], zero for
    rows past N (``kernels/csrc/int8_linear_avx2.cpp``).

    Raises:
        ValueError: not a 2-D int8 tensor, or K not a multiple of 4.
    """
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
    """int8 weights (per-output-channel scales, quantized at load from the float checkpoint
    weights) times dynamically quantized per-token int8 activations; see the module
    docstring for the maths and the widths.

    ``create_weights`` registers the float ``layer.weight`` as the dense method does, so
    every layer's ``weight_loader`` (fused q|k|v, gate|up) fills it unchanged;
    ``process_weights_after_loading`` quantizes it (each fused part keeps its own rows'
    scales, since scales are per output row) and releases it (``layer.weight`` becomes an
    empty placeholder of its dtype, unless ``layer.keep_dense_weight``, as for a tied LM
    head). It sets on the layer:

    - ``int8_weight_scale``: float32 [N]; ``int8_compensation``: float32 [N]
      (``weight_compensation``);
    - ``int8_backend``: "amx", "avx2", "onednn" or "torch", the layer's own (``backend``, or
      ``fallback_backend`` for a shape AMX's tiles cannot hold);
    - AMX: ``int8_amx_weight`` (``linear.pack_amx_tiles`` in int8);
    - AVX2: ``int8_avx2_weight`` (``pack_int8_avx2``) and ``int8_colsum`` int32 [N]
      (each weight row's sum);
    - oneDNN: ``int8_packed_weight`` (``qlinear_prepack``'s opaque tensor),
      ``int8_ones`` float32 [N] and ``int8_zero_points`` int64 [N] (what qlinear takes);
    - otherwise: ``int8_weight``, int8 [N, K].

    ``apply`` takes x [T, in] (float32 or bfloat16; float16 through the torch ops) and
    returns [T, out] in x's dtype.

    Args:
        device: where the layers' weights live; picks the backend once: the AMX-INT8 kernel
            where ``amx_int8_available``, else the AVX2 kernel where ``avx2_int8_available``
            and oneDNN is not exact at 8 and 8 bits (no VNNI), else oneDNN on the CPU where
            ``onednn_int8_available``, else the torch ops.
        weight_bits, act_bits: 8 or 7 each; None: the backend's most accurate exact
            choice (oneDNN: ``onednn_exact_bits()``; torch: 8 and 8).
        backend: "amx", "avx2", "onednn" or "torch" to choose instead of by ``device``.
        smooth_alpha: SmoothQuant's migration strength (``smoothquant.py``), or None for
            none. With it the method ``needs_calibration``: ``models.loader.build_model``
            sets ``layer.int8_act_amax`` (``calibrate_input_amax``) before
            ``process_weights_after_loading``, which then multiplies the weight by the
            smoothing factors s before quantizing it and keeps ``layer.int8_smooth``
            (1 / s, [in], the layer's dtype), by which ``apply`` multiplies x. A layer
            without maxima is not smoothed.

    Raises:
        ValueError: bits not 7, 8 or None; smooth_alpha outside [0, 1]; ``backend`` unknown, "onednn" where
            ``onednn_int8_available(device)`` is false, "amx" where ``amx_int8_available`` is false, "avx2"
            where ``avx2_int8_available`` is false; widths at which oneDNN's sums
            are not exact on this CPU (e.g. 8 and 8 without VNNI or AMX).

    Attributes:
        backend: "amx", "avx2", "onednn" or "torch"; fallback_backend: for layers the AMX
            or AVX2 kernel's layout cannot hold: "onednn" where it is available and exact
            at these widths, else "avx2" under AMX where that kernel runs (a layer whose
            K is not a multiple of 4 then takes the torch ops), else "torch".
        weight_bits, act_bits: the widths; weight_qmax: largest |Wq|; qmax, zero_point:
            the activations' range (``ACT_RANGES``).
        name: e.g. "int8 W8A8 (oneDNN u8s8, 7-bit weights)".
    """

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
            elif avx2_int8_available(device) and (not available or onednn_exact_bits() != (8, 8)):
                # no VNNI or AMX: oneDNN's AVX2 path saturates at 8 and 8 bits, this kernel does not
                backend = "avx2"
        # where the kernel's layout cannot hold a layer's shape (AMX: N % 16, K % 64; AVX2:
        # K % 4), it computes thus
        self.fallback_backend = "onednn" if available else "torch"
        self.backend = backend or self.fallback_backend
        if self.backend in ("amx", "avx2"):          # int32 sums: exact at 8 and 8
            # AVX2: 7-bit weights by default, multiplied without the sign trick (1.1-1.5x
            # oneDNN's u8s8 at 64-2048 rows against 0.8-1.0x at 8 bits: docs/benchmarks.md)
            weight_bits = weight_bits or (7 if self.backend == "avx2" else 8)
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
        narrow = [f"{b}-bit {what}" for b, what in ((self.weight_bits, "weights"), (self.act_bits, "activations"))
                  if b != 8]
        if smooth_alpha is not None and not 0.0 <= smooth_alpha <= 1.0:
            raise ValueError(f"smooth_alpha must be in [0, 1] or None, got {smooth_alpha!r}")
        self.smooth_alpha = smooth_alpha
        self.needs_calibration = smooth_alpha is not None
        smooth = [] if smooth_alpha is None else [f"SmoothQuant alpha {smooth_alpha:g}"]
        self.name = f"int8 W8A8 ({', '.join([kernel, *narrow, *smooth])})"

    def layer_name(self, layer: nn.Module) -> str:
        """``name`` with the kernel of ``layer``'s own backend: the fallback's (e.g.
        "oneDNN u8s8") for a layer the AMX or AVX2 layout cannot hold."""
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
        """The ``kernels.StackLinear`` form of this layer where ``apply`` runs one of the
        project's kernels through the C++ quantizer: ``int8_avx2`` (the layer on the ``avx2``
        backend) or ``int8_amx`` (on ``amx``), over the same operands, in a dtype the
        kernels take, the smoothing row contiguous in that dtype; else None (oneDNN and
        the torch reference keep the per-layer path)."""
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
        """``apply`` with the epilogue's result in ``out_dtype`` (x's dtype or float32)."""
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
