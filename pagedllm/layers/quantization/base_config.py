"""What a quantization method tells the layers (after vLLM's ``QuantizationConfig``)."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pagedllm.errors import InvalidParameterError


class QuantizationConfig(ABC):
    """One quantization method's settings for one model. ``name``: the ``--quantization``
    value; ``packed_modules_mapping``: fused layer → checkpoint projections (set by the loader)."""

    name: str
    packed_modules_mapping: dict[str, list[str]] = {}

    @abstractmethod
    def get_linear_method(self, prefix: str, input_size: int, output_sizes: list[int],
                          params_dtype: torch.dtype, device: torch.device):
        """The ``LinearMethod`` for the layer ``prefix`` (``lm_head`` for the head), or None for
        the dense default. Raises InvalidParameterError("quantization") for a layer it cannot serve."""

    def get_embedding_method(self, prefix: str, num_embeddings: int, embedding_dim: int,
                             params_dtype: torch.dtype, device: torch.device):
        """How the embedding ``prefix`` stores its table, or None (dense)."""
        return None

    def packed_gguf_types(self) -> frozenset[str]:
        """GGML types the GGUF loader hands over as raw blocks (default none)."""
        return frozenset()

    def describe(self) -> str:
        """One phrase for the start-up log."""
        return self.name

    def check_model(self, packed_modules_mapping: dict[str, list[str]]) -> None:
        """Raise before loading what ``get_linear_method`` would raise for these fused layers
        (InvalidParameterError("quantization")); default: nothing."""

    def fused_parts(self, prefix: str) -> list[str]:
        """The checkpoint module names fused into layer ``prefix``, else ``[prefix]``."""
        base, _, module = prefix.rpartition(".")
        parts = self.packed_modules_mapping.get(module)
        if not parts:
            return [prefix]
        return [f"{base}.{p}" if base else p for p in parts]


def unsupported(message: str) -> InvalidParameterError:
    """The ``InvalidParameterError("quantization", ...)`` for a method that cannot run here."""
    return InvalidParameterError("quantization", f"quantization: {message}")
