"""A Llama-family decoder stack as one C++ call a step (``kernels/csrc/decoder_stack.cpp``).

When every piece of every decoder layer already runs a C++ kernel (linears whose method
has a ``stack_linear`` form: GGUF blocks from ``--quantization gguf``/``q8_0``/``q4_0``/
``q4_1``, int8 W8A8 on the AVX2 or AMX-INT8 kernel from ``--quantization int8``; the
fused add + RMSNorm, RoPE, the K/V write and the paged attention of the ``cpu_kernel``
backend, SiLU-and-mul), the Python between those kernels is what is left of a
single-stream decode step: ~12 module calls, ~10 tensor views and ~4 allocations a layer,
~90 us a layer against ~170 us of kernels on the project's 2-core EPYC
(docs/benchmarks.md). ``FusedDecoder`` hands the whole stack to one C++ object that calls
the same kernels, in the same order, on the same tensors, so outputs are bitwise
those of the per-layer path (``tests/models/test_fused_decoder.py`` asserts it), at prefill and
decode alike. Layers keep their weights and their Python forward, which runs whenever
the fused stack does not apply: another linear method, a model with q/k norms or another
MLP, several KV-cache groups (sliding-window models), the torch attention backend,
``PAGEDLLM_FUSED_DECODER=0``. llama.cpp's compute graph and IPEX's fused decoder layers
are the same idea for the CPU; vLLM gets it on GPUs from CUDA graphs.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pagedllm import envs
from pagedllm.layers.layernorm import residual_stream


class FusedDecoder:
    """Builds (lazily, at the first step after the KV cache is bound) and runs the C++
    stack for a list of decoder layers.

    Each layer offers ``fused_operands()``: the keyword arguments of
    ``DecoderStack.add_layer`` plus ``kernels`` (the compiled module) and ``shape``
    (num_heads, num_kv_heads, head_dim, rms_norm_eps, attention scale), or a string
    saying why it cannot be fused. The stack is built when every layer offers them with
    one shape (``prepare`` builds only once a KV cache is bound); it is dropped (and
    rebuilt on the next step) when the layers' KV cache is bound again or ``invalidate``
    is called (weights reloaded).

    Attributes:
        reason: why the stack is not used (None when it is, "not built yet" until
            ``prepare`` has seen a bound KV cache).
    """

    def __init__(self):
        self._stack = None
        self._cache_key: object = None
        self.reason: str | None = "not built yet"

    def invalidate(self) -> None:
        """Forget the stack (weights or caches changed); the next step decides again."""
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
        """Build the stack for ``layers`` now if their KV cache changed since the last
        build (the runner's start-up log reads ``reason`` after this). Returns False while
        no KV cache is bound (nothing decided)."""
        key = layers[0].self_attn.attn.kv_cache
        if key is not self._cache_key:
            self._cache_key = key
            self._build(layers)
        return key is not None

    def __call__(self, layers: Sequence[nn.Module], x: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor | None:
        """Run every layer on the embeddings ``x`` (contiguous [T, hidden]; a float32 ``x``
        is overwritten: it becomes the residual stream, ``residual_stream``) at
        ``positions`` (int64 [T]) with the step's attention metadata (the forward context).
        Returns the hidden states before the final norm, float32 [T, hidden] (the last
        residual + the last MLP output, as the per-layer path), or None when the stack does
        not apply (``reason`` says why; ``x`` is then untouched and the caller runs its
        layers one by one)."""
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
