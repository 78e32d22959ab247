"""Quantized weights for the linear layers and the embedding.

``gguf_blocks``: GGUF's Q8_0 / Q4_0 / Q4_1 block formats, multiplied by the C++ kernel
``block_quant_linear`` (torch fallback elsewhere)."""
from pagedllm.layers.quantization.gguf_blocks import (
    FORMATS,
    BlockFormat,
    BlockQuantEmbeddingMethod,
    BlockQuantLinearMethod,
    block_format,
    block_quant_linear_ref,
    dequantize_blocks,
    quantize_to_blocks,
)

__all__ = ["FORMATS", "BlockFormat", "BlockQuantEmbeddingMethod", "BlockQuantLinearMethod", "block_format",
           "block_quant_linear_ref", "dequantize_blocks", "quantize_to_blocks"]
