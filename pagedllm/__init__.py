"""pagedllm: an LLM inference and serving engine with a paged KV cache, continuous
batching, chunked prefill and prefix caching.

Public names are imported on first use (PEP 562), so ``python -m pagedllm.kernels.cpu``
runs with torch alone installed.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.outputs import CompletionOutput, RequestOutput
    from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

_LAZY = {"LLM": "pagedllm.entrypoints.llm", "SamplingParams": "pagedllm.sampling_params",
         "StructuredOutputsParams": "pagedllm.sampling_params",
         "RequestOutput": "pagedllm.outputs", "CompletionOutput": "pagedllm.outputs"}


def __getattr__(name: str):
    """The public names, imported when first asked for; AttributeError for others."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
