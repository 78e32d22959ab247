"""What every layer shares: ``cpu_kernels_for``, ``describe_compute_path`` and the plain
weight loader."""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.kernels.cpu import kernels_for


def cpu_kernels_for(device: torch.device | str, dtype: torch.dtype):
    """The C++ kernel module for layers in ``dtype`` on ``device`` (CPU float32/bfloat16), or
    None (callers then use torch ops). Never raises."""
    return kernels_for(device, dtype)


def describe_compute_path(model: nn.Module, extra: list[tuple[str, str]] = ()) -> str:
    """The implementation each layer kind picked (from each module's ``compute_path`` =
    (kind, implementation[, name])), for the start-up log, e.g.
    ``"linear oneDNN-packed (qkv_proj o_proj), rms_norm C++, rotary C++"``; ``extra``: more
    such tuples (the runner's decoder path)."""
    kinds: dict[str, dict[str, list[str]]] = {}
    paths = [getattr(m, "compute_path", None) for m in model.modules()] + list(extra)
    for path in paths:
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
    """Copy ``loaded_weight`` into ``param`` whole, cast to its dtype. Raises ValueError on a
    shape mismatch (``name`` in the message)."""
    check_shape(name, param, loaded_weight)
    param.data.copy_(loaded_weight.to(param.dtype))
