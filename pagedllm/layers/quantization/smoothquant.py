"""SmoothQuant's per-channel smoothing for int8 W8A8 (Xiao et al. 2023, "SmoothQuant:
Accurate and Efficient Post-Training Quantization for Large Language Models", eq. 4).

Per-token activation scales are set by a few outlier input channels (15-35x the mean |x| in
SmolLM2-135M), which leaves the other channels few int8 steps. SmoothQuant moves part of
that range into the weights, an exact identity before rounding: ``x W^T = (x / s)(W s)^T``
with, per input channel j,

    s[j] = max|X[:, j]| ** alpha / max|W[:, j]| ** (1 - alpha)

(alpha = 0.5 as the paper's default), ``max|X[:, j]|`` measured on calibration text. The
weights are multiplied by ``s`` once before they are quantized; the activations are divided
by it (multiplied by ``1 / s``) before their per-token quantization, every call.

Calibration (``calibrate_input_amax``; the prefills are ``worker.prefill.calibrate_smoothquant``)
runs the float model over the text shipped in ``data/calibration.txt`` (prose, a chat turn,
code, a recipe, JSON, a sum; 645 tokens of SmolLM2's tokenizer; not the perplexity text of
``benchmarks/data``) in 128-token prefills, with the layers to be quantized computing in
float from their loaded weights, and records each one's input |x| maximum per channel.
Measured on the bundled SmolLM2-135M (perplexity on the fixed text, float32 20.21): W8A8
without smoothing 21.46 (+6.2 %, 8-bit weights on an AVX512-VNNI CPU) and 21.09 (+4.4 %,
7-bit weights); with alpha 0.5 20.41 (+1.0 %; before silent channels kept s = 1, 20.49,
and 20.34 in 256-token prefills); alpha 0.8 20.95 (+3.7 %).
"""
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
    """SmoothQuant's s (eq. 4) per input channel: float32 [K].

    Args:
        act_amax: float32 [K], max |x| per input channel over the calibration tokens.
        weight: [N, K], the layer's float weight (any float dtype).
        alpha: migration strength in [0, 1] (0: s = 1 / max|W|, 1: s = max|X|).

    Channels whose activation or weight maximum is ~0 get s = 1 (not smoothed).

    Raises:
        ValueError: alpha outside [0, 1], or shapes that do not match.
    """
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
    """Run ``run(ids)`` (a prefill of the whole model) once, with each of ``layers``
    computing through ``float_method()`` (a dense float ``LinearMethod``; its loaded
    ``weight`` unprocessed), and set on each layer ``int8_act_amax``: float32 [in_features],
    max |x| per input channel of what it received (layers that received nothing get none).
    The layers' own methods are put back afterwards, also when ``run`` raises.

    Returns:
        how many layers got maxima.
    """
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
