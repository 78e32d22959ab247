"""SuffixDecoding (speculative method ``"suffix"``; Oliaro et al. 2024, arXiv:2411.04975),
after Arctic Inference's ``SuffixDecodingCache``: drafts from a per-request suffix tree
and a global tree over recent responses. Algorithm and cost: docs/notes/spec-decode.md."""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import numpy as np

from pagedllm.spec_decode.suffix_tree import SuffixTree, TokenSeq

# Known tokens compared at each end of a request's sequence to notice a reused request id
# (a full compare would cost O(n) per step; a stale tree only makes worse drafts).
_REUSE_CHECK_TOKENS = 8


class _RequestState:
    __slots__ = ("tree", "seq", "num_prompt_tokens")

    def __init__(self, max_depth: int):
        self.tree = SuffixTree(max_depth)
        self.seq = TokenSeq()
        self.num_prompt_tokens = 0


class SuffixProposer:
    """SuffixDecoding proposer. Args: ``num_speculative_tokens`` (k); ``max_tree_depth``;
    ``max_cached_requests`` (0: no global tree); ``max_spec_factor`` (an m-token match
    proposes at most that times m); ``min_token_prob`` (the path-probability floor).

    Raises:
        ValueError: naming the ``speculative_config`` key that is out of range."""

    def __init__(self, num_speculative_tokens: int, max_tree_depth: int = 24, max_cached_requests: int = 1000,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1):
        checks = [("num_speculative_tokens", num_speculative_tokens, num_speculative_tokens >= 1, ">= 1"),
                  ("suffix_decoding_max_tree_depth", max_tree_depth, max_tree_depth >= 1, ">= 1"),
                  ("suffix_decoding_max_cached_requests", max_cached_requests, max_cached_requests >= 0, ">= 0"),
                  ("suffix_decoding_max_spec_factor", max_spec_factor, max_spec_factor >= 0, ">= 0"),
                  ("suffix_decoding_min_token_prob", min_token_prob, 0 <= min_token_prob <= 1, "in [0, 1]")]
        for key, value, ok, want in checks:
            if not ok:
                raise ValueError(f"speculative_config.{key} must be {want}, got {value}")
        self.k = num_speculative_tokens
        self.max_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._requests: dict[str, _RequestState] = {}
        self._global = SuffixTree(max_tree_depth)
        self._cached: deque[TokenSeq] = deque()   # responses in the global tree, oldest first

    @property
    def num_cached_responses(self) -> int:
        return len(self._cached)

    def propose(self, req_ids: list[str], token_ids: list[np.ndarray], num_prompt_tokens: list[int],
                num_tokens_wanted: list[int]) -> list[list[int]]:
        """Per request: tokens so far (int32 1-D, read only), prompt length, most tokens wanted
        (0: none). Returns per request 0..min(k, num_tokens_wanted[i]) token ids."""
        out = []
        for req_id, seq, num_prompt, want in zip(req_ids, token_ids, num_prompt_tokens, num_tokens_wanted):
            state = self._update(req_id, seq, num_prompt)
            want = min(want, self.k)
            out.append(self._draft(state, want) if want > 0 else [])
        return out

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        """Drop requests; each response goes into the global tree, evicting the oldest past the limit."""
        for req_id in req_ids:
            state = self._requests.pop(req_id, None)
            if state is None or self.max_cached_requests == 0:
                continue
            response = state.seq.tokens[state.num_prompt_tokens:]
            if not response:
                continue
            cached = TokenSeq()
            self._global.extend(cached, response)
            cached.hot.clear()
            self._cached.append(cached)
            while len(self._cached) > self.max_cached_requests:
                self._global.remove(self._cached.popleft())

    def _update(self, req_id: str, seq: np.ndarray, num_prompt: int) -> _RequestState:
        state = self._requests.get(req_id)
        n = seq.shape[0]
        if state is not None:
            known = state.seq.tokens
            m, c = len(known), _REUSE_CHECK_TOKENS
            if n < m or (m and (known[:c].tolist() != seq[:min(c, m)].tolist()
                                or known[max(0, m - c):].tolist() != seq[max(0, m - c):m].tolist())):
                state = None
        if state is None:
            state = self._requests[req_id] = _RequestState(self.max_depth)
        state.num_prompt_tokens = num_prompt
        m = len(state.seq)
        if n > m:
            state.tree.extend(state.seq, seq[m:].tolist())
        return state

    def _draft(self, state: _RequestState, want: int) -> list[int]:
        tokens = state.seq.tokens
        context = tokens[max(0, len(tokens) - self.max_depth + 1):].tolist()
        own, own_score = self._best_in_tree(state.tree, context, want, own=state.seq)
        if not self._cached or own_score >= want:
            return own
        other, other_score = self._best_in_tree(self._global, context, want, own=None)
        return own if own_score >= other_score else other

    def _best_in_tree(self, tree: SuffixTree, context: list[int], want: int,
                      own: TokenSeq | None) -> tuple[list[int], float]:
        """Best (draft, score) over match lengths; ``own``: the request's sequence in its own tree."""
        best, best_score = [], 0.0
        n, factor, min_prob = len(context), self.max_spec_factor, self.min_token_prob
        hot, end = (own.hot, len(own)) if own is not None else (None, 0)
        for m in range(1, n + 1):
            if hot is not None:
                node = hot.get(end - m)
                if node is None or node.count < 2:   # only the context itself
                    break
                depth, into_tail, denominator = m, 0, node.count - 1
            else:
                found = tree.match(context[n - m:])
                if found is None:    # a longer suffix cannot occur either
                    break
                node, depth, into_tail = found
                denominator = node.count
            budget = min(want, int(factor * m + 1e-6))
            draft, score = tree.follow(node, depth, into_tail, denominator, budget, min_prob)
            if draft and score >= best_score:
                best, best_score = draft, score
                if score >= want:
                    break
        return best, best_score
