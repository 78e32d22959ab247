"""KV-cache blocks, the free queue and the prefix-cache hash table (after vLLM V1's).

Blocks are reference-counted; at zero a block joins the free queue keeping its hash (a
prefix hit revives it) until popped for reuse. Eviction order: least recently freed first.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int],
                      extra_keys: tuple = ()) -> bytes:
    """32-byte SHA-256 of one full block: parent digest (zeros for the first), token count
    and ids as LE int64, then each extra key as UTF-8 length + bytes. Why SHA-256:
    docs/notes/core.md."""
    h = hashlib.sha256()
    h.update(parent_hash if parent_hash is not None else b"\x00" * 32)
    h.update(struct.pack(f"<q{len(token_ids)}q", len(token_ids), *token_ids))
    for key in extra_keys:
        b = str(key).encode("utf-8")
        h.update(struct.pack("<q", len(b)))
        h.update(b)
    return h.digest()


class KVCacheBlock:
    """One block: id, reference count, prefix-cache hash (when full and cached), and
    links of the doubly linked free queue."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked free list: O(1) pop-front, append and remove-from-middle."""

    def __init__(self, blocks: Iterable[KVCacheBlock]):
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.head.next_free, self.tail.prev_free = self.tail, self.head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def append(self, b: KVCacheBlock) -> None:
        last = self.tail.prev_free
        last.next_free, b.prev_free = b, last
        b.next_free, self.tail.prev_free = self.tail, b
        self.num_free += 1

    def remove(self, b: KVCacheBlock) -> None:
        b.prev_free.next_free = b.next_free
        b.next_free.prev_free = b.prev_free
        b.prev_free = b.next_free = None
        self.num_free -= 1

    def popleft(self) -> KVCacheBlock:
        b = self.head.next_free
        if b is self.tail:
            raise RuntimeError("no free KV-cache block")
        self.remove(b)
        return b

    def __iter__(self):
        b = self.head.next_free
        while b is not self.tail:
            yield b
            b = b.next_free


class BlockPool:
    """All KV-cache blocks, allocated once; ``enable_caching`` keeps full blocks' hashes."""

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached-but-unreferenced ones included)."""
        return self.free_queue.num_free

    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop ``n`` blocks from the free queue (evicting any hash they held), ref 1 each.

        Raises:
            RuntimeError: fewer than ``n`` free blocks (callers check first).
        """
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} KV blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            b = self.free_queue.popleft()
            if b.block_hash is not None:
                if self.cached.get(b.block_hash) is b:
                    del self.cached[b.block_hash]
                b.block_hash = None
            b.ref_cnt = 1
            out.append(b)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found in the prefix cache (leave the free queue at 0)."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference on each block, in eviction order (first = evicted first)."""
        for b in ordered_blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue.append(b)
            elif b.ref_cnt < 0:
                raise RuntimeError(f"double free of {b}")

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Register a full block under its hash (first writer wins on duplicates)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        self.cached.setdefault(block_hash, block)

    def reset_prefix_cache(self) -> int:
        """Drop the hash of every block no request holds; returns how many."""
        dropped = 0
        for b in self.free_queue:
            if b.block_hash is not None:
                if self.cached.get(b.block_hash) is b:
                    del self.cached[b.block_hash]
                b.block_hash = None
                dropped += 1
        return dropped
