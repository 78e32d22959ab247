"""Model layers (after vLLM's ``model_executor/layers``): each picks its implementation
(torch ops, the C++ CPU kernels, oneDNN-packed weights) once, at construction. The
runner needs three things from here: ``bind_kv_cache`` after allocating the KV cache, and
``describe_compute_path`` and ``describe_kv_scales`` for the start-up log; a pass outside
the engine (``worker/prefill.py``) binds a cache of its own and ``unbind_kv_cache``s it."""
from pagedllm.layers.attention import bind_kv_cache, describe_kv_scales, unbind_kv_cache
from pagedllm.layers.utils import describe_compute_path

__all__ = ["bind_kv_cache", "describe_compute_path", "describe_kv_scales", "unbind_kv_cache"]
