"""Automatic prefix caching on the real model: identical greedy outputs with caching on
and off, exact hit counts, eviction under a small cache, cache_salt isolation, hash
chains, and reset."""
from __future__ import annotations

import random

import pytest

from pagedllm import SamplingParams
from engine_helpers import engine_core, greedy

BS = 16


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text)


@pytest.fixture(scope="module")
def system_prompts():
    base = ("You are a careful assistant for a travel company. Answer briefly, cite the policy "
            "section you rely on, and never invent prices. ")
    return [
        "You are a helpful assistant.",
        base * 2,
        base * 5 + "Policies: refunds within 30 days; changes cost 20 euros; pets travel free.",
    ]


@pytest.fixture(scope="module")
def chat_prompts(system_prompts):
    questions = [f"Question {i}: what should I pack for a trip to city number {i}?" for i in range(50)]
    return [f"<|im_start|>system\n{system_prompts[i % 3]}<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n"
            f"<|im_start|>assistant\n" for i, q in enumerate(questions)]


@pytest.fixture(scope="module")
def reference(make_llm, chat_prompts):
    """Greedy outputs with prefix caching off (one batch)."""
    off = make_llm(max_model_len=1024, kv_cache_memory="512MiB", enable_prefix_caching=False)
    outs = off.generate(chat_prompts, greedy(12), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow
def test_outputs_identical_with_caching_on_and_off(llm, chat_prompts, reference):
    llm.reset_prefix_cache()
    n = len(chat_prompts)
    rng = random.Random(0)
    orders = {
        "in order, one batch": [list(range(n))],
        "reversed, batches of 7": [list(range(n))[::-1][i:i + 7] for i in range(0, n, 7)],
        "shuffled, batches of 1..9": None,
    }
    shuffled = list(range(n))
    rng.shuffle(shuffled)
    batches, i = [], 0
    while i < n:
        k = rng.randint(1, 9)
        batches.append(shuffled[i:i + k])
        i += k
    orders["shuffled, batches of 1..9"] = batches
    q0, h0 = llm.stats().prefix_cache_queries, llm.stats().prefix_cache_hits
    for name, batches in orders.items():
        got = {}
        for b in batches:
            outs = llm.generate([chat_prompts[j] for j in b], greedy(12), use_tqdm=False)
            got.update({j: o.outputs[0].token_ids for j, o in zip(b, outs)})
        mismatched = [j for j in range(n) if got[j] != reference[j]]
        assert not mismatched, f"{name}: outputs differ from caching-off for requests {mismatched}"
    st = llm.stats()
    assert st.prefix_cache_hits - h0 > 0.5 * (st.prefix_cache_queries - q0)  # the cache really served


def test_exact_hit_counts(llm):
    llm.reset_prefix_cache()
    prefix = list(range(1000, 1064))  # 64 tokens = 4 blocks
    first = llm.generate([prefix + [7, 8, 9]], greedy(4), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    q0, h0 = llm.stats().prefix_cache_queries, llm.stats().prefix_cache_hits
    suffixes = [[11, 12, 13], [21, 22, 23, 24, 25], [31] * 20]
    outs = llm.generate([prefix + s for s in suffixes], greedy(4), use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [64, 64, 64]
    st = llm.stats()
    assert st.prefix_cache_hits - h0 == 3 * 64
    assert st.prefix_cache_queries - q0 == sum(64 + len(s) for s in suffixes)
    # a prompt that is exactly the 64-token prefix: the last token is always recomputed,
    # so only the first 3 blocks (48 tokens) can be served
    exact = llm.generate([prefix], greedy(4), use_tqdm=False)[0]
    assert exact.num_cached_tokens == 48
    # ...and its output equals the uncached computation
    llm.reset_prefix_cache()
    assert llm.generate([prefix], greedy(4), use_tqdm=False)[0].outputs[0].token_ids == exact.outputs[0].token_ids


def test_fully_cached_prompt_equals_uncached(llm, tokenizer):
    llm.reset_prefix_cache()
    prompt = _ids(tokenizer, "Here is a long story about a lighthouse keeper and the storm that " * 6)
    a = llm.generate([prompt], greedy(16), use_tqdm=False)[0]
    b = llm.generate([prompt], greedy(16), use_tqdm=False)[0]
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == ((len(prompt) - 1) // BS) * BS
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_first_token_difference_shares_nothing(llm):
    llm.reset_prefix_cache()
    body = list(range(2000, 2080))
    llm.generate([[5] + body], greedy(2), use_tqdm=False)
    out = llm.generate([[6] + body], greedy(2), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0  # hash chains: every later block depends on block 0


def test_cache_salt_isolates_tenants(llm):
    llm.reset_prefix_cache()
    prompt = list(range(3000, 3070))
    sp = lambda salt: SamplingParams(temperature=0, max_tokens=2, cache_salt=salt)  # noqa: E731
    assert llm.generate([prompt], sp("tenant-a"), use_tqdm=False)[0].num_cached_tokens == 0
    assert llm.generate([prompt], sp("tenant-b"), use_tqdm=False)[0].num_cached_tokens == 0
    assert llm.generate([prompt], greedy(2), use_tqdm=False)[0].num_cached_tokens == 0  # no salt
    assert llm.generate([prompt], sp("tenant-a"), use_tqdm=False)[0].num_cached_tokens == 64
    assert llm.generate([prompt], greedy(2), use_tqdm=False)[0].num_cached_tokens == 64
    # the generate() argument sets the salt for prompts that have none
    assert llm.generate([prompt], greedy(2), use_tqdm=False, cache_salt="tenant-b")[0].num_cached_tokens == 64
    assert llm.generate([prompt], greedy(2), use_tqdm=False, cache_salt="tenant-c")[0].num_cached_tokens == 0


def test_reset_prefix_cache(llm):
    prompt = list(range(4000, 4040))
    llm.generate([prompt], greedy(2), use_tqdm=False)
    assert llm.generate([prompt], greedy(2), use_tqdm=False)[0].num_cached_tokens == 32
    assert llm.reset_prefix_cache() > 0
    assert llm.generate([prompt], greedy(2), use_tqdm=False)[0].num_cached_tokens == 0


@pytest.mark.slow
def test_eviction_under_small_cache(make_llm):
    """A cache of 24 blocks (384 tokens) cannot keep every prompt: least recently used
    blocks are evicted, outputs stay equal to the uncached ones, counts stay consistent."""
    small = make_llm(max_model_len=256, num_gpu_blocks_override=24)
    ref = make_llm(max_model_len=256, num_gpu_blocks_override=24, enable_prefix_caching=False)
    prompts = [[100 + 10 * i + j for j in range(96)] for i in range(8)]  # 6 blocks each, distinct
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, greedy(8), use_tqdm=False)]
    small.reset_prefix_cache()
    for p, w in zip(prompts, want):  # one at a time: each fills 6-7 blocks
        assert small.generate([p], greedy(8), use_tqdm=False)[0].outputs[0].token_ids == w
    # The most recent prompts are still cached; the oldest were evicted (LRU).
    q0, h0 = small.stats().prefix_cache_queries, small.stats().prefix_cache_hits
    newest = small.generate([prompts[-1]], greedy(8), use_tqdm=False)[0]
    assert newest.num_cached_tokens == 80 and newest.outputs[0].token_ids == want[-1]
    oldest = small.generate([prompts[0]], greedy(8), use_tqdm=False)[0]
    assert oldest.num_cached_tokens == 0 and oldest.outputs[0].token_ids == want[0]
    st = small.stats()
    assert st.prefix_cache_hits - h0 == 80 and st.prefix_cache_queries - q0 == 192
    # Everything again, in a batch that needs more blocks than are free: still correct.
    outs = small.generate(prompts, greedy(8), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert all(o.num_cached_tokens % BS == 0 and o.num_cached_tokens <= 95 for o in outs)
    kv = engine_core(small.llm_engine).kv
    assert kv.num_free_blocks == kv.num_blocks
    assert len(kv.pool.cached) <= kv.num_blocks
