"""Batch invariance in every dtype: greedy token ids must not change with batch
composition, prompt chunking, prefix caching or preemption, in float32 and in bfloat16,
and with a KV cache in another dtype than the model's (``--kv-cache-dtype``: bfloat16,
fp8 E4M3 / E5M2, float32) ("Defeating Nondeterminism in LLM Inference", Thinking
Machines 2025).

Two models:
- a tiny random-weight Llama (head_dim 64, so the attention kernel's vector path runs)
  in float32 and bfloat16 on every CPU: without bf16 arithmetic its bf16 matmuls are
  slow, but the model is small, so the bf16 kernels and their invariance are tested on
  both of the project's CPU kinds;
- the bundled SmolLM2-135M in bfloat16 where the CPU computes bf16 natively (the dtype
  ``--dtype auto`` may pick there); test_batching.py covers it in float32.

Each scenario compares with the same prompts run one at a time, without chunking or
caching: a shared random-token prefix (warmed into the cache first), random suffixes.
"""
from __future__ import annotations

import pytest
from invariance_helpers import _check_invariance, _workload

from pagedllm.platform import has_native_bf16

pytestmark = pytest.mark.slow   # whole-engine invariance sweeps, four engines per case

NATIVE_BF16 = has_native_bf16()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_model_invariant_in_every_dtype(tiny_dir, dtype):
    _check_invariance(tiny_dir, dtype, _workload(8, 100, seed=1), max_tokens=12)


@pytest.mark.parametrize("dtype,kv_cache_dtype", [
    ("float32", "bfloat16"), ("float32", "fp8_e4m3"), ("float32", "fp8_e5m2"),
    ("bfloat16", "fp8_e4m3"), ("bfloat16", "float32")])
def test_tiny_model_invariant_with_kv_cache_dtype(tiny_dir, dtype, kv_cache_dtype):
    """A cache narrower (or wider) than the model: every token's K/V is rounded once, when
    written, and every read sees the cached values, so chunking, caching and preemption
    cannot change what a request attends over."""
    _check_invariance(tiny_dir, dtype, _workload(8, 100, seed=1), max_tokens=12, kv_cache_dtype=kv_cache_dtype)


def test_torch_attention_fallback_invariant_with_fp8_cache(tiny_dir):
    """The torch-ops attention with an fp8 cache: a fresh prompt attends over its own K/V
    as the cache holds them (else a prompt split into chunks, whose later chunks read the
    earlier ones from the cache, would see other values than the prompt run whole)."""
    _check_invariance(tiny_dir, "float32", _workload(8, 100, seed=1), max_tokens=12, attention_backend="torch",
                      kv_cache_dtype="fp8_e4m3")


def test_torch_attention_fallback_invariant_in_bfloat16(tiny_dir):
    """The torch-ops attention (the fallback where the kernels cannot build) computes in
    float32 on the CPU: in bf16 its SDPA over the batch's padded contexts made outputs
    depend on the batch."""
    _check_invariance(tiny_dir, "bfloat16", _workload(8, 100, seed=1), max_tokens=12,
                      attention_backend="torch")


@pytest.mark.skipif(not NATIVE_BF16, reason="the CPU has no bf16 arithmetic (AVX512-BF16/AMX): "
                                            "bf16 is not a dtype it runs natively")
def test_bundled_model_invariant_in_bfloat16():
    _check_invariance(None, "bfloat16", _workload(8, 300, seed=2), max_tokens=16)
