"""Quantized weights (``--quantization``): each method is a ``QuantizationConfig`` that
hands every linear layer a ``LinearMethod`` (after vLLM's ``quantization/`` package).

Methods:
    int8: int8 weights (per-output-channel scales, quantized at load) with int8
        activations quantized per token at run time (W8A8), through the project's AMX-INT8
        kernel (Intel Xeon), its AVX2 kernel (a CPU without VNNI or AMX), else oneDNN's
        int8 matmul (``int8.Int8W8A8LinearMethod``).
    gguf: a GGUF file's own Q8_0 / Q4_0 / Q4_1 blocks, kept packed (no float copy).
    q8_0, q4_0, q4_1: float weights (HF safetensors, or a GGUF's float tensors) quantized
        at load into those 32-weight block formats (4- and 8-bit weights for memory-bound
        decode). A GGUF's quantized tensors are dequantized first, so on an already
        quantized file these round twice (the bundled Q4_1 file with ``q4_0``: perplexity
        +23 %); ``gguf`` keeps the file's own blocks.
"""
from __future__ import annotations

import importlib

from pagedllm.layers.quantization.base_config import QuantizationConfig, unsupported

# --quantization value → "module:class" of its config (imported when chosen).
QUANTIZATION_METHODS: dict[str, str] = {
    "int8": "pagedllm.layers.quantization.int8_config:Int8Config",
    "gguf": "pagedllm.layers.quantization.gguf_config:GGUFConfig",
    "q8_0": "pagedllm.layers.quantization.gguf_config:BlockQuantConfig",
    "q4_0": "pagedllm.layers.quantization.gguf_config:BlockQuantConfig",
    "q4_1": "pagedllm.layers.quantization.gguf_config:BlockQuantConfig",
}


def get_quantization_config(name: str, **model_info) -> QuantizationConfig:
    """The config of the method ``name`` for one model.

    Args:
        name: a key of ``QUANTIZATION_METHODS``.
        **model_info: what the method needs to know about the model and where it runs:
            ``device`` and ``gguf_tensor_types`` (HF name → GGML type name, for a GGUF
            file; None for a HF directory). Not the dtype: the engine makes the config
            before it resolves ``--dtype auto``, so that a method that cannot run fails
            before that timing.

    Raises:
        InvalidParameterError("quantization"): unknown name, or the method cannot run with
        this model or machine (the reason in the message).
    """
    if name not in QUANTIZATION_METHODS:
        raise unsupported(f"unknown method {name!r}; supported: {', '.join(QUANTIZATION_METHODS)}")
    module, cls = QUANTIZATION_METHODS[name].split(":")
    return getattr(importlib.import_module(module), cls).create(name, **model_info)


__all__ = ["QUANTIZATION_METHODS", "QuantizationConfig", "get_quantization_config", "unsupported"]
