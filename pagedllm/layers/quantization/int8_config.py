"""``--quantization int8``: every linear layer, the LM head included by default, in int8
W8A8 (``int8.Int8W8A8LinearMethod``) with SmoothQuant smoothing (alpha ``SMOOTH_ALPHA``)
calibrated at load. Refused where no int8 kernel (AMX, AVX2, oneDNN) runs. Why and the
accuracy figures: docs/notes/layers-quantization-smoothquant.md."""
from __future__ import annotations

import torch

from pagedllm.layers.quantization.base_config import QuantizationConfig, unsupported
from pagedllm.layers.quantization.int8 import (Int8W8A8LinearMethod, amx_int8_available, avx2_int8_available,
                                               onednn_int8_available)


# SmoothQuant's migration strength (the paper's default; docs/notes/layers-quantization-smoothquant.md).
SMOOTH_ALPHA = 0.5


class Int8Config(QuantizationConfig):
    """W8A8 for every linear layer; ``quantize_lm_head``: the LM head too; ``smooth_alpha``:
    SmoothQuant's alpha, or None (no smoothing, no calibration)."""

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
