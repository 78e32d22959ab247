"""SuffixProposer (SuffixDecoding) and its suffix tree on handcrafted sequences (no model
needed)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from pagedllm.spec_decode.suffix_proposer import SuffixProposer
from pagedllm.spec_decode.suffix_tree import SuffixTree, TokenSeq


def seq(*tokens: int) -> np.ndarray:
    return np.array(tokens, dtype=np.int32)


def propose_one(p: SuffixProposer, req_id: str, tokens: np.ndarray, num_prompt: int | None = None,
                want: int = 100) -> list[int]:
    num_prompt = len(tokens) if num_prompt is None else num_prompt
    return p.propose([req_id], [tokens], [num_prompt], [want])[0]


def finish(p: SuffixProposer, req_id: str, prompt: list[int], response: list[int]) -> None:
    """Run a request through the proposer and remove it (its response enters the cache)."""
    propose_one(p, req_id, seq(*prompt, *response), num_prompt=len(prompt), want=0)
    p.remove_requests([req_id])


# -- the request's own tokens ----------------------------------------------------------------
PHRASE_SEQ = seq(10, 11, 12, 13, 14, 15, 16, 50, 51, 52, 10, 11, 12)


def test_repeated_phrase_in_the_prompt_is_proposed():
    # "10 11 12" matches 3 tokens; max_spec_factor 1 allows 3 tokens for it.
    p = SuffixProposer(num_speculative_tokens=5)
    assert propose_one(p, "r", PHRASE_SEQ) == [13, 14, 15]


@pytest.mark.parametrize("factor, expected", [(0.5, [13]), (1.0, [13, 14, 15]), (2.0, [13, 14, 15, 16, 50]),
                                              (0.0, [])])
def test_max_spec_factor_limits_by_match_length(factor, expected):
    p = SuffixProposer(5, max_spec_factor=factor)
    assert propose_one(p, "r", PHRASE_SEQ) == expected


def test_truncation_at_k_wanted_and_tree_depth():
    p = SuffixProposer(2, max_spec_factor=2.0)
    assert propose_one(p, "r", PHRASE_SEQ) == [13, 14]             # k
    p = SuffixProposer(5, max_spec_factor=2.0)
    assert propose_one(p, "r", PHRASE_SEQ, want=1) == [13]         # wanted
    assert propose_one(p, "r", PHRASE_SEQ, want=0) == []
    # depth 5: a match of m tokens leaves room for 5 - m, so m=2 ("11 12") gives 3
    p = SuffixProposer(5, max_tree_depth=5, max_spec_factor=2.0)
    assert propose_one(p, "r", PHRASE_SEQ) == [13, 14, 15]


def test_no_match_gives_nothing():
    p = SuffixProposer(5)
    assert propose_one(p, "r", seq(1, 2, 3, 4)) == []
    assert propose_one(p, "s", seq(7)) == []
    assert propose_one(p, "t", seq()) == []


def test_sequence_grows_incrementally_like_a_fresh_build():
    rng = np.random.default_rng(0)
    for trial in range(20):
        tokens = rng.integers(0, 3, 60).astype(np.int32)
        inc = SuffixProposer(4, max_tree_depth=6, max_spec_factor=2.0)
        n = 1
        while n <= len(tokens):
            fresh = SuffixProposer(4, max_tree_depth=6, max_spec_factor=2.0)
            assert propose_one(inc, "r", tokens[:n]) == propose_one(fresh, "r", tokens[:n]), (trial, n)
            n += int(rng.integers(1, 5))


def test_reused_request_id_rebuilds_its_tree():
    p = SuffixProposer(5, max_cached_requests=0)
    assert propose_one(p, "r", seq(1, 2, 3, 4, 1, 2)) == [3, 4]
    # longer, but a different prefix: a new request under the same id
    assert propose_one(p, "r", seq(5, 5, 5, 5, 5, 5, 5, 1, 2)) == []
    # shorter: rebuilt again (the 5s are gone)
    assert propose_one(p, "r", seq(9, 8, 9)) == [8]
    # same prefix, grown: kept (a preempted request resuming)
    assert propose_one(p, "r", seq(9, 8, 9, 7, 9)) == [7]


# -- the global cache of finished responses --------------------------------------------------
def test_earlier_response_is_proposed_to_another_request():
    p = SuffixProposer(5)
    finish(p, "a", prompt=[1, 2, 3], response=[20, 21, 22, 23, 24, 25])
    assert p.num_cached_responses == 1
    assert propose_one(p, "b", seq(7, 8, 9, 20, 21, 22)) == [23, 24, 25]
    # the prompt of "a" was not cached, only its response
    assert propose_one(p, "c", seq(7, 1, 2)) == []


def test_min_token_prob_cuts_branching_continuations():
    def proposer(min_prob: float) -> SuffixProposer:
        p = SuffixProposer(5, min_token_prob=min_prob)
        for i, response in enumerate([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 3], [5, 6, 1, 1], [5, 6, 2, 2]]):
            finish(p, f"old{i}", prompt=[100 + i], response=response)
        return p
    # after "5 6": 7 with 3/5 = 0.6, then 8 with 0.6 * 2/3 = 0.4
    context = seq(40, 5, 6)
    assert propose_one(proposer(0.1), "b", context) == [7, 8]
    assert propose_one(proposer(0.5), "b", context) == [7]
    assert propose_one(proposer(0.7), "b", context) == []


def test_higher_score_wins_between_own_and_global():
    p = SuffixProposer(5, max_spec_factor=2.0)
    finish(p, "a", prompt=[0], response=[30, 31, 40, 41, 42, 43])
    # own tree: "30 31" once before, followed by 50 51 ... (score 4 for 4 tokens);
    # global: "30 31" -> 40 41 42 43 (score 4 too): the request's own wins the tie
    assert propose_one(p, "b", seq(30, 31, 50, 51, 52, 53, 30, 31)) == [50, 51, 52, 53]
    # own tree: "31" is followed by 50 once and 60 once (1/2 each: score 1 for "60 9");
    # global: "30 31" -> 40 41 42 43 with probability 1 (score 4)
    assert propose_one(p, "c", seq(31, 50, 9, 31, 60, 9, 30, 31)) == [40, 41, 42, 43]


def test_fifo_eviction_of_the_global_cache():
    p = SuffixProposer(5, max_cached_requests=2)
    finish(p, "a", prompt=[1], response=[20, 21, 22])
    finish(p, "b", prompt=[1], response=[30, 31, 32])
    finish(p, "c", prompt=[1], response=[40, 41, 42])
    assert p.num_cached_responses == 2
    assert propose_one(p, "x", seq(9, 20, 21)) == []            # "a" went first
    assert propose_one(p, "y", seq(9, 30, 31)) == [32]
    assert propose_one(p, "z", seq(9, 40, 41)) == [42]
    finish(p, "d", prompt=[1], response=[50, 51])
    assert propose_one(p, "w", seq(9, 30, 31)) == []            # then "b"


def test_remove_requests_drops_state_and_caches_the_response_seen():
    p = SuffixProposer(5)
    assert propose_one(p, "a", seq(1, 2, 70, 71, 72), num_prompt=2, want=0) == []
    p.remove_requests(["a", "never-seen"])
    assert p.num_cached_responses == 1
    assert propose_one(p, "b", seq(3, 70, 71)) == [72]
    # "a" is gone: the id starts over (its old tokens are not its own context any more)
    assert propose_one(p, "a", seq(5, 1, 2)) == []
    # a request finished before any output, and a disabled cache, cache nothing
    finish(p, "c", prompt=[1, 2], response=[])
    assert p.num_cached_responses == 1
    q = SuffixProposer(5, max_cached_requests=0)
    finish(q, "a", prompt=[1], response=[70, 71, 72])
    assert q.num_cached_responses == 0 and propose_one(q, "b", seq(3, 70, 71)) == []


def test_inputs_are_read_not_modified_and_outputs_are_ints():
    buf = np.array([10, 11, 12, 13, 10, 11, 0, 0], dtype=np.int32)
    before = buf.copy()
    p = SuffixProposer(3)
    out = p.propose(["a", "b"], [buf[:6], buf[2:4]], [6, 2], [3, 3])
    assert out == [[12, 13], []]
    assert all(type(t) is int for t in out[0])
    np.testing.assert_array_equal(buf, before)
    buf[:] = 99   # the proposer kept a copy, not the view
    assert propose_one(p, "a", seq(10, 11, 12, 13, 10, 11, 12)) == [13, 10, 11]


@pytest.mark.parametrize("kwargs, key", [
    (dict(num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(num_speculative_tokens=1, max_tree_depth=0), "suffix_decoding_max_tree_depth"),
    (dict(num_speculative_tokens=1, max_cached_requests=-1), "suffix_decoding_max_cached_requests"),
    (dict(num_speculative_tokens=1, max_spec_factor=-1.0), "suffix_decoding_max_spec_factor"),
    (dict(num_speculative_tokens=1, min_token_prob=1.5), "suffix_decoding_min_token_prob")])
def test_bad_settings_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=f"speculative_config.{key}"):
        SuffixProposer(**kwargs)


# -- the tree itself ----------------------------------------------------------------------------
def _count(tree: SuffixTree, sub: tuple[int, ...]) -> int:
    found = tree.match(list(sub))
    if found is None:
        return 0
    node, _, into_tail = found
    return node.count if into_tail == 0 else 1


def _check_best(node) -> None:
    if node.children is None:
        return
    if node.best is not None:
        assert node.best.count == max(c.count for c in node.children.values())
    for child in node.children.values():
        _check_best(child)


def test_tree_counts_every_substring_through_growth_bursts_and_removal():
    """Brute force: every substring up to max_depth of the sequences in the tree has the
    count of its occurrences, with sequences appended in chunks and one removed."""
    rng = np.random.default_rng(0)
    for trial in range(60):
        depth = int(rng.integers(1, 6))
        tree = SuffixTree(depth)
        stored = []
        for _ in range(int(rng.integers(1, 4))):
            s, tokens = TokenSeq(), rng.integers(0, 3, int(rng.integers(0, 25))).tolist()
            i = 0
            while i < len(tokens):
                j = i + int(rng.integers(1, 5))
                tree.extend(s, tokens[i:j])
                i = j
            s.hot.clear()
            stored.append((s, tokens))
        if len(stored) > 1 and trial % 2:
            tree.remove(stored.pop(0)[0])
        _check_best(tree.root)
        for length in range(1, depth + 1):
            for sub in itertools.product(range(3), repeat=length):
                want = sum(tuple(t[i:i + length]) == sub for _, t in stored for i in range(len(t) - length + 1))
                assert _count(tree, sub) == want, (trial, depth, sub, [t for _, t in stored])
