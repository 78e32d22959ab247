"""Per-request block tables over the BlockPool, with automatic prefix caching."""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from pagedllm.core.request import Request
from pagedllm.utils import cdiv


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache and tokens found, once per admission (a
    new request, or one back from preemption); cumulative."""

    queries: int = 0
    hits: int = 0
    requests: int = 0


class KVCacheManager:
    """Allocates blocks for requests and finds their cached prefixes.

    A request holds one block table per KV-cache group, all from one pool and all
    ``cdiv(tokens, block_size)`` long. A sliding-window group releases blocks wholly out of
    its window to the null block 0 (vLLM's ``SlidingWindowManager``); prefix-cache keys are
    (group, block hash). ``sliding_windows``: per group, a window in tokens or None (full).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_windows: list[int | None] | None = None):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.windows = list(sliding_windows or [None])
        self.pool = BlockPool(num_blocks, enable_caching)
        # a group that releases blocks points its released entries at the null block
        self.null_block = self.pool.get_new_blocks(1)[0] if any(w is not None for w in self.windows) else None
        self.req_blocks: dict[str, list[list[KVCacheBlock]]] = {}
        # leading blocks of each request already registered in the prefix cache (a held
        # block keeps its hash), so each step registers only the newly full ones
        self.num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def _key(self, group: int, block_hash: bytes):
        """The prefix-cache key of a group's block: the hash itself for group 0."""
        return block_hash if group == 0 else (group, block_hash)

    def _first_useful_block(self, group: int, num_computed: int) -> int:
        """First block a group still needs when the next token is at ``num_computed``
        (0 for a full group)."""
        w = self.windows[group]
        if w is None:
            return 0
        return max(0, num_computed - w + 1) // self.block_size

    # -- hashing -------------------------------------------------------------------
    def update_block_hashes(self, req: Request) -> None:
        """Extend ``req.block_hashes`` over every full block (cache salt in the first)."""
        if not self.enable_caching:
            return
        bs = self.block_size
        n_full = req.num_tokens // bs
        salt = req.sampling_params.cache_salt
        while len(req.block_hashes) < n_full:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if i else None
            extra = (("salt", salt),) if (i == 0 and salt is not None) else ()
            req.block_hashes.append(hash_block_tokens(
                parent, req.all_token_ids[i * bs:(i + 1) * bs], tuple(x for kv in extra for x in kv)))

    # -- admission -------------------------------------------------------------------
    def get_computed_blocks(self, req: Request) -> tuple[list[list[KVCacheBlock]], int]:
        """Longest cached prefix every group can serve (vLLM's ``find_longest_cache_hit``).
        The last token is always left to compute; a ``prompt_logprobs`` request hits nothing.
        Not counted in ``stats`` until ``record_admission``.

        Returns:
            (per group its hit blocks, num_computed_tokens); ([[]] * groups, 0) when
            caching is off.
        """
        none = [[] for _ in self.windows]
        if not self.enable_caching:
            return none, 0
        self.update_block_hashes(req)
        if req.sampling_params.prompt_logprobs is not None:
            return none, 0
        hashes = req.block_hashes[: (req.num_tokens - 1) // self.block_size]
        get = self.pool.get_cached_block
        n = len(hashes)
        for g, w in enumerate(self.windows):       # full groups: the cached chain from the start
            if w is None:
                m = 0
                while m < n and get(self._key(g, hashes[m])) is not None:
                    m += 1
                n = m
        sliding = [g for g, w in enumerate(self.windows) if w is not None]
        while n > 0 and sliding:                   # sliding groups: the window before n
            if all(get(self._key(g, hashes[i])) is not None
                   for g in sliding for i in range(self._first_useful_block(g, n * self.block_size), n)):
                break
            n -= 1
        hit = []
        for g in range(self.num_groups):
            first = self._first_useful_block(g, n * self.block_size)
            hit.append([self.null_block] * first + [get(self._key(g, h)) for h in hashes[first:n]])
        return hit, n * self.block_size

    def record_admission(self, req: Request, num_hit_tokens: int) -> None:
        """Count an admitted request's lookup (``get_computed_blocks``'s ``num_hit_tokens``)
        in ``stats``: once per admission, never for a lookup whose allocation failed (it is
        looked up again). Not counted: caching off, a ``prompt_logprobs`` request."""
        if self.enable_caching and req.sampling_params.prompt_logprobs is None:
            self.stats.requests += 1
            self.stats.queries += req.num_tokens
            self.stats.hits += num_hit_tokens

    def _release_skipped(self, req_id: str, num_computed: int) -> None:
        """Free sliding-window blocks no token from ``num_computed`` on can see."""
        for g, blocks in enumerate(self.req_blocks.get(req_id, ())):
            if self.windows[g] is None:
                continue
            freed = []
            for i in range(min(self._first_useful_block(g, num_computed), len(blocks))):
                b = blocks[i]
                if b is not self.null_block:
                    freed.append(b)
                    blocks[i] = self.null_block
            if freed:
                self.pool.free_blocks(reversed(freed))

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       new_computed_blocks: list[list[KVCacheBlock]] | None = None,
                       num_new_computed_tokens: int = 0,
                       num_lookahead_tokens: int = 0) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` (+ ``num_lookahead_tokens``, never hashed) more
        tokens of ``req`` in every group; ``new_computed_blocks`` / ``num_new_computed_tokens``
        are the admission's prefix hit. Returns the new blocks per group, or None (nothing
        allocated) when too few are free."""
        hits = new_computed_blocks or [[] for _ in self.windows]
        self._release_skipped(req.request_id, req.num_computed_tokens)
        tables = self.req_blocks.setdefault(req.request_id, [[] for _ in self.windows])
        total = req.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        want = cdiv(total + num_lookahead_tokens, self.block_size)
        needs = [max(0, want - len(t) - len(h)) for t, h in zip(tables, hits)]
        # Hit blocks with ref 0 sit in the free queue: taking them shrinks what is free.
        evictable_hits = sum(1 for h in hits for b in h if b.ref_cnt == 0 and b is not self.null_block)
        if sum(needs) > self.pool.num_free_blocks - evictable_hits:
            if not any(tables):
                del self.req_blocks[req.request_id]
            return None
        # Every group's hits leave the free queue before any group takes new blocks: taking
        # them group by group let one group's new blocks evict a later group's hit.
        for h in hits:
            self.pool.touch(b for b in h if b is not self.null_block)
        new_blocks = []
        for t, h, need in zip(tables, hits, needs):
            t.extend(h)
            got = self.pool.get_new_blocks(need) if need > 0 else []
            t.extend(got)
            new_blocks += got
        if self.enable_caching:
            self.update_block_hashes(req)
            n_full = min(total // self.block_size, len(req.block_hashes))
            for i in range(self.num_cached_blocks.get(req.request_id, 0), n_full):
                for g, t in enumerate(tables):
                    if t[i] is not self.null_block:
                        self.pool.cache_block(t[i], self._key(g, req.block_hashes[i]))
            self.num_cached_blocks[req.request_id] = n_full
        return new_blocks

    def free_tail(self, req: Request, num_tokens: int) -> int:
        """Release blocks past the first ``cdiv(num_tokens, block_size)`` per group (rejected
        drafts, unused lookahead; never cached); returns entries each table lost."""
        tables = self.req_blocks.get(req.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if not tables or len(tables[0]) <= keep:
            return 0
        assert self.num_cached_blocks.get(req.request_id, 0) <= keep
        n = len(tables[0]) - keep
        for t in tables:
            tail = [b for b in t[keep:] if b is not self.null_block]
            del t[keep:]
            self.pool.free_blocks(reversed(tail))
        return n

    def free(self, req: Request) -> None:
        """Release the request's blocks tail first (evict deepest blocks first)."""
        tables = self.req_blocks.pop(req.request_id, None)
        self.num_cached_blocks.pop(req.request_id, None)
        for t in tables or ():
            self.pool.free_blocks(reversed([b for b in t if b is not self.null_block]))

    def get_block_ids(self, req_id: str, group: int = 0) -> list[int]:
        """The block ids of one group's table of ``req_id`` ([] if it holds none)."""
        tables = self.req_blocks.get(req_id)
        return [b.block_id for b in tables[group]] if tables else []

    def get_group_block_ids(self, req_id: str) -> list[list[int]]:
        """Every group's block ids of ``req_id``, group 0 first."""
        tables = self.req_blocks.get(req_id)
        return [[b.block_id for b in t] for t in tables] if tables else [[] for _ in self.windows]

    def group_block_ids_from(self, req_id: str, start: int) -> list[list[int]]:
        """Every group's block ids of ``req_id`` from table entry ``start`` on."""
        tables = self.req_blocks.get(req_id)
        return [[b.block_id for b in t[start:]] for t in tables] if tables else [[] for _ in self.windows]

    def num_table_entries(self, req_id: str) -> int:
        """Length of ``req_id``'s block tables (the same in every group)."""
        tables = self.req_blocks.get(req_id)
        return len(tables[0]) if tables else 0

    def num_held_blocks(self, req_id: str) -> int:
        """Blocks ``req_id`` holds over all groups (null entries not counted)."""
        return sum(1 for t in self.req_blocks.get(req_id, ()) for b in t if b is not self.null_block)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        """Blocks requests can hold (the null block, when there is one, is not counted)."""
        return self.pool.num_blocks - (self.null_block is not None)

    def usage(self) -> float:
        """Fraction of the usable blocks held by requests, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()
