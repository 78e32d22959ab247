"""Model layers (after vLLM's ``model_executor/layers``); each picks its implementation once,
at construction. The runner uses ``bind_kv_cache``/``unbind_kv_cache`` and the
``describe_*`` start-up lines."""
from pagedllm.layers.attention import bind_kv_cache, describe_kv_scales, unbind_kv_cache
from pagedllm.layers.utils import describe_compute_path

__all__ = ["bind_kv_cache", "describe_compute_path", "describe_kv_scales", "unbind_kv_cache"]
