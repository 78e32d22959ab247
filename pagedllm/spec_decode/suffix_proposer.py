"""SuffixDecoding (speculative method ``"suffix"``).

Oliaro et al. 2024, "SuffixDecoding: A Model-Free Approach to Speeding Up Large Language
Model Inference" (arXiv:2411.04975), as served by vLLM's ``method: suffix`` through
Snowflake's Arctic Inference ``SuffixDecodingCache``. Drafts come from two suffix trees
(``suffix_tree.SuffixTree``, depth ``max_tree_depth``):

* a per-request tree over the request's own tokens (prompt + output), extended with the
  tokens each ``propose`` call brings that it has not seen;
* one global tree over the responses (output tokens) of the last ``max_cached_requests``
  finished requests, a response entering when its request is removed and leaving first
  in, first out.

To propose for a request whose context is c (its last ``max_tree_depth - 1`` tokens), for
each match length m = 1, 2, ...: find c[-m:] in a tree and follow the most frequent child
while the path probability (product of count / parent count) stays >= ``min_token_prob``,
for at most min(wanted, num_speculative_tokens, floor(max_spec_factor * m)) tokens; the
draft with the highest score (sum of its tokens' path probabilities, i.e. the expected
number accepted) wins, the longer match on a tie, and between the two trees the higher
score wins (the request's own on a tie). The loop stops at the first m that does not
occur (a longer suffix cannot) or once a draft scores the whole budget.

Differences from Arctic Inference: in the request's own tree the context's own occurrence
at the sequence end (it always matches, with no continuation) is left out of the match
node's count, so a phrase seen once before is proposed with probability 1, not 1/2.
Responses enter the global tree when the request finishes, not token by token.

Library decision: Arctic Inference (0.3.0) is published on PyPI only as a source
distribution whose build needs torch >= 2.10, CMake, nanobind and protobuf/grpc tools and
compiles the C++ suffix tree with its vLLM plugin; its only wheel (0.0.4) predates suffix
decoding. So this is our own implementation, with no extra dependency.

Cost, measured on a loaded 2-core CPU host (k=5, other settings default), for a
request of tokenized Python source with a 50-response global cache: the first call,
which builds the tree over a 2,000-token prompt, 6-9 ms; then per request and step,
taking in the accepted tokens (3.8 per step here) and proposing, 50-60 us median (~70
mean; rare ~1 ms outliers, Python's cyclic GC over the nodes): ~11 us to take in one
token (one visit per hot start, <= max_tree_depth), ~6 us for the own tree, ~11 us for
the global tree. Memory: ~190 bytes per token of non-repeating text, ~500 for source
code, up to ~7 KiB per token of text that repeats an earlier one within the same tree
(a copy materialises up to max_tree_depth nodes per token); the global cache holds the
last ``max_cached_requests`` responses at that rate. See ``suffix_tree``.
"""
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
    """SuffixDecoding proposer (see the module docstring).

    Args:
        num_speculative_tokens: the most tokens proposed per request and step.
        max_tree_depth: depth of both suffix trees (longest context matched + draft).
        max_cached_requests: finished responses kept in the global tree (0 disables it).
        max_spec_factor: a match of m tokens proposes at most ``max_spec_factor * m``.
        min_token_prob: a draft stops before a token whose path probability is lower.

    Raises:
        ValueError: naming the ``speculative_config`` key that is out of range.
    """

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
        """For each request: its whole token sequence so far (prompt then output, int32
        1-D; read, never modified or kept), the prompt length, and how many tokens to
        propose at most (0 = no draft, but the tokens are still taken in, so the response
        cached at removal is complete up to this call). Returns per request a list of
        0..min(k, num_tokens_wanted[i]) token ids.

        A request id whose sequence is shorter than before or whose known tokens differ
        (at either end) starts a new tree; a preempted request that resumes keeps its own.
        """
        out = []
        for req_id, seq, num_prompt, want in zip(req_ids, token_ids, num_prompt_tokens, num_tokens_wanted):
            state = self._update(req_id, seq, num_prompt)
            want = min(want, self.k)
            out.append(self._draft(state, want) if want > 0 else [])
        return out

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        """Drop finished or aborted requests; each one's response (the output tokens seen by
        ``propose``) goes into the global tree, evicting the oldest beyond the limit."""
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
        """Best draft over match lengths (see the module docstring).

        ``own``: the tree's sequence when ``context`` is its end (the request's own tree).
        Its occurrence there is not counted, and the match for each length is read from the
        sequence's hot starts (the node of the path from each start to the end) instead of
        walked from the root: a start that is not hot ended in a tail, i.e. its suffix
        occurs only there.
        """
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
