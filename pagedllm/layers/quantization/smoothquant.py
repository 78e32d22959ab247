"""SmoothQuant's per-channel smoothing for int8 W8A8 (Xiao et al. 2023, eq. 4):
``x W^T = (x / s)(W s)^T`` with ``s[j] = max|X[:, j]| ** alpha / max|W[:, j]| ** (1 - alpha)``;
the weights are multiplied by s before quantization, the activations by 1 / s every call.
Maxima come from float prefills of ``data/calibration.txt`` (``calibrate_input_amax``).
Measurements: docs/notes/layers-quantization-smoothquant.md."""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch
from torch import nn

CALIBRATION_TEXT_PATH = os.path.join(os.path.dirname(__file__), "data", "calibration.txt")
# A channel whose activation or weight maximum is below this (never active on the text, or
# a zero weight column) is not smoothed (s = 1): a tiny s would scale an input that is
# active later by a large 1 / s.
_EPS = 1e-5


def calibration_text() -> str:
    """The shipped calibration text (UTF-8)."""
    with open(CALIBRATION_TEXT_PATH, encoding="utf-8") as f:
        return f.read()


def smoothing_factors(act_amax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's s, float32 [K], from act_amax float32 [K] and weight [N, K] (alpha in
    [0, 1]); channels with a ~0 maximum get s = 1. Raises ValueError for alpha outside [0, 1]
    or shapes that do not match."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if act_amax.shape != (weight.shape[1],):
        raise ValueError(f"act_amax has shape {tuple(act_amax.shape)}, the weight {tuple(weight.shape)}")
    w_amax = weight.float().abs().amax(0)
    a = act_amax.float()
    live = (a > _EPS) & (w_amax > _EPS)
    s = a.clamp(min=_EPS) ** alpha / w_amax.clamp(min=_EPS) ** (1 - alpha)
    return torch.where(live, s.clamp(min=_EPS), torch.ones_like(s))


def calibrate_input_amax(layers: Sequence[nn.Module], run: Callable[[list[int]], object], ids: list[int],
                         float_method: Callable[[], object]) -> int:
    """Run ``run(ids)`` once with ``layers`` computing through ``float_method()``, set each
    layer's ``int8_act_amax`` (float32 [in], max |x| per input channel seen), and restore their
    methods (also if ``run`` raises). Returns how many layers got maxima."""
    saved = [layer.linear_method for layer in layers]
    handles = []

    def record(layer, inp):
        x = inp[0].detach()
        amax = x.reshape(-1, x.shape[-1]).abs().amax(0).float()
        prev = getattr(layer, "int8_act_amax", None)
        layer.int8_act_amax = amax if prev is None else torch.maximum(prev, amax)

    try:
        for layer in layers:
            layer.linear_method = float_method()
            handles.append(layer.register_forward_pre_hook(record))
        run(ids)
    finally:
        for h in handles:
            h.remove()
        for layer, method in zip(layers, saved):
            layer.linear_method = method
    return sum(getattr(layer, "int8_act_amax", None) is not None for layer in layers)
