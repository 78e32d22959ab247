"""``--quantization int8``: every linear layer in int8 W8A8 (``int8.Int8W8A8LinearMethod``:
per-output-channel int8 weights quantized at load, per-token int8 activations), computed
by oneDNN's int8 matmul on the CPU. The LM head stays dense unless ``quantize_lm_head``:
on SmolLM2-135M an int8 head raised perplexity on the fixed text from 21.05 to 21.57
(float32 20.21) for 1.5-1.6x on that one matmul.

Accuracy: per-token activation scales are set by a few outlier channels (15-35x the mean
|x| in SmolLM2-135M), so activation steps are coarse; measured perplexity +4 to +7 % over
float32 on the bundled model (``pagedllm bench accuracy``), against +0.7 % for ``q8_0``,
whose 32-element blocks isolate outliers. Closing that gap needs outlier handling
(SmoothQuant's calibrated smoothing, LLM.int8()'s outlier columns), not done here.

Where oneDNN's int8 matmul cannot run exactly (a torch without mkldnn, ``PAGEDLLM_ONEDNN=0``,
CUDA) the method is refused with a clear error rather than run through its torch reference
path, which is far slower than the unquantized model.
"""
from __future__ import annotations

import torch

from pagedllm.layers.quantization.base_config import QuantizationConfig, unsupported
from pagedllm.layers.quantization.int8 import Int8W8A8LinearMethod, onednn_int8_available


class Int8Config(QuantizationConfig):
    """W8A8 for every linear layer.

    Args:
        device: where the model runs.
        quantize_lm_head: the LM head in int8 too (the biggest matmul of a decode step for
            a small model: 576 x 49152 in SmolLM2-135M).
    """

    name = "int8"

    def __init__(self, device: torch.device, quantize_lm_head: bool = False):
        self.device, self.quantize_lm_head = torch.device(device), quantize_lm_head

    @classmethod
    def create(cls, name: str, device: torch.device | str = "cpu", **_) -> Int8Config:
        """Raises InvalidParameterError("quantization") where oneDNN's int8 matmul cannot run."""
        if not onednn_int8_available(device):
            raise unsupported(
                f"int8 computes with oneDNN's int8 matmul on the CPU, which is not available for "
                f"device {str(device)!r} here (not the CPU, torch without mkldnn, or PAGEDLLM_ONEDNN=0)")
        return cls(torch.device(device))

    def get_linear_method(self, prefix, input_size, output_sizes, params_dtype, device):
        if prefix == "lm_head" and not self.quantize_lm_head:
            return None
        return Int8W8A8LinearMethod(device)

    def describe(self) -> str:
        return "int8 W8A8"
