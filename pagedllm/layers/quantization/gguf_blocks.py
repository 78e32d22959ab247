"""Linear layers and the tied LM head with weights in GGUF's Q8_0, Q4_0 and Q4_1 blocks
(ggml's ``ggml-common.h`` layouts: 32 weights per block along K, a packed [N, K] weight is
uint8 [N, K / 32 * block_bytes]), computed as llama.cpp's CPU backend does: activations
quantized per 32-element block to int8, an exact integer dot per block, then
``acc = fma(d_w * d_x, I, acc)`` over the blocks in order (Q4_1 adds its ``m_w * s_x`` term
apart). Rows are batch-invariant. Formats and steps: docs/notes/layers-quantization-gguf_blocks.md."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.kernels.cpu import kernels_for, trace
from pagedllm.layers.linear import LinearMethod

BLOCK_SIZE = 32
# float32 1/127: d_x = amax * INV127 in torch and in C++ (both one float32 multiply)
INV127 = torch.tensor(1.0 / 127.0, dtype=torch.float32).item()


@dataclass(frozen=True)
class BlockFormat:
    """One GGUF block format: ``name``, ``ggml_type`` (ggml's type id, the value of
    ``gguf.GGMLQuantizationType``; the kernel's ``fmt``), ``block_bytes`` per ``block_size``
    (32) weights."""

    name: str
    ggml_type: int
    block_bytes: int
    block_size: int = BLOCK_SIZE

    def row_bytes(self, k: int) -> int:
        """Bytes of one packed row of ``k`` weights. Raises ValueError unless k is a multiple of 32."""
        check_k(k, self.name)
        return k // self.block_size * self.block_bytes


# ggml.h's type ids, as plain ints: quantizing float weights here needs no ``gguf`` package
FORMATS: dict[str, BlockFormat] = {
    "Q4_0": BlockFormat("Q4_0", 2, 18),
    "Q4_1": BlockFormat("Q4_1", 3, 20),
    "Q8_0": BlockFormat("Q8_0", 8, 34),
}


def block_format(fmt: "str | int | BlockFormat") -> BlockFormat:
    """The ``BlockFormat`` for a name, a ggml type (enum or int) or a format.
    Raises ValueError for anything but Q8_0, Q4_0, Q4_1."""
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
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def unpack_blocks(packed: torch.Tensor, fmt, k: int):
    """(q, d, m) of a packed uint8 [N, K / 32 * block_bytes] weight: q int8 [N, K / 32, 32]
    (Q4_0: nibble - 8; Q4_1: nibble; Q8_0: the int8), d float32 [N, K / 32], m likewise for
    Q4_1 else None; the weight is ``d * q (+ m)``. Raises ValueError for K not a multiple of 32
    or ``packed`` not uint8 of that row size."""
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
    """Packed blocks → float32 [N, K], as ggml's ``dequantize_row_*`` (exact). Raises as
    ``unpack_blocks``."""
    q, d, m = unpack_blocks(packed, fmt, k)
    w = d.unsqueeze(-1) * q.float()
    if m is not None:
        w = w + m.unsqueeze(-1)
    return w.reshape(packed.shape[0], k)


def quantize_to_blocks(w: torch.Tensor, fmt) -> torch.Tensor:
    """Float w [N, K] → packed uint8 [N, K / 32 * block_bytes] on w's device, with ggml's
    reference rounding (``quantize_row_q8_0_ref`` / ``q4_0_ref`` / ``q4_1_ref``). Raises
    ValueError for w not 2-D float or K not a multiple of 32."""
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
    """x [M, K] → (q int8 [M, K / 32, 32], d float32 [M, K / 32], s = d * sum(q)), the same
    bits as the kernel's ``block_quant_quantize_act``."""
    m, k = x.shape
    xb = x.float().reshape(m, k // BLOCK_SIZE, BLOCK_SIZE)
    d = xb.abs().amax(-1) * INV127
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / torch.where(d == 0, torch.ones_like(d), d))
    q = torch.round(xb * inv.unsqueeze(-1)).clamp(-127, 127)           # half to even
    s = d * q.sum(-1)
    return q.to(torch.int8), d, s


def block_quant_linear_unpacked(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                                bias: torch.Tensor | None = None, out_float32: bool = False) -> torch.Tensor:
    """``block_quant_linear_ref`` on a weight already unpacked (``unpack_blocks``); [M, N] in
    x's dtype, or float32 with ``out_float32``."""
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
    """``x @ W.T + bias`` as the C++ kernel computes it, in torch (its fallback and reference;
    agreement to float32 rounding). x [M, K]; packed uint8 [N, K / 32 * block_bytes]; bias [N]
    or None → [M, N] in x's dtype (float32 with ``out_float32``). Raises ValueError for x not
    [M, K], or as ``unpack_blocks``."""
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], got {tuple(x.shape)}")
    q, d, m = unpack_blocks(packed, fmt, k)
    return block_quant_linear_unpacked(x, q, d, m, bias, out_float32)


def kernel_isa(ops) -> str:
    """The kernel path compiled into ``ops``: "AVX2" or "scalar"."""
    return ops.block_quant_isa()


def _weight_tensor(layer: nn.Module) -> torch.Tensor:
    """``layer.weight`` as a plain tensor (a tied LM head holds a plain tensor)."""
    return layer.weight.data if isinstance(layer.weight, nn.Parameter) else layer.weight


class BlockQuantLinearMethod(LinearMethod):
    """A ``LinearMethod`` whose weight stays in a GGUF block format (packed rows loaded as they
    are, or with ``from_float`` quantized at load); the C++ ``block_quant_linear`` where the
    kernels serve, else ``block_quant_linear_ref``. Serves a tied LM head over a packed table.
    Raises ValueError for an unknown fmt, or (``create_weights``) K not a multiple of 32."""

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
        """Quantize a float weight (``from_float``) or check the packed one; unpack it for the
        torch path. Raises ValueError for a packed weight of the wrong dtype or row size."""
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
        """``kernels.StackLinear.block`` when the C++ kernel computes this layer, else None."""
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
    """A token embedding kept in a GGUF block format; only looked-up rows are dequantized."""

    def __init__(self, fmt):
        self.fmt = block_format(fmt)

    def create_weights(self, layer: nn.Module, num_embeddings: int, embedding_dim: int,
                       dtype: torch.dtype, device: torch.device) -> None:
        """Register ``layer.weight`` uint8 [num_embeddings, embedding_dim / 32 * block_bytes].
        Raises ValueError unless embedding_dim is a multiple of 32."""
        layer.weight = nn.Parameter(
            torch.empty(num_embeddings, self.fmt.row_bytes(embedding_dim), dtype=torch.uint8, device=device),
            requires_grad=False)
        layer.params_dtype, layer.embedding_dim = dtype, embedding_dim

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Nothing to prepare."""

    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """int64 ids [T] → [T, embedding_dim] in ``layer.params_dtype``."""
        rows = layer.weight.index_select(0, input_ids)
        return dequantize_blocks(rows, self.fmt, layer.embedding_dim).to(layer.params_dtype)
