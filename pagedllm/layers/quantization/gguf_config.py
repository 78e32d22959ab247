"""GGUF block formats as quantization methods, both computed by
``gguf_blocks.BlockQuantLinearMethod``: ``gguf`` keeps a GGUF file's Q8_0 / Q4_0 / Q4_1
blocks packed (float tensors stay dense; other types are an error); ``q8_0 | q4_0 | q4_1``
quantize float weights at load into that format (the LM head into Q8_0, as llama.cpp)."""
from __future__ import annotations

from pagedllm.distributed import get_tp_size
from pagedllm.errors import InvalidParameterError
from pagedllm.layers.quantization.base_config import QuantizationConfig, unsupported
from pagedllm.layers.quantization.gguf_blocks import (FORMATS, BlockQuantEmbeddingMethod,
                                                      BlockQuantLinearMethod)

# GGML types that are plain floats: those tensors stay dense under ``gguf``.
_FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})


def _check_divisible(prefix: str, input_size: int, method: str) -> None:
    tp = get_tp_size()
    if input_size % 32 and tp > 1 and (input_size * tp) % 32 == 0:   # whole, it would fit
        raise InvalidParameterError(
            "tensor_parallel_size", f"tensor_parallel_size {tp} splits {prefix}'s {input_size * tp} input features "
            f"into {input_size} per rank, not a multiple of {method}'s 32-weight blocks")
    if input_size % 32:
        raise unsupported(f"{method} needs input features divisible by 32 (the block size); "
                          f"layer {prefix} has {input_size}")


class GGUFConfig(QuantizationConfig):
    """``--quantization gguf``; ``tensor_types``: HF name → GGML type name of each tensor."""

    name = "gguf"

    def __init__(self, tensor_types: dict[str, str]):
        self.tensor_types = dict(tensor_types)

    @classmethod
    def create(cls, name: str, gguf_tensor_types: dict[str, str] | None = None, **_) -> GGUFConfig:
        """Raises InvalidParameterError("quantization") for a model that is not a GGUF file, or
        one whose tensors are all floats."""
        if gguf_tensor_types is None:
            raise unsupported("gguf keeps a GGUF file's quantized blocks, but the model is not a .gguf "
                              "file; use q8_0, q4_0, q4_1 or int8 to quantize float weights at load")
        if all(t in _FLOAT_TYPES for t in gguf_tensor_types.values()):
            floats = ", ".join(sorted(set(gguf_tensor_types.values())))
            raise unsupported(f"gguf keeps a GGUF file's quantized blocks, but this file has none (its tensors "
                              f"are {floats or 'absent'}); use q8_0, q4_0, q4_1 or int8 to quantize it at load, "
                              "or run without --quantization")
        return cls(gguf_tensor_types)

    def packed_gguf_types(self) -> frozenset[str]:
        return frozenset(FORMATS)

    def _type_of(self, prefix: str, names: list[str]) -> str | None:
        """The one GGML type of ``names`` (None if absent). Raises ``unsupported`` for a mix of
        types or a type that cannot be kept packed."""
        types = {self.tensor_types[n] for n in names if n in self.tensor_types}
        if not types:
            return None
        if len(types) > 1:
            raise unsupported(f"gguf cannot fuse {prefix}: its parts have different types "
                              f"({', '.join(f'{n}={self.tensor_types.get(n)}' for n in names)}); run without "
                              "--quantization to dequantize the file at load, or use q8_0, q4_0 or q4_1 to "
                              "requantize it into one type")
        (t,) = types
        if t not in FORMATS and t not in _FLOAT_TYPES:
            raise unsupported(f"gguf cannot keep {names[0]} packed: its type {t} is not one of "
                              f"{', '.join(FORMATS)} (or a float type); run without --quantization "
                              "to dequantize the file at load")
        return t

    def check_model(self, packed_modules_mapping):
        """Check every fused layer's parts and the embedding / LM head tables (``_type_of``)."""
        by_layer: dict[str, list[str]] = {}
        for fused, parts in packed_modules_mapping.items():
            for part in parts:                       # the layer's order: q, k, v
                suffix = f".{part}.weight"
                for name in self.tensor_types:
                    if name.endswith(suffix):
                        by_layer.setdefault(f"{name[:-len(suffix)]}.{fused}", []).append(name)
        for prefix, names in by_layer.items():
            self._type_of(prefix, names)
        for table in ("lm_head.weight", "model.embed_tokens.weight"):
            self._type_of(table.rpartition(".")[0], [table])

    def get_linear_method(self, prefix, input_size, output_sizes, params_dtype, device):
        if prefix == "lm_head":
            names = ["lm_head.weight"] if "lm_head.weight" in self.tensor_types else ["model.embed_tokens.weight"]
        else:
            names = [f"{p}.weight" for p in self.fused_parts(prefix)]
        t = self._type_of(prefix, names)
        if t is None or t in _FLOAT_TYPES:
            return None
        _check_divisible(prefix, input_size, "gguf")
        return BlockQuantLinearMethod(t, from_float=False)

    def get_embedding_method(self, prefix, num_embeddings, embedding_dim, params_dtype, device):
        t = self._type_of(prefix, [f"{prefix}.weight"])
        if t is None or t in _FLOAT_TYPES:
            return None
        return BlockQuantEmbeddingMethod(t)

    def describe(self) -> str:
        kinds = sorted({t for t in self.tensor_types.values() if t in FORMATS})
        return f"gguf ({', '.join(kinds) or 'no packed tensors'})"


class BlockQuantConfig(QuantizationConfig):
    """``--quantization q8_0 | q4_0 | q4_1``: float weights quantized at load into ``fmt``."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self.name = fmt.lower()

    @classmethod
    def create(cls, name: str, **_) -> BlockQuantConfig:
        return cls(name.upper())

    def get_linear_method(self, prefix, input_size, output_sizes, params_dtype, device):
        _check_divisible(prefix, input_size, self.name)
        return BlockQuantLinearMethod("Q8_0" if prefix == "lm_head" else self.fmt, from_float=True)
