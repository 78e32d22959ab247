"""KVCacheManager: block accounting and automatic prefix caching (no model needed)."""
from __future__ import annotations

import pytest

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams

BS = 16
PREFIX = list(range(1000, 1064))           # 64 tokens = 4 full blocks


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8, cache_salt=salt), eos_token_ids=set())


def admit(kv: KVCacheManager, r: Request) -> int:
    """Admit a request as the scheduler does (cache lookup, allocate the whole prompt, count
    the lookup); returns the number of prompt tokens found in the cache."""
    hit_blocks, n_hit = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - n_hit, hit_blocks, n_hit) is not None
    kv.record_admission(r, n_hit)
    r.num_computed_tokens = r.num_tokens
    return n_hit


def test_allocate_and_free_accounting():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=False)
    a = req("a", list(range(40)))            # 40 tokens → 3 blocks
    new = kv.allocate_slots(a, 40)
    assert len(new) == 3 and kv.num_free_blocks == 7
    assert kv.get_block_ids("a") == [b.block_id for b in new]
    a.num_computed_tokens = 40
    # Growing to 48 tokens fits the third block; the 49th needs a fourth.
    assert kv.allocate_slots(a, 8) == [] and kv.num_free_blocks == 7
    a.num_computed_tokens = 48
    assert len(kv.allocate_slots(a, 1)) == 1 and kv.num_free_blocks == 6
    assert len(kv.get_block_ids("a")) == 4
    b = req("b", list(range(200, 300)))      # 100 tokens → 7 blocks > 6 free
    assert kv.allocate_slots(b, 100) is None
    assert kv.num_free_blocks == 6 and kv.get_block_ids("b") == [] and "b" not in kv.req_blocks
    assert len(kv.allocate_slots(b, 96)) == 6 and kv.num_free_blocks == 0
    assert not set(kv.get_block_ids("a")) & set(kv.get_block_ids("b"))
    kv.free(a)
    assert kv.num_free_blocks == 4 and kv.get_block_ids("a") == []
    kv.free(b)
    kv.free(b)                               # freeing an unknown/finished request is a no-op
    assert kv.num_free_blocks == kv.num_blocks == 10
    assert kv.usage() == 0.0


def test_shared_prefix_hits_exactly_64_tokens():
    kv = KVCacheManager(num_blocks=64, block_size=BS)
    reqs = [req(f"r{i}", PREFIX + [2000 + 10 * i + j for j in range(7 + i)]) for i in range(4)]
    hits = [admit(kv, r) for r in reqs]
    assert hits == [0, 64, 64, 64]
    # The hit blocks are the very blocks of the first request, now shared.
    first = kv.get_block_ids("r0")[:4]
    for r in reqs[1:]:
        assert kv.get_block_ids(r.request_id)[:4] == first
    shared = kv.req_blocks["r0"][0][:4]
    assert [b.ref_cnt for b in shared] == [4, 4, 4, 4]
    # Each request's own tail block is private.
    tails = {kv.get_block_ids(r.request_id)[4] for r in reqs}
    assert len(tails) == 4
    assert kv.num_free_blocks == 64 - 4 - 4
    assert (kv.stats.queries, kv.stats.hits) == (sum(r.num_tokens for r in reqs), 3 * 64)
    for r in reqs:
        kv.free(r)
    assert kv.num_free_blocks == 64
    # Freed blocks keep their hashes: a new request still hits the prefix.
    assert admit(kv, req("late", PREFIX + [5, 6, 7])) == 64


def test_prompt_of_exactly_64_tokens_hits_48():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    admit(kv, req("a", PREFIX + [1, 2, 3]))
    # The last token must be computed for its logits, so the 4th block is not used.
    assert admit(kv, req("b", list(PREFIX))) == 48
    assert admit(kv, req("c", PREFIX[:17])) == 16
    assert admit(kv, req("d", PREFIX[:16])) == 0


def test_different_cache_salt_never_hits():
    kv = KVCacheManager(num_blocks=64, block_size=BS)
    toks = PREFIX + [7, 8, 9]
    assert admit(kv, req("a", toks, salt="alice")) == 0
    assert admit(kv, req("b", toks, salt="bob")) == 0
    assert admit(kv, req("c", toks)) == 0            # unsalted does not see salted blocks
    assert admit(kv, req("d", toks, salt="alice")) == 64
    assert admit(kv, req("e", toks, salt="bob")) == 64
    assert admit(kv, req("f", toks)) == 64


def test_prompts_differing_only_in_first_token_share_nothing():
    kv = KVCacheManager(num_blocks=64, block_size=BS)
    admit(kv, req("a", [1] + PREFIX[1:] + [5]))
    assert admit(kv, req("b", [2] + PREFIX[1:] + [5])) == 0
    assert not set(kv.get_block_ids("a")) & set(kv.get_block_ids("b"))


def test_hit_on_free_cached_blocks_counts_against_free_space():
    # 6 blocks: a 64+3-token request uses 5; once freed, its 4 prefix blocks are cached but
    # free. A new request hitting them needs those 4 plus 1 new block, which must fit.
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = req("a", PREFIX + [1, 2, 3])
    admit(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 6
    b = req("b", PREFIX + [9] * 40)          # 104 tokens → 7 blocks: 4 hit + 3 new
    hit_blocks, n_hit = kv.get_computed_blocks(b)
    assert n_hit == 64
    # 3 new blocks are needed, but taking the 4 hit blocks leaves only 6 - 4 = 2 free.
    assert kv.allocate_slots(b, b.num_tokens - n_hit, hit_blocks, n_hit) is None
    assert kv.num_free_blocks == 6 and all(blk.ref_cnt == 0 for blk in hit_blocks[0])
    # With 2 new blocks (a 96-token chunk) it fits, and nothing is double-counted.
    assert len(kv.allocate_slots(b, 32, hit_blocks, n_hit)) == 2
    assert kv.num_free_blocks == 0
    kv.free(b)
    assert kv.num_free_blocks == 6


def test_eviction_takes_the_deepest_block_of_a_chain_first():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = req("a", PREFIX + [1])               # 65 tokens: blocks 0-4, the first 4 cached
    admit(kv, a)
    assert kv.get_block_ids("a") == [0, 1, 2, 3, 4]
    kv.free(a)                               # tail first, after the never-used block 5
    assert [b.block_id for b in kv.pool.free_queue] == [5, 4, 3, 2, 1, 0]
    other = req("o", [7] * 20)
    assert [b.block_id for b in kv.allocate_slots(other, 20)] == [5, 4]   # 4 held no hash
    assert kv.get_computed_blocks(req("b", PREFIX + [2]))[1] == 64
    other.num_computed_tokens = 20
    assert [b.block_id for b in kv.allocate_slots(other, 16)] == [3]      # the deepest
    assert kv.get_computed_blocks(req("c", PREFIX + [3]))[1] == 48
    kv.free(other)
    assert kv.num_free_blocks == 6


def test_generated_tokens_fill_cacheable_blocks():
    # Output tokens are hashed too: a prompt that continues a finished request's full
    # (prompt + output) blocks hits them.
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = req("a", PREFIX[:20])
    admit(kv, a)
    for t in range(12):                      # decode 12 tokens → 32 tokens = 2 full blocks
        a.append_output_token(3000 + t)
        assert kv.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
    kv.free(a)
    assert admit(kv, req("b", a.all_token_ids + [1])) == 32


def test_caching_disabled_never_hits():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=False)
    admit(kv, req("a", PREFIX + [1]))
    assert admit(kv, req("b", PREFIX + [1])) == 0
    assert kv.get_computed_blocks(req("c", PREFIX + [1])) == ([[]], 0)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 31, 32, 33])
def test_blocks_needed_is_ceil(n):
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    kv.allocate_slots(req("a", list(range(n))), n)
    assert len(kv.get_block_ids("a")) == -(-n // BS)


@pytest.mark.parametrize("spare", range(1, 6))
def test_a_hit_of_one_group_is_never_another_groups_new_block(spare):
    """A full-attention group and a sliding-window group (Gemma 3's layout). Request a's
    blocks are freed, then the never-used blocks are taken and given back behind them, so a's
    cached blocks head the free queue: group 0's first new blocks for b (a's prompt and more)
    come from there, right before group 1's hits (a's blocks 3 and 4 in group 1). Every
    group's hits must leave the queue before any group takes new blocks, or group 1's hit is
    handed to group 0 as new (one block in two places: the helper's Gemma 3 repro)."""
    kv = KVCacheManager(num_blocks=13 + spare, block_size=BS, sliding_windows=[None, 32])
    prompt = list(range(2000, 2000 + 5 * BS + 3))        # 5 full blocks and 3 tokens
    a = req("a", prompt)
    admit(kv, a)
    kv.free(a)                                            # 12 blocks, cached ones at ref 0
    fillers = []
    while kv.num_free_blocks > 12:                        # the never-used blocks...
        f = req(f"f{len(fillers)}", list(range(5000 + 100 * len(fillers), 5000 + 100 * len(fillers) + 8)))
        assert kv.allocate_slots(f, f.num_tokens) is not None
        fillers.append(f)
    for f in fillers:                                     # ...go back behind a's
        kv.free(f)
    b = req("b", prompt + list(range(9000, 9000 + 2 * BS)))
    hit_blocks, n_hit = kv.get_computed_blocks(b)
    assert n_hit == 5 * BS
    assert kv.allocate_slots(b, b.num_tokens - n_hit, hit_blocks, n_hit) is not None
    tables = kv.get_group_block_ids("b")
    ids = [bid for t in tables for bid in t if bid != kv.null_block.block_id]
    assert len(ids) == len(set(ids)), f"a block in two places: {tables}"
    assert tables[1][3:5] == [blk.block_id for blk in hit_blocks[1][3:5]]
    assert kv.num_free_blocks == spare - 1                # 2 x 8 entries, 3 null, 7 hits: 6 new
