"""Per-request block tables over the BlockPool, with automatic prefix caching."""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from pagedllm.core.request import Request
from pagedllm.utils import cdiv


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache and tokens found (cumulative)."""

    queries: int = 0
    hits: int = 0
    requests: int = 0


class KVCacheManager:
    """Allocates blocks for requests and finds their cached prefixes.

    Args:
        num_blocks: blocks in the pool; block_size: tokens per block.
        enable_caching: reuse full blocks across requests by hash.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        # leading blocks of each request already registered in the prefix cache (a held
        # block keeps its hash), so each step registers only the newly full ones
        self.num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    # -- hashing -------------------------------------------------------------------
    def update_block_hashes(self, req: Request) -> None:
        """Extend ``req.block_hashes`` to cover every full block of its known tokens.
        The cache salt enters the first block's hash, and so every later one's."""
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
    def get_computed_blocks(self, req: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest chain of cached blocks that prefixes the request's tokens.

        At least the last token is always left to compute (its logits are needed), so a
        fully cached prompt of exactly k blocks hits k-1 of them.

        A request that asks for ``prompt_logprobs`` hits nothing (as in vLLM): the
        logprobs of its prompt tokens need their positions computed. Its blocks are still
        hashed, and cached for others.

        Returns:
            (blocks, num_computed_tokens); ([], 0) when caching is off.
        """
        if not self.enable_caching:
            return [], 0
        self.update_block_hashes(req)
        if req.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        hit: list[KVCacheBlock] = []
        for h in req.block_hashes[:max_blocks]:
            b = self.pool.get_cached_block(h)
            if b is None:
                break
            hit.append(b)
        n = len(hit) * self.block_size
        self.stats.requests += 1
        self.stats.queries += req.num_tokens
        self.stats.hits += n
        return hit, n

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_new_computed_tokens: int = 0,
                       num_lookahead_tokens: int = 0) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens of ``req``.

        Args:
            num_new_tokens: tokens to compute this step (after any cache hit; with
                speculative decoding, the next token and the drafts to verify).
            new_computed_blocks / num_new_computed_tokens: the prefix-cache hit returned by
                ``get_computed_blocks`` at admission (else empty / 0).
            num_lookahead_tokens: slots reserved past those (a draft model writes its
                proposals' K/V there after the step); never hashed.

        Returns:
            The newly allocated blocks, or None when not enough blocks are free (nothing
            is changed then; the caller preempts or waits).
        """
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_blocks.setdefault(req.request_id, [])
        total = req.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        need = cdiv(total + num_lookahead_tokens, self.block_size) - len(blocks) - len(new_computed_blocks)
        # Hit blocks with ref 0 sit in the free queue: taking them shrinks what is free.
        evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - evictable_hits:
            if not blocks:
                del self.req_blocks[req.request_id]
            return None
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(need) if need > 0 else []
        blocks.extend(new_blocks)
        if self.enable_caching:
            self.update_block_hashes(req)
            n_full = min(total // self.block_size, len(req.block_hashes))
            for i in range(self.num_cached_blocks.get(req.request_id, 0), n_full):
                self.pool.cache_block(blocks[i], req.block_hashes[i])
            self.num_cached_blocks[req.request_id] = n_full
        return new_blocks

    def free_tail(self, req: Request, num_tokens: int) -> int:
        """Release the request's blocks past the first ``cdiv(num_tokens, block_size)``
        (slots of rejected draft tokens and unused lookahead); returns how many. Such
        blocks hold no full block of known tokens, so none is in the prefix cache."""
        blocks = self.req_blocks.get(req.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if not blocks or len(blocks) <= keep:
            return 0
        tail = blocks[keep:]
        del blocks[keep:]
        assert self.num_cached_blocks.get(req.request_id, 0) <= keep
        self.pool.free_blocks(reversed(tail))
        return len(tail)

    def free(self, req: Request) -> None:
        """Release the request's blocks, tail first, so that eviction takes a chain's
        deepest blocks before its shared parents."""
        blocks = self.req_blocks.pop(req.request_id, None)
        self.num_cached_blocks.pop(req.request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def get_block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(req_id, ())]

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()
