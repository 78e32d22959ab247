"""A Llama-family decoder stack as one C++ call a step (``kernels/csrc/decoder_stack.cpp``)
when every layer runs C++ kernels; outputs bitwise the per-layer path's. Off with
``PAGEDLLM_FUSED_DECODER=0``. Why: docs/notes/models.md."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pagedllm import envs
from pagedllm.layers.layernorm import residual_stream


class FusedDecoder:
    """Builds (once a KV cache is bound) and runs the C++ stack over layers offering
    ``fused_operands()``; ``reason``: why it is not used (None when it is)."""

    def __init__(self):
        self._stack = None
        self._cache_key: object = None
        self.reason: str | None = "not built yet"

    def invalidate(self) -> None:
        """Forget the stack (weights or caches changed)."""
        self._stack, self._cache_key, self.reason = None, None, "not built yet"

    def _build(self, layers: Sequence[nn.Module]) -> None:
        self._stack = None
        if not envs.fused_decoder_enabled():
            self.reason = "PAGEDLLM_FUSED_DECODER=0"
            return
        ops = [layer.fused_operands() if hasattr(layer, "fused_operands") else
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

    def prepare(self, layers: Sequence[nn.Module]) -> bool:
        """Rebuild for ``layers`` if their KV cache changed; False while no KV cache is bound."""
        key = layers[0].self_attn.attn.kv_cache
        if key is not self._cache_key:
            self._cache_key = key
            self._build(layers)
        return key is not None

    def __call__(self, layers: Sequence[nn.Module], x: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor | None:
        """Run every layer on ``x`` (contiguous [T, hidden]; a float32 ``x`` is overwritten) at
        ``positions`` (int64 [T]). Returns float32 [T, hidden] before the final norm, or None when
        the stack does not apply (``x`` untouched; ``reason`` says why)."""
        self.prepare(layers)
        if self._stack is None:
            return None
        first = layers[0]
        md = first.self_attn.attn.kernel_metadata()
        if md is None:   # several KV-cache groups, or the backend fell back to torch ops
            self.reason = "attention metadata other than one cpu_kernel group"
            return None
        h = first.input_layernorm(x)
        cos, sin = first.self_attn.rotary_emb.tables(positions)
        out, residual = self._stack.forward(h, residual_stream(x), cos, sin, md.slot_mapping, md.block_table,
                                            md.query_start_loc, md.seq_lens, md.block_size, md.sliding_window)
        return residual + out
