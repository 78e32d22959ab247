"""Prompt-lookup decoding (speculative method ``"ngram"``).

For each request, find the longest n in ``[prompt_lookup_max .. prompt_lookup_min]`` such
that the sequence's last n tokens also occur earlier in it (prompt + output so far), take
the MOST RECENT such earlier occurrence, and propose the (up to k) tokens that followed it.

Most recent, not earliest (vLLM's ``NgramProposer`` takes the first match, in reading
order): in agent and code workloads the context often holds several versions of the same
text (a file re-read after each edit), and the latest version is the one being continued.
Measured by simulated greedy verification (k=5; tokens gained per verify step, at most 6)
on tokenized pagedllm/core/*.py: a 1,800-token file followed by three versions, each with
2% of its tokens replaced, decoding the third: most recent 4.33 vs earliest 4.21 (n in
[1, 4]), 4.71 vs 4.51 (n in [1, 8]); the same on random tokens 5.20 vs 4.81. With a single
earlier copy the earliest is slightly better (earliest 4.41 vs 4.21 at n in [1, 4]; 4.32 vs 4.30 at [3, 8]):
a short n-gram's latest occurrence is then often a local repeat inside the output itself.
One cost: when the matched occurrence overlaps the end of the sequence (a period shorter
than k), the proposal is cut at the sequence end rather than running on.

Search (vectorised, no Python loop over positions):
    ``ends`` = positions e <= len-2 where the tokens at e-1, e equal the last two tokens
    (two numpy compares over the sequence; the last token alone when max_n is 1 or no
    2-gram recurs), then for l = 2, 3, ... keep the ends whose token[e-l] equals the token
    l before the end, until none is left or l reaches ``prompt_lookup_max``. The surviving
    ends of the last round are the occurrences of the longest n-gram; the largest of them
    is the most recent. Each round only touches the survivors, a handful in real text.

Cost: two compares over the whole sequence (no ``max_search`` bound: a lookup back to the
start of a long prompt is the case this method exists for) plus <= max_n-2 rounds over the
surviving candidates. Measured on one core of a 2-core CPU host, k=5, n in [2, 5]: 12 us
median (15 mean, 34 max) per request for 2,000 tokens of tokenized source code, 12 us for
2,000 uniform random tokens, 27 us for 32,000: far below a model step.
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def ngram_lookup(seq: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Proposal for one sequence.

    Args:
        seq: the request's tokens, 1-D int array (read only, not kept).
        k: at most this many tokens are proposed.
        min_n, max_n: the n-gram lengths searched, longest first.

    Returns:
        0..k token ids: the tokens after the most recent earlier occurrence of the longest
        matching suffix n-gram (fewer than k where the sequence ends first); ``[]`` when no
        n-gram of length >= ``min_n`` recurs or ``k`` is 0.
    """
    n = seq.shape[0]
    if k <= 0 or n < min_n + 1:
        return []
    # End positions e <= n-2 of earlier occurrences of the last token (so at least one
    # token follows every candidate and the suffix itself is never one), narrowed to the
    # last two tokens with one more full-length compare: frequent single tokens (",",
    # " the") would otherwise make the first rounds gather thousands of candidates.
    eq_last = seq[:-1] == seq[-1]
    length = 1
    if max_n >= 2 and n >= 3:
        eq_two = eq_last[1:] & (seq[:-2] == seq[-2])
        ends = np.flatnonzero(eq_two)
        if ends.size:
            ends += 1
            length = 2
    if length == 1:
        if min_n >= 2:
            return []
        ends = np.flatnonzero(eq_last)
        if ends.size == 0:
            return []
    while length < max_n:
        # ends are ascending and >= length-1: only the first may lack a token at e-length
        cand = ends[1:] if ends[0] < length else ends
        keep = cand[seq[cand - length] == seq[n - 1 - length]]
        if keep.size == 0:
            break
        ends = keep
        length += 1
    if length < min_n:
        return []
    e = int(ends[-1])   # flatnonzero is ascending: the last end is the most recent
    return seq[e + 1:e + 1 + k].tolist()


class NgramProposer:
    """Prompt-lookup proposer; stateless across steps (see the module docstring).

    Args:
        num_speculative_tokens: k, the most tokens proposed per request and step.
        prompt_lookup_min, prompt_lookup_max: the n-gram lengths searched (1 <= min <= max).

    Raises:
        ValueError: naming the ``speculative_config`` key that is out of range.
    """

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        if num_speculative_tokens < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens must be >= 1, "
                             f"got {num_speculative_tokens}")
        if prompt_lookup_min < 1:
            raise ValueError(f"speculative_config.prompt_lookup_min must be >= 1, got {prompt_lookup_min}")
        if prompt_lookup_max < prompt_lookup_min:
            raise ValueError(f"speculative_config.prompt_lookup_max ({prompt_lookup_max}) must be >= "
                             f"prompt_lookup_min ({prompt_lookup_min})")
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, req_ids: list[str], token_ids: list[np.ndarray], num_prompt_tokens: list[int],
                num_tokens_wanted: list[int]) -> list[list[int]]:
        """For each request: its whole token sequence so far (prompt then output, int32
        1-D; read, never modified or kept), the prompt length (unused: the prompt and the
        output are searched alike), and how many tokens to propose at most (0 = skip).
        Returns per request a list of 0..min(k, num_tokens_wanted[i]) token ids."""
        return [ngram_lookup(seq, min(self.k, want), self.min_n, self.max_n)
                for seq, want in zip(token_ids, num_tokens_wanted)]

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        """No per-request state to drop."""
