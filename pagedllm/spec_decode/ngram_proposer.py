"""Prompt-lookup decoding (speculative method ``"ngram"``): propose the tokens after the MOST
RECENT earlier occurrence of the longest recurring suffix n-gram (vLLM's ``NgramProposer``
takes the first). Why and cost: docs/notes/spec-decode.md."""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def ngram_lookup(seq: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens following the most recent earlier occurrence of the longest suffix
    n-gram of ``seq`` (1-D int, read only) with length in [min_n, max_n]; ``[]`` if none."""
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
    """Prompt-lookup proposer, stateless. Args: ``num_speculative_tokens`` (k);
    ``prompt_lookup_min`` <= ``prompt_lookup_max``, the n-gram lengths (>= 1).

    Raises:
        ValueError: naming the ``speculative_config`` key that is out of range."""

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
        """Per request (tokens int32 1-D, read only; most tokens wanted): 0..min(k, wanted) token ids."""
        return [ngram_lookup(seq, min(self.k, want), self.min_n, self.max_n)
                for seq, want in zip(token_ids, num_tokens_wanted)]

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        """No per-request state to drop."""
