"""The batch-invariance check of test_dtype_invariance.py, shared with the quantization
tests: greedy outputs of a workload batched, staggered, chunked, prefix-cached and
preempted equal the same prompts run alone, on engines built for the call."""
from __future__ import annotations

import numpy as np
import torch

from pagedllm import LLM, SamplingParams

VOCAB = 49152
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn,
             "fp8_e5m2": torch.float8_e5m2}


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
