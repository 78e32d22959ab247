"""Quantized weights (``--quantization``, after vLLM's ``quantization/`` package): each
method is a ``QuantizationConfig`` that hands every linear layer a ``LinearMethod``.
``int8``: W8A8 (``int8.py``); ``gguf``: a GGUF file's own blocks, kept packed; ``q8_0``,
``q4_0``, ``q4_1``: float weights quantized at load (an already quantized GGUF is
dequantized first, so rounds twice)."""
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
    """The config of method ``name`` for one model; ``model_info``: ``device`` and
    ``gguf_tensor_types`` (None for a HF directory). Raises InvalidParameterError("quantization")
    for an unknown name or a method that cannot run with this model or machine."""
    if name not in QUANTIZATION_METHODS:
        raise unsupported(f"unknown method {name!r}; supported: {', '.join(QUANTIZATION_METHODS)}")
    module, cls = QUANTIZATION_METHODS[name].split(":")
    return getattr(importlib.import_module(module), cls).create(name, **model_info)


__all__ = ["QUANTIZATION_METHODS", "QuantizationConfig", "get_quantization_config", "unsupported"]
