"""NgramProposer (prompt lookup) on handcrafted sequences (no model needed)."""
from __future__ import annotations

import numpy as np
import pytest

from pagedllm.spec_decode.ngram_proposer import NgramProposer, ngram_lookup


def seq(*tokens: int) -> np.ndarray:
    return np.array(tokens, dtype=np.int32)


def propose_one(p: NgramProposer, tokens: np.ndarray, want: int = 100) -> list[int]:
    return p.propose(["r"], [tokens], [len(tokens)], [want])[0]


def test_longest_ngram_wins_over_a_more_recent_shorter_one():
    # The 3-gram "1 2 3" recurs at the start (followed by 10 11); the 2-gram "2 3" recurs
    # later and more recently (followed by 20 21).
    s = seq(1, 2, 3, 10, 11, 2, 3, 20, 21, 1, 2, 3)
    assert ngram_lookup(s, 2, 1, 3) == [10, 11]
    assert ngram_lookup(s, 2, 1, 2) == [20, 21]   # max 2: the 2-gram's most recent match


def test_most_recent_occurrence_of_the_same_ngram():
    s = seq(5, 6, 1, 5, 6, 2, 5, 6, 3, 9, 5, 6)
    assert ngram_lookup(s, 1, 2, 2) == [3]
    assert ngram_lookup(s, 2, 2, 2) == [3, 9]


def test_truncation_at_k_and_at_sequence_end():
    s = seq(7, 8, 1, 2, 3, 4, 5, 6, 0, 7, 8)
    p = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2)
    assert propose_one(p, s) == [1, 2, 3]              # k
    assert propose_one(p, s, want=2) == [1, 2]         # num_tokens_wanted below k
    # the only earlier "7 8" is followed by just one token before the end
    assert ngram_lookup(seq(4, 7, 8, 9, 7, 8), 5, 1, 2) == [9, 7, 8]
    assert ngram_lookup(seq(3, 3, 3), 5, 1, 2) == [3]  # overlapping match at the end


def test_no_match_and_zero_wanted_give_nothing():
    p = NgramProposer(4, 1, 3)
    assert propose_one(p, seq(1, 2, 3, 4)) == []
    assert propose_one(p, seq(1, 2, 1)) == [2, 1]
    assert propose_one(p, seq(1, 2, 1), want=0) == []
    assert propose_one(p, seq(1)) == []
    assert propose_one(p, seq()) == []


def test_min_and_max_bounds():
    # Only a 1-gram recurs ("9"): found with min 1, not with min 2.
    s = seq(9, 4, 5, 9)
    assert ngram_lookup(s, 3, 1, 3) == [4, 5, 9]
    assert ngram_lookup(s, 3, 2, 3) == []
    # A 4-gram recurs, but max 2 searches only up to 2-grams: the 2-gram's most recent
    # occurrence wins, not the 4-gram's.
    s = seq(1, 2, 3, 4, 50, 3, 4, 60, 1, 2, 3, 4)
    assert ngram_lookup(s, 1, 1, 4) == [50]
    assert ngram_lookup(s, 1, 1, 2) == [60]
    assert ngram_lookup(s, 1, 3, 4) == [50]
    # min above any recurring length: nothing
    assert ngram_lookup(s, 1, 5, 6) == []


def test_batch_of_requests_reads_views_and_does_not_modify_them():
    buf = np.array([[1, 2, 3, 1, 2, 0], [4, 4, 4, 4, 4, 4]], dtype=np.int32)
    before = buf.copy()
    p = NgramProposer(2, 1, 2)
    out = p.propose(["a", "b", "c"], [buf[0, :5], buf[1, :3], buf[0, :4]], [3, 1, 4], [2, 2, 0])
    assert out == [[3, 1], [4], []]
    assert all(isinstance(t, int) for t in out[0])
    np.testing.assert_array_equal(buf, before)
    p.remove_requests(["a", "b", "c"])   # stateless: a no-op


def test_matches_a_brute_force_reference():
    def reference(s: list[int], k: int, lo: int, hi: int) -> list[int]:
        for n in range(hi, lo - 1, -1):
            if n >= len(s):
                continue
            pat = s[-n:]
            for j in range(len(s) - n - 1, -1, -1):   # most recent earlier start first
                if s[j:j + n] == pat:
                    return s[j + n:j + n + k]
        return []

    rng = np.random.default_rng(0)
    for _ in range(300):
        s = rng.integers(0, 4, int(rng.integers(1, 40))).astype(np.int32)
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 4))
        assert ngram_lookup(s, 3, lo, hi) == reference(s.tolist(), 3, lo, hi), (s.tolist(), lo, hi)


@pytest.mark.parametrize("args, key", [((0, 1, 2), "num_speculative_tokens"),
                                       ((3, 0, 2), "prompt_lookup_min"),
                                       ((3, 3, 2), "prompt_lookup_max")])
def test_bad_settings_name_the_key(args, key):
    with pytest.raises(ValueError, match=f"speculative_config.{key}"):
        NgramProposer(*args)
