"""What a quantization method tells the layers (after vLLM's ``QuantizationConfig``).

A config is made once per model (``get_quantization_config``) and handed to the model's
constructor, which hands it to every layer; each layer asks it for its ``LinearMethod``
(``get_linear_method``) and keeps the default (dense) method when it answers None. So a new
method is one new config + method pair here, and the models never change.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pagedllm.errors import InvalidParameterError


class QuantizationConfig(ABC):
    """One quantization method's settings for one model.

    Attributes:
        name: the ``--quantization`` value.
        packed_modules_mapping: the model's fused layers and the checkpoint projections in
            each, e.g. ``{"qkv_proj": ["q_proj", "k_proj", "v_proj"]}`` (set by
            ``models.loader.build_model`` from the model class before construction), so
            a config keyed by checkpoint names can answer for a fused layer.
    """

    name: str
    packed_modules_mapping: dict[str, list[str]] = {}

    @abstractmethod
    def get_linear_method(self, prefix: str, input_size: int, output_sizes: list[int],
                          params_dtype: torch.dtype, device: torch.device):
        """The ``LinearMethod`` for the linear layer named ``prefix`` (e.g.
        ``model.layers.0.self_attn.qkv_proj``; ``lm_head`` for the LM head), or None for
        the default dense method.

        Args:
            input_size: in features; output_sizes: out features of each fused part.
            params_dtype: the activations' dtype; device: where the layer lives.

        Raises:
            InvalidParameterError("quantization"): the layer cannot be computed this way
            (e.g. a GGUF tensor type the method cannot keep packed).
        """

    def get_embedding_method(self, prefix: str, num_embeddings: int, embedding_dim: int,
                             params_dtype: torch.dtype, device: torch.device):
        """How the token embedding named ``prefix`` stores its table: an object with
        ``create_weights``/``process_weights_after_loading``/``embedding(layer, ids)``, or
        None for a dense table (the default)."""
        return None

    def packed_gguf_types(self) -> frozenset[str]:
        """GGML tensor types (e.g. ``"Q4_1"``) the GGUF loader hands over as raw blocks
        (uint8 [rows, row bytes]) instead of dequantizing them: none by default."""
        return frozenset()

    def describe(self) -> str:
        """One phrase for the start-up log."""
        return self.name

    def check_model(self, packed_modules_mapping: dict[str, list[str]]) -> None:
        """Raise now, before any weight loads, what ``get_linear_method`` would raise for a
        model with these fused layers (default: nothing to check).

        Raises:
            InvalidParameterError("quantization"): a layer this method cannot serve."""

    def fused_parts(self, prefix: str) -> list[str]:
        """The checkpoint module names behind the layer ``prefix``: the projections fused
        into it (``packed_modules_mapping``), else ``prefix`` itself, e.g.
        ``model.layers.0.mlp.gate_up_proj`` → ``[...mlp.gate_proj, ...mlp.up_proj]``."""
        base, _, module = prefix.rpartition(".")
        parts = self.packed_modules_mapping.get(module)
        if not parts:
            return [prefix]
        return [f"{base}.{p}" if base else p for p in parts]


def unsupported(message: str) -> InvalidParameterError:
    """The error for a quantization method that cannot run here (HTTP-free: the CLI and
    ``LLM`` show it as a ValueError naming ``quantization``)."""
    return InvalidParameterError("quantization", f"quantization: {message}")
