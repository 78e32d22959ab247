"""Quantized linear methods: each a ``LinearMethod`` (``pagedllm/layers/linear.py``) in a
file of its own (``int8.py``: int8 weights and dynamic per-token int8 activations)."""
