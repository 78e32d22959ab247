"""A Llama-family decoder stack as one C++ call a step (``kernels/csrc/decoder_stack.cpp``)
when every layer runs C++ kernels; outputs bitwise the per-layer path's. The runner calls it
through its compiled-step hook (``worker/cpu_fused_step.py``, the CPU twin of a CUDA graph),
passing the attention backend's kernels and metadata. Off with ``PAGEDLLM_FUSED_DECODER=0``.
Why: docs/notes/models.md."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pagedllm import envs
from pagedllm.layers.layernorm import residual_stream


class FusedDecoder:
    """Builds (once a KV cache is bound) and runs the C++ stack over layers offering
    ``fused_operands(kernels)``; ``reason``: why it is not used (None when it is)."""

    def __init__(self):
        self._stack = None
        self._cache_key: object = None
        self.reason: str | None = "not built yet"

    def invalidate(self) -> None:
        """Forget the stack (weights or caches changed)."""
        self._stack, self._cache_key, self.reason = None, None, "not built yet"

    def _build(self, layers: Sequence[nn.Module], kernels) -> None:
        self._stack = None
        if not envs.fused_decoder_enabled():
            self.reason = "PAGEDLLM_FUSED_DECODER=0"
            return
        if kernels is None:
            self.reason = "attention not on the C++ kernels"
            return
        ops = [layer.fused_operands(kernels) if hasattr(layer, "fused_operands") else
               f"{type(layer).__name__} has no fused form" for layer in layers]
        why = next((o for o in ops if isinstance(o, str)), None)
        if why is not None:
            self.reason = why
            return
        modules = [o.pop("kernels") for o in ops]
        shapes = {o.pop("shape") for o in ops}
        if len(shapes) != 1 or any(m is not modules[0] for m in modules):
            self.reason = "layers of different shapes"
            return
        (nh, nkv, hd, eps, scale), = shapes
        stack = modules[0].DecoderStack(nh, nkv, hd, eps, scale)
        for o in ops:
            stack.add_layer(**o)
        self._stack, self.reason = stack, None

    def prepare(self, layers: Sequence[nn.Module], kernels) -> str | None:
        """Rebuild for ``layers`` and the C++ module ``kernels`` (None: the attention backend has
        none) if either or the KV cache changed. Returns ``reason`` (None: the stack applies)."""
        key = (layers[0].self_attn.attn.kv_cache, kernels)
        if key[0] is None:
            self._stack, self._cache_key, self.reason = None, None, "no KV cache bound"
        elif self._cache_key is None or any(a is not b for a, b in zip(key, self._cache_key)):
            self._cache_key = key
            self._build(layers, kernels)
        return self.reason

    def __call__(self, layers: Sequence[nn.Module], x: torch.Tensor, positions: torch.Tensor,
                 md) -> torch.Tensor:
        """Run every layer on ``x`` (contiguous [T, hidden]; a float32 ``x`` is overwritten) at
        ``positions`` (int64 [T]) with the kernels' attention metadata ``md`` (the backend's
        ``kernel_metadata``). Returns float32 [T, hidden] before the final norm. Raises
        RuntimeError unless ``prepare`` returned None."""
        if self._stack is None:
            raise RuntimeError(f"the fused decoder stack does not apply: {self.reason}")
        first = layers[0]
        h = first.input_layernorm(x)
        cos, sin = first.self_attn.rotary_emb.tables(positions)
        out, residual = self._stack.forward(h, residual_stream(x), cos, sin, md.slot_mapping, md.block_table,
                                            md.query_start_loc, md.seq_lens, md.block_size, md.sliding_window)
        return residual + out
