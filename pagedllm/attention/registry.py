"""The attention backends by ``--attention-backend`` name (one explicit table, each class
imported on first use, as ``models/registry.py`` does for architectures), and the ``auto``
choice by device and dtype."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

import torch


if TYPE_CHECKING:
    from pagedllm.attention.backend import AttentionBackend

# name -> "module:Class"; what each computes: docs/notes/attention.md
ATTENTION_BACKENDS: dict[str, str] = {
    "torch": "pagedllm.attention.torch_backend:TorchAttentionBackend",
    "cpu_kernel": "pagedllm.attention.cpu_backend:CpuKernelAttentionBackend",
    "triton": "pagedllm.attention.triton_backend:TritonAttentionBackend",
}


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def choose_attention_backend(name: str = "auto", device: torch.device | str | None = None,
                             dtype: torch.dtype | None = None) -> tuple[str, str]:
    """(backend name, why) for ``--attention-backend name`` on ``device`` (None: CPU) in
    ``dtype`` (None: any). ``auto``: ``cpu_kernel`` on the CPU in a dtype its C++ kernel runs,
    else ``torch``; ``triton`` on CUDA where triton imports, else ``torch``.
    Raises ValueError for a name not in ``ATTENTION_BACKENDS`` (the known ones listed)."""
    if name != "auto":
        if name not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {name!r}; available: auto, "
                             f"{', '.join(sorted(ATTENTION_BACKENDS))}")
        return name, "--attention-backend"
    kind = torch.device(device).type if device is not None else "cpu"
    if kind == "cpu":
        from pagedllm.kernels.cpu import KERNEL_DTYPES

        if dtype is not None and dtype not in KERNEL_DTYPES:
            return "torch", f"auto: no C++ attention kernel for {str(dtype).removeprefix('torch.')}"
        return "cpu_kernel", "auto: the CPU"
    if kind == "cuda":
        if _triton_importable():
            return "triton", "auto: CUDA"
        return "torch", "auto: CUDA without triton installed"
    return "torch", f"auto: no kernel backend for {kind}"


def attention_backend_class(name: str = "auto", device: torch.device | str | None = None,
                            dtype: torch.dtype | None = None) -> type[AttentionBackend]:
    """The class ``choose_attention_backend`` names. Raises ValueError for an unknown name."""
    chosen, _ = choose_attention_backend(name, device, dtype)
    module, _, cls = ATTENTION_BACKENDS[chosen].partition(":")
    return getattr(importlib.import_module(module), cls)


def get_attention_backend(name: str = "auto", device: torch.device | str | None = None,
                          dtype: torch.dtype = torch.float32,
                          kv_cache_dtype: torch.dtype | None = None) -> AttentionBackend:
    """Instantiate backend ``name`` for ``dtype`` with a ``kv_cache_dtype`` cache (None: dtype);
    its ``why`` says how it was chosen. Raises ValueError for an unknown name, an unsupported
    ``kv_cache_dtype``, or a backend that cannot run on ``device``."""
    chosen, why = choose_attention_backend(name, device, dtype)
    cls = attention_backend_class(chosen)
    if kv_cache_dtype is not None and kv_cache_dtype not in cls.kv_cache_dtypes:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype} is not supported by the {cls.name!r} attention backend")
    backend = cls(device=torch.device(device) if device is not None else None, dtype=dtype,
                  kv_cache_dtype=kv_cache_dtype)
    backend.why = why
    return backend
