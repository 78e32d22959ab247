"""BlockPool, FreeBlockQueue and the prefix-cache block hash (no model needed)."""
from __future__ import annotations

import hashlib
import struct

import pytest

from pagedllm.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock, hash_block_tokens


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


# -- FreeBlockQueue ------------------------------------------------------------------------
def test_free_queue_is_fifo_and_counts():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.num_free == 5
    assert ids(q) == [0, 1, 2, 3, 4]
    assert q.popleft().block_id == 0
    assert q.popleft().block_id == 1
    q.append(blocks[0])
    assert ids(q) == [2, 3, 4, 0]
    assert q.num_free == 4


def test_free_queue_remove_from_middle_and_ends():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert ids(q) == [0, 1, 3, 4] and q.num_free == 4
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    q.remove(blocks[0])
    q.remove(blocks[4])
    assert ids(q) == [1, 3] and q.num_free == 2
    assert q.popleft().block_id == 1
    assert q.popleft().block_id == 3
    assert q.num_free == 0 and list(q) == []
    with pytest.raises(RuntimeError):
        q.popleft()


# -- BlockPool --------------------------------------------------------------------------------
def test_pool_rejects_zero_blocks():
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0)


def test_pool_lru_order_follows_free_order():
    pool = BlockPool(6)
    a = pool.get_new_blocks(4)
    assert ids(a) == [0, 1, 2, 3]
    assert all(b.ref_cnt == 1 for b in a)
    assert pool.num_free_blocks == 2
    assert pool.usage() == pytest.approx(4 / 6)
    # Free in the order 2, 0, 3, 1: they are reused after the never-used 4, 5, in that order.
    pool.free_blocks([a[2], a[0]])
    pool.free_blocks([a[3], a[1]])
    assert pool.num_free_blocks == 6 and pool.usage() == 0.0
    assert ids(pool.get_new_blocks(6)) == [4, 5, 2, 0, 3, 1]


def test_pool_get_new_blocks_over_capacity_raises_and_changes_nothing():
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1


def test_touch_takes_cached_free_block_out_of_the_middle():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(5)
    h = hash_block_tokens(None, [1, 2, 3])
    pool.cache_block(blocks[2], h)
    pool.free_blocks(blocks)                  # queue: 0 1 2 3 4, block 2 still cached
    assert pool.get_cached_block(h) is blocks[2]
    pool.touch([blocks[2]])
    assert blocks[2].ref_cnt == 1
    assert ids(pool.free_queue) == [0, 1, 3, 4]
    assert pool.num_free_blocks == 4
    # A second holder only bumps the count; it does not touch the queue.
    pool.touch([blocks[2]])
    assert blocks[2].ref_cnt == 2 and pool.num_free_blocks == 4
    pool.free_blocks([blocks[2]])
    assert blocks[2].ref_cnt == 1 and pool.num_free_blocks == 4
    pool.free_blocks([blocks[2]])
    assert ids(pool.free_queue) == [0, 1, 3, 4, 2]
    # The cache hit survives being freed again (the hash is kept until reuse).
    assert pool.get_cached_block(h) is blocks[2]


def test_eviction_on_reuse_drops_the_hash():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    ha, hb = hash_block_tokens(None, [1]), hash_block_tokens(None, [2])
    pool.cache_block(a, ha)
    pool.cache_block(b, hb)
    pool.free_blocks([a, b])
    assert pool.get_cached_block(ha) is a and pool.get_cached_block(hb) is b
    (new,) = pool.get_new_blocks(1)           # evicts the least recently freed: a
    assert new is a
    assert a.block_hash is None and pool.get_cached_block(ha) is None
    assert pool.get_cached_block(hb) is b and b.block_hash == hb


def test_double_free_raises():
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([b])


def test_cache_block_first_writer_wins_and_caching_off():
    pool = BlockPool(3)
    a, b, c = pool.get_new_blocks(3)
    h = hash_block_tokens(None, [7, 7])
    pool.cache_block(a, h)
    pool.cache_block(b, h)                    # duplicate content: the table keeps a
    assert pool.get_cached_block(h) is a
    # Evicting the duplicate b must not remove a's entry.
    pool.free_blocks([b])
    pool.get_new_blocks(1)
    assert pool.get_cached_block(h) is a
    off = BlockPool(2, enable_caching=False)
    (x,) = off.get_new_blocks(1)
    off.cache_block(x, h)
    assert off.get_cached_block(h) is None and x.block_hash is None


def test_reset_prefix_cache_only_drops_free_blocks():
    pool = BlockPool(3)
    a, b, c = pool.get_new_blocks(3)
    hs = [hash_block_tokens(None, [i]) for i in range(3)]
    for blk, h in zip((a, b, c), hs):
        pool.cache_block(blk, h)
    pool.free_blocks([a, b])                  # c is still held
    assert pool.reset_prefix_cache() == 2
    assert pool.get_cached_block(hs[0]) is None and pool.get_cached_block(hs[1]) is None
    assert pool.get_cached_block(hs[2]) is c
    assert pool.reset_prefix_cache() == 0


# -- hash_block_tokens --------------------------------------------------------------------
def _reference_hash(parent, tokens, extra=()):
    """The serialization the docstring specifies, written out independently."""
    h = hashlib.sha256()
    h.update(parent if parent is not None else bytes(32))
    h.update(len(tokens).to_bytes(8, "little", signed=True))
    for t in tokens:
        h.update(int(t).to_bytes(8, "little", signed=True))
    for k in extra:
        b = str(k).encode("utf-8")
        h.update(struct.pack("<q", len(b)) + b)
    return h.digest()


def test_block_hash_matches_specified_serialization():
    toks = list(range(100, 116))
    h0 = hash_block_tokens(None, toks)
    assert len(h0) == 32
    assert h0 == _reference_hash(None, toks)
    h1 = hash_block_tokens(h0, [5] * 16, ("salt", "abc"))
    assert h1 == _reference_hash(h0, [5] * 16, ("salt", "abc"))
    assert hash_block_tokens(None, [0] * 16, ("salt", "한국어")) == _reference_hash(None, [0] * 16, ("salt", "한국어"))


def test_block_hash_depends_on_parent_tokens_and_extra_keys():
    toks = list(range(16))
    base = hash_block_tokens(None, toks)
    assert hash_block_tokens(None, list(toks)) == base               # deterministic
    assert hash_block_tokens(hash_block_tokens(None, [1]), toks) != base
    assert hash_block_tokens(None, toks[:-1] + [99]) != base
    assert hash_block_tokens(None, toks, ("salt", "a")) != base
    assert hash_block_tokens(None, toks, ("salt", "a")) != hash_block_tokens(None, toks, ("salt", "b"))
    # Length-prefixed: ("ab", "c") and ("a", "bc") must not collide.
    assert hash_block_tokens(None, toks, ("ab", "c")) != hash_block_tokens(None, toks, ("a", "bc"))
