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

import numpy as np
import pytest
import torch
from engine_helpers import tiny_llama

from pagedllm import LLM, SamplingParams
from pagedllm.platform import has_native_bf16

VOCAB = 49152
NATIVE_BF16 = has_native_bf16()
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn,
             "fp8_e5m2": torch.float8_e5m2}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from pagedllm.tokenizer import get_tokenizer

    model = tiny_llama(VOCAB, rope_theta=10000.0)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path, safe_serialization=True)
    get_tokenizer().save_pretrained(path)
    return str(path)


def _workload(n: int, prefix_len: int, seed: int) -> list[list[int]]:
    """n prompts: one shared random-token prefix, then 5..40 random tokens each."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(100, VOCAB - 100, prefix_len).tolist()
    return [prefix + rng.integers(100, VOCAB - 100, int(rng.integers(5, 40))).tolist() for _ in range(n)]


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _check_invariance(model: str | None, dtype: str, prompts: list[list[int]], max_tokens: int,
                      block_size: int = 16, attention_backend: str = "auto", kv_cache_dtype: str = "auto",
                      **engine_kwargs) -> None:
    """Greedy outputs of ``prompts`` batched, staggered, chunked, prefix-cached and preempted
    equal the same prompts run alone (``engine_kwargs``: more LLM settings for every run,
    e.g. ``quantization``)."""
    # engine_process=False: four engines per call; the process seam is tested in test_engine_process.py
    common = dict(model=model, dtype=dtype, device="cpu", seed=0, max_model_len=1024, block_size=block_size,
                  engine_process=False,
                  attention_backend=attention_backend, kv_cache_dtype=kv_cache_dtype, **engine_kwargs)
    kv_dtype = getattr(torch, dtype) if kv_cache_dtype == "auto" else KV_DTYPES[kv_cache_dtype]
    alone_llm = LLM(**common, enable_prefix_caching=False, kv_cache_memory="256MiB")
    try:
        assert alone_llm.llm_engine.config.dtype == getattr(torch, dtype)
        assert alone_llm.llm_engine.config.kv_cache_dtype == kv_dtype
        alone = [_greedy(alone_llm, [p], max_tokens)[0] for p in prompts]
        # the references are not degenerate: outputs differ between prompts
        assert len({tuple(a) for a in alone}) > len(prompts) // 2
        batched = _greedy(alone_llm, prompts, max_tokens)
        assert batched == alone, "batched outputs differ from the same prompts run alone"
        staggered = _staggered(alone_llm, prompts, max_tokens, gaps=[0, 1, 1, 2, 0, 3, 1, 5])
        assert staggered == alone, "outputs of requests joining mid-decode differ from the lone runs"
    finally:
        alone_llm.shutdown()
    for label, kw in [
        ("chunked prefill (13-token budget)", dict(max_num_batched_tokens=13, enable_prefix_caching=False)),
        ("prefix caching", dict(enable_prefix_caching=True)),
        ("preemption (tiny KV cache)", dict(enable_prefix_caching=True)),
    ]:
        kw = dict(kw)
        if label.startswith("preemption"):
            per_req = -(-(max(len(p) for p in prompts) + max_tokens) // block_size)
            # the shared prefix's full blocks are held once; beyond them, room for the own
            # blocks of two requests at most: the rest wait, and running ones get preempted
            shared = _common_prefix_len(prompts) // block_size
            kw["kv_cache_memory"] = _bytes_for_blocks(model, kv_dtype, shared + 2 * (per_req - shared) + 1,
                                                      block_size)
            kw["max_model_len"] = per_req * block_size
        else:
            kw.setdefault("kv_cache_memory", "256MiB")
        llm = LLM(**{**common, **kw})
        try:
            if kw.get("enable_prefix_caching"):
                _greedy(llm, prompts[:1], 1)      # warm the shared prefix
            before = llm.stats().num_preemptions_total
            got = _greedy(llm, prompts, max_tokens)
            bad = [i for i, (g, r) in enumerate(zip(got, alone)) if g != r]
            assert not bad, (f"{dtype}, {kv_cache_dtype} KV cache, {label}: {len(bad)} of {len(prompts)} outputs "
                             f"differ, e.g. #{bad[0]}")
            if label.startswith("preemption"):
                assert llm.stats().num_preemptions_total > before, "the scenario did not preempt"
            if label.startswith("prefix"):
                assert llm.stats().prefix_cache_hits > 0
        finally:
            llm.shutdown()


def _staggered(llm: LLM, prompts: list[list[int]], max_tokens: int, gaps: list[int]) -> list[list[int]]:
    """Prompt i joins after ``gaps[i]`` more engine steps, while the earlier ones decode
    (through the LLMEngine, one step at a time)."""
    eng = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    done: dict[str, list[int]] = {}
    nxt, wait = 0, gaps[0]
    while nxt < len(prompts) or eng.has_unfinished_requests():
        while nxt < len(prompts) and wait == 0:
            eng.add_request(f"stag-{nxt}", {"prompt_token_ids": prompts[nxt]}, sp)
            nxt += 1
            wait = gaps[nxt] if nxt < len(prompts) else 0
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
        wait = max(wait - 1, 0)
    return [done[f"stag-{i}"] for i in range(len(prompts))]


def _common_prefix_len(prompts: list[list[int]]) -> int:
    n = 0
    while all(len(p) > n and p[n] == prompts[0][n] for p in prompts):
        n += 1
    return n


def _bytes_for_blocks(model, kv_dtype: torch.dtype, blocks: int, block_size: int) -> int:
    from pagedllm.models.loader import load_arch_config
    from pagedllm.utils import default_model_path

    return blocks * load_arch_config(model or default_model_path()).kv_bytes_per_block(block_size, kv_dtype)


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
