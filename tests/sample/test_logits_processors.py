"""The logits edits before temperature, on known logits: formulas and their order."""
from __future__ import annotations

import torch

import pytest

from pagedllm.sample.logits_processors import (LogitsProcessorInputs, RawLogitsSave, process_logits,
                                               token_presence)
from pagedllm.sample.logprobs import gather_logprobs
from pagedllm.sample.sampler import SamplingMetadata, compute_probs


def _penalty_inputs(history, prompt_len, length, rep, freq, pres, V=4):
    seen = token_presence(torch.tensor(history), torch.tensor(prompt_len), torch.tensor(length), V)
    n = len(history)
    return LogitsProcessorInputs(
        penalty_rows=torch.arange(n), seen=seen,
        repetition=torch.full((n,), rep), frequency=torch.full((n,), freq), presence=torch.full((n,), pres))


def test_token_presence_counts_output_and_marks_prompt():
    # prompt [0, 3], output [1, 1, 2]; the last position is a draft not yet before us
    rows, toks, counts = token_presence(torch.tensor([[0, 3, 1, 1, 2, 2], [2, 2, 0, 0, 0, 0]]),
                                        torch.tensor([2, 1]), torch.tensor([5, 3]), 4)
    # row 0: prompt {0, 3}, output [1, 1, 2]; row 1: prompt [2], output [2, 0]
    assert list(zip(rows.tolist(), toks.tolist(), counts.tolist())) == [
        (0, 0, 0.0), (0, 1, 2.0), (0, 2, 1.0), (0, 3, 0.0), (1, 0, 1.0), (1, 2, 1.0)]


def test_repetition_frequency_presence_formulas():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    # prompt [0], output [1, 1, 2]
    inp = _penalty_inputs([[0, 1, 1, 2]], [1], [4], rep=2.0, freq=0.5, pres=0.25)
    process_logits(logits, inp)
    # token 0: prompt only, positive: 2 / 2; token 1: output x2, negative: -2 * 2 - 0.5 * 2 - 0.25;
    # token 2: output x1, positive: 1 / 2 - 0.5 - 0.25; token 3: untouched
    assert torch.allclose(logits, torch.tensor([[1.0, -5.25, -0.25, 0.5]]))


def test_order_masks_then_bias_then_penalties():
    logits = torch.tensor([[2.0, 0.0, 5.0, 1.0]])
    inp = _penalty_inputs([[0, 0]], [1], [2], rep=2.0, freq=0.0, pres=0.0)   # token 0 seen
    inp.bias = (torch.tensor([0, 0]), torch.tensor([0, 2]), torch.tensor([2.0, 1.0]))
    inp.allowed = (torch.tensor([0]), torch.tensor([[True, True, False, True]]))
    inp.banned = (torch.tensor([0]), torch.tensor([3]))
    process_logits(logits, inp)
    # bias before the repetition penalty: (2 + 2) / 2 = 2, not 2 / 2 + 2 = 3; a masked token
    # stays masked whatever its bias
    assert logits[0, 0].item() == 2.0
    assert logits[0, 1].item() == 0.0
    assert logits[0, 2].item() == float("-inf") and logits[0, 3].item() == float("-inf")


def test_grammar_mask_runs_between_allowed_and_bias():
    calls = []
    logits = torch.zeros(1, 4)
    inp = LogitsProcessorInputs(bias=(torch.tensor([0]), torch.tensor([1]), torch.tensor([3.0])))

    def grammar(x):
        calls.append(x.clone())
        x[0, 2] = float("-inf")

    process_logits(logits, inp, grammar)
    assert calls[0].tolist() == [[0.0, 0.0, 0.0, 0.0]]   # before the bias
    assert logits.tolist() == [[0.0, 3.0, float("-inf"), 0.0]]


def test_min_p_before_top_p():
    # probs 0.5 0.3 0.15 0.05: min_p 0.2 drops 0.05 (< 0.1); top_p 0.8 on the
    # renormalised rest (0.526 0.316 0.158) keeps the two most likely
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    md = SamplingMetadata(temperature=torch.ones(1), top_k=torch.zeros(1, dtype=torch.int64),
                          top_p=torch.tensor([0.8]), min_p=torch.tensor([0.2]), generators=[None],
                          all_greedy=False, need_top_k=False, need_top_p=True, need_min_p=True)
    probs = compute_probs(p.log(), md)
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]), atol=1e-6)


def test_gather_logprobs_ranks_and_top():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 0.0, 5.0]])
    out = gather_logprobs(logits, torch.tensor([2, 3]), [2, 0])
    ref = torch.log_softmax(logits, -1)
    assert out[0].token_ids == [2, 1, 2] and out[0].rank == 2
    assert torch.allclose(torch.tensor(out[0].logprobs), ref[0, [2, 1, 2]])
    assert out[1].token_ids == [3] and out[1].rank == 1


def test_gather_logprobs_rank_matches_a_full_count():
    """The rank read from the top k equals counting the vocabulary, for chosen tokens in
    and out of the top k, with ties."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 300, generator=g).round(decimals=1)       # many ties
    lp = torch.log_softmax(logits, -1)
    chosen = torch.randint(0, 300, (64,), generator=g)
    chosen[:16] = lp.argmax(1)[:16]
    for k in ([0] * 64, [5] * 64, [1, 3, 20, 0] * 16):
        out = gather_logprobs(logits, chosen, k)
        want = (lp > lp.gather(1, chosen.view(-1, 1))).sum(1) + 1
        assert [e.rank for e in out] == want.tolist()


@pytest.mark.parametrize("V", [49152, 1000, 37])
def test_gather_logprobs_values_equal_log_softmax(V):
    """The logprobs read without a [N, V] log_softmax equal torch's log_softmax, chosen and
    top tokens, on wide logits of a real vocabulary's size and on odd widths; a row's values
    do not depend on the rows around it."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(9, V, generator=g) * 4
    logits[3, 5] = 40.0                                   # a peaked row
    chosen = torch.randint(0, V, (9,), generator=g)
    out = gather_logprobs(logits, chosen, [5] * 9)
    ref = torch.log_softmax(logits.double(), -1)
    for i, e in enumerate(out):
        want = ref[i, e.token_ids]
        assert torch.allclose(torch.tensor(e.logprobs, dtype=torch.float64), want, atol=2e-5, rtol=1e-6)
        assert e.token_ids[1:] == ref[i].topk(5).indices.tolist()
        alone = gather_logprobs(logits[i: i + 1].clone(), chosen[i: i + 1], [5])[0]
        assert alone.logprobs == e.logprobs and alone.token_ids == e.token_ids


def test_gather_logprobs_nan_row_is_nan():
    logits = torch.randn(2, 300)
    logits[1, 7] = float("nan")
    out = gather_logprobs(logits, torch.tensor([0, 0]), [1, 1])
    assert all(v == v for v in out[0].logprobs)
    assert all(v != v for v in out[1].logprobs)


def test_raw_logits_save_gives_back_every_edited_value():
    """Every kind of edit (allowed mask, grammar, banned pair, bias, penalties) is undone
    in the rows asked for, and only processed values stay in the others."""
    g = torch.Generator().manual_seed(2)
    N, V = 5, 50
    raw = torch.randn(N, V, generator=g)
    mask = torch.zeros(1, V, dtype=torch.bool)
    mask[0, :3] = True
    seen = token_presence(torch.tensor([[4, 5, 6, 4]] * N), torch.full((N,), 1), torch.full((N,), 4), V)
    inp = LogitsProcessorInputs(
        allowed=(torch.tensor([1]), mask),
        banned=(torch.tensor([0, 2]), torch.tensor([9, 10])),
        bias=(torch.tensor([0, 3, 4]), torch.tensor([11, 12, 13]), torch.tensor([5.0, -3.0, 2.0])),
        penalty_rows=torch.arange(N), seen=seen,
        repetition=torch.full((N,), 1.3), frequency=torch.full((N,), 0.5), presence=torch.full((N,), 0.2))
    for grammar in (False, True):
        x = raw.clone()
        keep = torch.tensor([0, 1, 3])
        save = RawLogitsSave(x, inp, keep, grammar)
        gm = (lambda t: t[:, 20:].fill_(float("-inf"))) if grammar else None
        process_logits(x, inp, gm)
        processed = x.clone()
        assert not torch.equal(processed[keep], raw[keep])
        save.restore(x)
        assert torch.equal(x[keep], raw[keep])
        others = torch.tensor([2, 4])
        assert torch.equal(x[others], processed[others])
