"""Linear layers and the tied LM head with weights in GGUF's block formats Q8_0, Q4_0 and
Q4_1, computed the way llama.cpp's CPU backend does: activations quantized per 32-element
block to int8, integer dot products per block, float scales per block.

Formats (ggml's ``ggml-common.h``; 32 weights per block along the input dimension K,
a weight row is ``K / 32`` consecutive blocks, so a packed [N, K] weight is uint8
[N, K / 32 * block_bytes]):

======  ====  =====  ==========================================  ===================
name    type  bytes  block                                       weight value
======  ====  =====  ==========================================  ===================
Q4_0    2     18     fp16 d, 16 bytes of nibbles                 d * (q - 8)
Q4_1    3     20     fp16 d, fp16 m, 16 bytes of nibbles         d * q + m
Q8_0    8     34     fp16 d, 32 int8                             d * q
======  ====  =====  ==========================================  ===================

In the nibble formats byte j holds element j in its low nibble and element j + 16 in its
high nibble (checked against ``gguf.quants.dequantize`` in the tests).

The product (``block_quant_linear_ref`` in torch, ``block_quant_linear`` in
``kernels/csrc/block_quant.cpp``, which documents the same steps):

1. each 32-element block of an activation row x: ``d_x = max|x_i| * (1/127)`` (float32),
   ``q_i = round_half_even(x_i * (1/d_x))`` clamped to [-127, 127] (0 when d_x = 0),
   ``S = sum q_i`` and ``s_x = d_x * S``;
2. per output column and block the exact integer dot ``I = sum_i qw_i * q_i`` (Q4_0:
   ``qw_i - 8``);
3. ``acc = fma(d_w * d_x, I, acc)`` over the blocks in order from 0; Q4_1 also sums
   ``accm = fma(m_w, s_x, accm)`` apart and adds it after the last block; then ``+ bias``,
   stored in x's dtype.

Each output row depends only on its own input row, in a reduction order fixed by K:
rows are batch-invariant. The error against the float product is that of the 8-bit
activations (relative ~0.5/127 per element, averaging out over K) on top of the weights'.
"""
from __future__ import annotations

from dataclasses import dataclass

import gguf
import torch
from torch import nn

from pagedllm.kernels.cpu import kernels_for, trace
from pagedllm.layers.linear import LinearMethod

BLOCK_SIZE = 32
# float32 1/127: d_x = amax * INV127 in torch and in C++ (both one float32 multiply)
INV127 = torch.tensor(1.0 / 127.0, dtype=torch.float32).item()


@dataclass(frozen=True)
class BlockFormat:
    """One GGUF block format.

    Attributes:
        name: "Q8_0", "Q4_0" or "Q4_1".
        ggml_type: its ``gguf.GGMLQuantizationType`` (int value = the kernel's ``fmt``).
        block_bytes: bytes per block of ``block_size`` weights.
        block_size: weights per block (32).
    """

    name: str
    ggml_type: gguf.GGMLQuantizationType
    block_bytes: int
    block_size: int = BLOCK_SIZE

    def row_bytes(self, k: int) -> int:
        """Bytes of one packed row of ``k`` weights (``k`` a multiple of 32; else ValueError)."""
        check_k(k, self.name)
        return k // self.block_size * self.block_bytes


FORMATS: dict[str, BlockFormat] = {
    "Q4_0": BlockFormat("Q4_0", gguf.GGMLQuantizationType.Q4_0, 18),
    "Q4_1": BlockFormat("Q4_1", gguf.GGMLQuantizationType.Q4_1, 20),
    "Q8_0": BlockFormat("Q8_0", gguf.GGMLQuantizationType.Q8_0, 34),
}


def block_format(fmt: "str | int | BlockFormat | gguf.GGMLQuantizationType") -> BlockFormat:
    """The ``BlockFormat`` for a name ("Q4_1"), a ggml type (enum or int) or a format.

    Raises:
        ValueError: ``fmt`` is none of Q8_0, Q4_0, Q4_1.
    """
    if isinstance(fmt, BlockFormat):
        return fmt
    for f in FORMATS.values():
        if fmt == f.name or (not isinstance(fmt, str) and int(fmt) == int(f.ggml_type)):
            return f
    raise ValueError(f"fmt must be one of {sorted(FORMATS)} (or their ggml type ids), got {fmt!r}")


def check_k(k: int, fmt_name: str = "block") -> None:
    """Raises ValueError unless the input size ``k`` is a positive multiple of 32."""
    if k <= 0 or k % BLOCK_SIZE:
        raise ValueError(f"K (input features) = {k} must be a positive multiple of {BLOCK_SIZE} "
                         f"for {fmt_name} blocks")


def _check_packed(packed: torch.Tensor, f: BlockFormat, k: int) -> None:
    check_k(k, f.name)
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] != f.row_bytes(k):
        raise ValueError(f"packed must be uint8 [N, {f.row_bytes(k)}] ({f.name}, K = {k}), got "
                         f"{packed.dtype} {tuple(packed.shape)}")


def _half(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] little-endian fp16 bytes → float32 [...]."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def unpack_blocks(packed: torch.Tensor, fmt, k: int):
    """The integer codes and scales of a packed weight.

    Args:
        packed: uint8 [N, K / 32 * block_bytes]; fmt: a format (``block_format``); k: K.

    Returns:
        (q, d, m): q int8 [N, K / 32, 32] with the weight's integer value per element
        (Q4_0: nibble - 8, in [-8, 7]; Q4_1: the nibble, [0, 15]; Q8_0: the int8),
        d float32 [N, K / 32], m float32 [N, K / 32] for Q4_1 else None; the weight is
        ``d * q (+ m)``.

    Raises:
        ValueError: K not a multiple of 32, or ``packed`` not uint8 of that row size.
    """
    f = block_format(fmt)
    _check_packed(packed, f, k)
    blocks = packed.reshape(packed.shape[0], k // BLOCK_SIZE, f.block_bytes)
    d = _half(blocks[..., 0:2])
    m = None
    if f.name == "Q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8)
    else:
        start = 4 if f.name == "Q4_1" else 2
        nib = blocks[..., start:]
        q = torch.cat([nib & 0x0F, nib >> 4], dim=-1).to(torch.int8)
        if f.name == "Q4_0":
            q = q - 8
        else:
            m = _half(blocks[..., 2:4])
    return q, d, m


def dequantize_blocks(packed: torch.Tensor, fmt, k: int) -> torch.Tensor:
    """Packed blocks → float32 [N, K] (``d * q``, ``d * (q - 8)`` or ``d * q + m``, as
    ggml's ``dequantize_row_*``; exact in float32).

    Raises:
        ValueError: as ``unpack_blocks``.
    """
    q, d, m = unpack_blocks(packed, fmt, k)
    w = d.unsqueeze(-1) * q.float()
    if m is not None:
        w = w + m.unsqueeze(-1)
    return w.reshape(packed.shape[0], k)


def quantize_to_blocks(w: torch.Tensor, fmt) -> torch.Tensor:
    """Quantize a float weight to packed blocks with ggml's reference rounding
    (``quantize_row_q8_0_ref``: d = amax/127, q = round half away from zero;
    ``quantize_row_q4_0_ref``: d = -(value of largest magnitude)/8, q = trunc(x/d + 8.5)
    clamped to 15; ``quantize_row_q4_1_ref``: d = (max - min)/15, m = min,
    q = trunc((x - min)/d + 0.5) clamped to 15), in float32 on w's device.

    Args:
        w: [N, K] float (any float dtype); K a multiple of 32.
        fmt: the format (``block_format``).

    Returns:
        uint8 [N, K / 32 * block_bytes] on w's device.

    Raises:
        ValueError: w not 2-D float, or K not a multiple of 32 (K named).
    """
    f = block_format(fmt)
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"w must be a 2-D float tensor [N, K], got {w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    check_k(k, f.name)
    x = w.detach().float().reshape(n, k // BLOCK_SIZE, BLOCK_SIZE)

    def inv(d):
        return torch.where(d == 0, torch.zeros_like(d), 1.0 / torch.where(d == 0, torch.ones_like(d), d))

    def nibbles(q):
        q = q.to(torch.uint8)
        return q[..., :16] | (q[..., 16:] << 4)

    def fp16_bytes(v):
        return v.to(torch.float16).unsqueeze(-1).view(torch.uint8)

    if f.name == "Q8_0":
        d = x.abs().amax(-1) / 127
        q = x * inv(d).unsqueeze(-1)
        q = torch.sign(q) * torch.floor(q.abs() + 0.5)          # roundf: half away from zero
        parts = [fp16_bytes(d), q.to(torch.int8).view(torch.uint8)]
    elif f.name == "Q4_0":
        idx = x.abs().argmax(-1, keepdim=True)
        d = torch.gather(x, -1, idx).squeeze(-1) / -8
        q = torch.trunc(x * inv(d).unsqueeze(-1) + 8.5).clamp(0, 15)
        parts = [fp16_bytes(d), nibbles(q)]
    else:
        lo, hi = x.amin(-1), x.amax(-1)
        d = (hi - lo) / 15
        q = torch.trunc((x - lo.unsqueeze(-1)) * inv(d).unsqueeze(-1) + 0.5).clamp(0, 15)
        parts = [fp16_bytes(d), fp16_bytes(lo), nibbles(q)]
    return torch.cat(parts, dim=-1).reshape(n, k // BLOCK_SIZE * f.block_bytes)


def quantize_activations(x: torch.Tensor):
    """Step 1 of the product: x [M, K] float → (q int8 [M, K / 32, 32], d float32
    [M, K / 32], s float32 [M, K / 32] = d * sum(q)), in float32 arithmetic (the kernel's
    ``block_quant_quantize_act`` gives the same bits)."""
    m, k = x.shape
    xb = x.float().reshape(m, k // BLOCK_SIZE, BLOCK_SIZE)
    d = xb.abs().amax(-1) * INV127
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / torch.where(d == 0, torch.ones_like(d), d))
    q = torch.round(xb * inv.unsqueeze(-1)).clamp(-127, 127)           # half to even
    s = d * q.sum(-1)
    return q.to(torch.int8), d, s


def block_quant_linear_unpacked(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                                bias: torch.Tensor | None = None, out_float32: bool = False) -> torch.Tensor:
    """``block_quant_linear_ref`` on a weight already unpacked by ``unpack_blocks``
    (q int8 [N, K / 32, 32], d and m float32 [N, K / 32] on x's device). Steps 1-3 of
    the module docstring in torch: the per-block integer dots are float32 matmuls of
    integers, exact (|products| <= 128 * 127, sums of 32 < 2**24, inputs exact even in
    TF32); the blocks are accumulated one at a time in order. Returns [M, N] in x's dtype
    (float32 with ``out_float32``)."""
    xq, dx, sx = quantize_activations(x)
    nb = q.shape[1]
    qf = q.float()
    xf = xq.float()
    acc = torch.zeros(x.shape[0], q.shape[0], dtype=torch.float32, device=x.device)
    accm = torch.zeros_like(acc)
    for b in range(nb):
        isum = xf[:, b] @ qf[:, b].t()                                   # [M, N], exact
        acc = acc + (dx[:, b:b + 1] * d[:, b]) * isum
        if m is not None:
            accm = accm + m[:, b] * sx[:, b:b + 1]
    if m is not None:
        acc = acc + accm
    if bias is not None:
        acc = acc + bias.float()
    return acc if out_float32 else acc.to(x.dtype)


def block_quant_linear_ref(x: torch.Tensor, packed: torch.Tensor, fmt, k: int,
                           bias: torch.Tensor | None = None, out_float32: bool = False) -> torch.Tensor:
    """``x @ W.T + bias`` the way the C++ kernel computes it (module docstring), in torch:
    the fallback where the kernels do not run (CUDA, float16, kernels disabled) and the
    reference the kernel is tested against (agreement to float32 rounding of the scale
    products and sums, not bitwise).

    Args:
        x: [M, K] float; packed: uint8 [N, K / 32 * block_bytes] (``fmt``'s blocks);
        k: K; bias: [N] or None.

    Returns:
        [M, N] in x's dtype (float32 with ``out_float32``).

    Raises:
        ValueError: x not [M, K], or as ``unpack_blocks``.
    """
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], got {tuple(x.shape)}")
    q, d, m = unpack_blocks(packed, fmt, k)
    return block_quant_linear_unpacked(x, q, d, m, bias, out_float32)


def kernel_isa(ops) -> str:
    """The kernel path compiled into ``ops``: "AVX2" or "scalar"."""
    return ops.block_quant_isa()


def _weight_tensor(layer: nn.Module) -> torch.Tensor:
    """``layer.weight`` as a plain tensor: a Parameter's data, or the tensor itself (a tied
    LM head holds its packed copy as a plain attribute)."""
    return layer.weight.data if isinstance(layer.weight, nn.Parameter) else layer.weight


class BlockQuantLinearMethod(LinearMethod):
    """A ``LinearMethod`` whose weight is kept in a GGUF block format.

    Loaded as packed blocks (``from_float=False``: e.g. from a GGUF file), ``create_weights``
    registers ``layer.weight`` uint8 [sum(output_partition_sizes), K / 32 * block_bytes]:
    packed rows are whole output rows, so the fused layers' loaders (which narrow dim 0)
    copy a checkpoint's packed q/k/v or gate/up rows straight in. With ``from_float=True``
    it registers a float weight [out, K] in ``params_dtype`` that
    ``process_weights_after_loading`` quantizes (``quantize_to_blocks``) and replaces.

    ``apply`` runs the C++ kernel ``block_quant_linear`` where
    ``kernels_for(device, params_dtype)`` gives the kernels (decided once, in
    ``create_weights``), else ``block_quant_linear_ref`` on the weight unpacked once.

    Works for a tied LM head too (``ParallelLMHead`` with this method and a tied embedding
    whose table is packed in ``fmt``, from ``BlockQuantEmbeddingMethod``): the head's
    ``weight`` is then the embedding's packed table, used as it is; with ``from_float`` a
    tied float table is quantized into the head's own packed copy and the embedding keeps
    its float table. (Such a head has no ``create_weights`` call: the kernel is picked in
    ``process_weights_after_loading`` from ``layer.params_dtype``.)

    Args:
        fmt: the block format ("Q8_0", "Q4_0", "Q4_1" or a ggml type).
        from_float: quantize a float checkpoint weight at load instead of loading blocks.

    Attributes:
        name: e.g. "gguf Q4_1 (C++ AVX2)" or "gguf Q4_1 (torch)", for ``describe_compute_path``.

    Raises:
        ValueError: (constructor) an unknown fmt; (create_weights) K not a multiple of 32.
    """

    def __init__(self, fmt, from_float: bool = False):
        self.fmt = block_format(fmt)
        self._fmt_id = int(self.fmt.ggml_type)   # the kernel's format argument
        self.from_float = from_float
        self._ops = None
        self._picked = False
        # the file's blocks ("gguf Q4_1") or float weights quantized here ("Q4_1 from float")
        self._label = f"{self.fmt.name} from float" if from_float else f"gguf {self.fmt.name}"
        self.name = self._label

    @property
    def input_shard_multiple(self) -> int:
        return self.fmt.block_size

    def shard_input(self, loaded: torch.Tensor, start: int, size: int) -> torch.Tensor:
        """Input features [start, start + size) (multiples of 32): whole blocks of each
        packed row, or the float columns with ``from_float``."""
        if self.from_float:
            return loaded.narrow(1, start, size)
        return loaded.narrow(1, self.fmt.row_bytes(start) if start else 0, self.fmt.row_bytes(size))

    def _pick(self, device, dtype) -> None:
        self._ops = kernels_for(device, dtype)
        self._picked = True
        impl = f"C++ {kernel_isa(self._ops)}" if self._ops is not None else "torch"
        self.name = f"{self._label} ({impl})"

    def create_weights(self, layer, input_size, output_partition_sizes, params_dtype, device):
        check_k(input_size, self.fmt.name)
        self._pick(device, params_dtype)
        rows = sum(output_partition_sizes)
        if self.from_float:
            weight = torch.empty(rows, input_size, dtype=params_dtype, device=device)
        else:
            weight = torch.empty(rows, self.fmt.row_bytes(input_size), dtype=torch.uint8, device=device)
        layer.weight = nn.Parameter(weight, requires_grad=False)
        layer.params_dtype = params_dtype   # the compute dtype (the weight becomes uint8)

    def process_weights_after_loading(self, layer):
        """Quantize a float weight (``from_float``) or check the packed one; without the
        kernels, also unpack it once for the torch path (``layer.block_unpacked``).

        Raises:
            ValueError: a packed weight of the wrong dtype or row size for ``fmt`` and
                ``layer.input_size``.
        """
        k = layer.input_size
        if not self._picked:            # a tied LM head: create_weights did not run
            self._pick(layer.weight.device, layer.params_dtype)
        w = _weight_tensor(layer)
        if self.from_float and w.is_floating_point():
            packed = quantize_to_blocks(w, self.fmt)
            if isinstance(layer.weight, nn.Parameter):
                layer.weight = nn.Parameter(packed, requires_grad=False)
            else:                       # a tied head: its own copy, the embedding keeps its table
                layer.weight = packed
            w = packed
        _check_packed(w, self.fmt, k)
        if self._ops is None:
            layer.block_unpacked = unpack_blocks(w, self.fmt, k)

    def stack_linear(self, layer, kernels):
        """``kernels.StackLinear.block`` over the packed weight (uint8 [out, in / 32 *
        block_bytes]), its ggml format id and the layer's bias, when the C++ kernel computes
        this layer; else None (the torch path)."""
        if self._ops is None:
            return None
        return kernels.StackLinear.block(_weight_tensor(layer), self._fmt_id, layer.bias)

    def apply(self, layer, x, bias=None):
        return self._apply(layer, x, bias, False)

    def apply_float32(self, layer, x, bias=None):
        return self._apply(layer, x, bias, True)

    def _apply(self, layer, x, bias, out_float32: bool):
        if self._ops is None:
            unpacked = getattr(layer, "block_unpacked", None)
            if unpacked is None:
                return block_quant_linear_ref(x, _weight_tensor(layer), self.fmt, layer.input_size, bias,
                                              out_float32)
            return block_quant_linear_unpacked(x, *unpacked, bias, out_float32)
        with trace("block_quant_linear"):
            return self._ops.block_quant_linear(None, x.contiguous(), _weight_tensor(layer), self._fmt_id, bias,
                                                out_float32=out_float32)


class BlockQuantEmbeddingMethod:
    """A token embedding whose table stays in a GGUF block format (e.g. SmolLM2's Q8_0
    ``token_embd``, which is also the tied LM head's weight): only the looked-up rows are
    dequantized.

    Args:
        fmt: the block format ("Q8_0", "Q4_0", "Q4_1" or a ggml type).
    """

    def __init__(self, fmt):
        self.fmt = block_format(fmt)

    def create_weights(self, layer: nn.Module, num_embeddings: int, embedding_dim: int,
                       dtype: torch.dtype, device: torch.device) -> None:
        """Register ``layer.weight`` uint8 [num_embeddings, embedding_dim / 32 * block_bytes]
        and remember ``dtype`` as ``layer.params_dtype`` (the dtype lookups return).

        Raises:
            ValueError: embedding_dim not a multiple of 32."""
        layer.weight = nn.Parameter(
            torch.empty(num_embeddings, self.fmt.row_bytes(embedding_dim), dtype=torch.uint8, device=device),
            requires_grad=False)
        layer.params_dtype, layer.embedding_dim = dtype, embedding_dim

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Nothing to prepare: the file's blocks are looked up as they are."""

    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """int64 ids [T] → [T, embedding_dim] in ``layer.params_dtype`` (dequantized
        exactly in float32, then rounded to the dtype)."""
        rows = layer.weight.index_select(0, input_ids)
        return dequantize_blocks(rows, self.fmt, layer.embedding_dim).to(layer.params_dtype)
