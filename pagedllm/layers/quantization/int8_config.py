"""``--quantization int8``: every linear layer in int8 W8A8 (``int8.Int8W8A8LinearMethod``:
per-output-channel int8 weights quantized at load, per-token int8 activations), computed
on the CPU by the project's AMX-INT8 kernel (Intel Xeon), its AVX2 kernel (CPUs without
VNNI or AMX, e.g. the AMD EPYC) or oneDNN's int8 matmul (VNNI). The LM head is int8 too
(``quantize_lm_head``, the default): with SmoothQuant it costs little (SmolLM2-135M,
perplexity on the fixed text, AVX2 kernel: 20.304 with a dense head, 20.333 with an int8
one; float32 20.206), and it is the biggest matmul of a decode step for a small model
(576 x 49152 here: 113 MB of float32 a token). Without smoothing an int8 head had cost
much more (21.05 -> 21.57), which is why it was dense at first.

Accuracy: per-token activation scales are set by a few outlier channels (15-35x the mean
|x| in SmolLM2-135M), so activation steps are coarse; without smoothing, perplexity rose
+4 to +7 % over float32 on the bundled model (``pagedllm bench accuracy``), against +0.7 %
for ``q8_0``, whose 32-element blocks isolate outliers. So every layer is smoothed by
SmoothQuant (``smoothquant.py``, alpha ``SMOOTH_ALPHA``), calibrated at load by float
prefills of the shipped calibration text (645 tokens, 128 a prefill): +1.0 % on the bundled
model. The calibration costs those prefills at load (1.3-1.8 s for SmolLM2-135M on the
2-core CPU; a bigger model's scale with its weights). A layer that saw no calibration
token (an expert no token was routed to) is quantized without smoothing, and says so in its
method name; the load logs how many layers were calibrated.

Where none of those kernels can run (CUDA; a torch without mkldnn or ``PAGEDLLM_ONEDNN=0``
on a CPU whose own kernels are off or missing) the method is refused with a clear error
rather than run through its torch reference path, which is far slower than the unquantized
model.
"""
from __future__ import annotations

import torch

from pagedllm.layers.quantization.base_config import QuantizationConfig, unsupported
from pagedllm.layers.quantization.int8 import (Int8W8A8LinearMethod, amx_int8_available, avx2_int8_available,
                                               onednn_int8_available)


# SmoothQuant's migration strength (the paper's default; the best of 0.5 and 0.8 measured here).
SMOOTH_ALPHA = 0.5


class Int8Config(QuantizationConfig):
    """W8A8 for every linear layer.

    Args:
        device: where the model runs.
        quantize_lm_head: the LM head in int8 too (the biggest matmul of a decode step for
            a small model: 576 x 49152 in SmolLM2-135M).
        smooth_alpha: SmoothQuant's alpha for every layer, or None for no smoothing (and
            no calibration).
    """

    name = "int8"

    def __init__(self, device: torch.device, quantize_lm_head: bool = True,
                 smooth_alpha: float | None = SMOOTH_ALPHA):
        self.device, self.quantize_lm_head = torch.device(device), quantize_lm_head
        self.smooth_alpha = smooth_alpha

    @classmethod
    def create(cls, name: str, device: torch.device | str = "cpu", **_) -> Int8Config:
        """Raises InvalidParameterError("quantization") where no int8 kernel (AMX, AVX2, oneDNN) runs."""
        if not (amx_int8_available(device) or avx2_int8_available(device) or onednn_int8_available(device)):
            raise unsupported(
                f"int8 computes with the AMX-INT8 or AVX2 kernels or oneDNN's int8 matmul on the CPU, none "
                f"of which is available for device {str(device)!r} here (not the CPU, no C++ kernels, "
                f"PAGEDLLM_AMX=0 / PAGEDLLM_AVX2_INT8=0, torch without mkldnn, or PAGEDLLM_ONEDNN=0)")
        return cls(torch.device(device))

    def get_linear_method(self, prefix, input_size, output_sizes, params_dtype, device):
        if prefix == "lm_head" and not self.quantize_lm_head:
            return None
        return Int8W8A8LinearMethod(device, smooth_alpha=self.smooth_alpha)

    def describe(self) -> str:
        return "int8 W8A8" + ("" if self.smooth_alpha is None else f", SmoothQuant alpha {self.smooth_alpha:g}")
