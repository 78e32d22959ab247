"""What every layer shares: the one place that decides whether the C++ CPU kernels serve
a layer (``cpu_kernels_for``), and the start-up description of what each layer kind
picked (``describe_compute_path``); and the plain weight loader."""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.kernels.cpu import kernels_for


def cpu_kernels_for(device: torch.device | str, dtype: torch.dtype):
    """The compiled C++ kernel module (``pagedllm/kernels/cpu.py``) for layers computing in
    ``dtype`` on ``device``: the kernels cover the CPU in float32 and bfloat16 (bf16
    storage, float32 arithmetic). None elsewhere, and when they are disabled
    (``PAGEDLLM_CPU_KERNELS=0``) or failed to build; callers then use torch ops with the
    same maths. Never raises."""
    return kernels_for(device, dtype)


def describe_compute_path(model: nn.Module) -> str:
    """The implementation each layer kind of ``model`` picked, for the start-up log, e.g.
    ``"linear oneDNN-packed (qkv_proj o_proj gate_up_proj down_proj lm_head), rms_norm C++,
    rotary C++, silu_and_mul C++"``. Every layer that has a choice says ``compute_path =
    (kind, implementation)`` or ``(kind, implementation, name)``; kinds in alphabetical
    order, several implementations of one kind joined by `` / `` in the order met, each
    followed by the names (in brackets, each once) of the layers that use it, e.g.
    ``"linear F.linear in 16-row chunks (qkv_proj o_proj) / dense W@h.T (lm_head)"``."""
    kinds: dict[str, dict[str, list[str]]] = {}
    for m in model.modules():
        path = getattr(m, "compute_path", None)
        if path is not None:
            names = kinds.setdefault(path[0], {}).setdefault(path[1], [])
            if len(path) > 2 and path[2] not in names:
                names.append(path[2])
    return ", ".join(
        f"{kind} " + " / ".join(impl + (f" ({' '.join(names)})" if names else "")
                                for impl, names in kinds[kind].items())
        for kind in sorted(kinds))


def check_shape(name: str, target: torch.Tensor, loaded: torch.Tensor) -> None:
    """Raises ValueError naming the weight ``name`` when ``loaded``'s shape is not ``target``'s."""
    if tuple(target.shape) != tuple(loaded.shape):
        raise ValueError(f"weight {name}: shape {tuple(loaded.shape)} != expected {tuple(target.shape)}")


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, name: str) -> None:
    """Copy the checkpoint tensor ``loaded_weight`` into ``param`` whole (cast to its dtype):
    for parameters whose layer has no ``weight_loader`` of its own.

    Raises:
        ValueError: the shapes differ (``name`` and both shapes in the message).
    """
    check_shape(name, param, loaded_weight)
    param.data.copy_(loaded_weight.to(param.dtype))
