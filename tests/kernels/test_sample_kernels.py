"""The C++ sampling kernels (kernels/csrc/sample_ops.cpp) against torch references: the
row-wise top-k with the rank of a chosen token, and the penalties' token history.
Skipped where the kernels are not built (PAGEDLLM_CPU_KERNELS=0 or no compiler)."""
import pytest
import torch

from pagedllm.kernels.cpu import load_cpu_kernels
from pagedllm.sample.logits_processors import token_presence, token_presence_torch
from pagedllm.sample.topk import topk_rank_lse, topk_rows, topk_with_rank, two_stage_topk

ops = load_cpu_kernels()
pytestmark = pytest.mark.skipif(ops is None, reason="C++ CPU kernels not built")


def _reference(x: torch.Tensor, k: int):
    """Stable descending sort: equal values by ascending index, NaN first (as largest)."""
    v, i = torch.sort(x, dim=1, descending=True, stable=True)
    return v[:, :k], i[:, :k]


def _rows(kind: str, V: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(9, V, generator=g) * 4
    if kind == "ties":
        x = torch.randint(-2, 3, (9, V), generator=g).float()
    elif kind == "special":
        x[0] = float("-inf")                       # all -inf
        x[1, ::7] = float("nan")                   # NaNs among values
        x[2] = 0.0
        x[2, ::2] = -0.0                           # -0.0 ties +0.0
        x[3, -1] = 1e9                             # the maximum in the vector tail
        x[4, : V // 2] = float("nan")              # more NaNs than k
        x[5] = float("inf")
        x[6, min(5, V - 1)] = float("inf")
        x[6, max(V - 3, 0)] = float("-inf")
    return x


@pytest.mark.parametrize("V", [1, 7, 16, 33, 1000, 49152, 49157])
@pytest.mark.parametrize("k", [0, 1, 5, 20, 64])
@pytest.mark.parametrize("kind", ["randn", "ties", "special"])
def test_topk_is_a_stable_descending_sort(V, k, kind):
    if k > V:
        pytest.skip("k > V")
    g = torch.Generator().manual_seed(V * 7 + k)
    x = _rows(kind, V, g)
    vals, idx = topk_rows(x, k)
    rv, ri = _reference(x, k)
    assert torch.equal(idx, ri)
    assert torch.equal(vals.view(torch.int32), rv.view(torch.int32))   # bits: NaN and -0.0 kept
    if kind != "special":   # torch.topk's values (its order of equal values is unspecified)
        assert torch.equal(vals, x.topk(k, dim=1).values)
        assert torch.equal(two_stage_topk(x, k)[0], vals)


@pytest.mark.parametrize("V", [1, 16, 1000, 49157])
@pytest.mark.parametrize("k", [0, 5])
@pytest.mark.parametrize("kind", ["randn", "ties", "special"])
def test_rank_counts_strictly_greater_values(V, k, kind):
    g = torch.Generator().manual_seed(V + k)
    x = _rows(kind, V, g)
    if k > V:
        pytest.skip("k > V")
    chosen = torch.randint(0, V, (x.shape[0],), generator=g)
    chosen[0] = 0
    vals, idx, ranks = topk_with_rank(x, k, chosen)
    c = x.gather(1, chosen.view(-1, 1))
    assert torch.equal(ranks, (x > c).sum(dim=1) + 1)
    rv, ri = _reference(x, k)
    assert torch.equal(idx, ri)


@pytest.mark.parametrize("V", [1, 7, 513, 1000, 49152])
@pytest.mark.parametrize("k", [0, 5])
@pytest.mark.parametrize("kind", ["randn", "ties", "special"])
def test_log_softmax_normaliser_equals_torch(V, k, kind):
    """shift and log_sum give torch's log_softmax as (x - shift) - log_sum; NaN rows NaN."""
    if k > V:
        pytest.skip("k > V")
    x = _rows(kind, V, torch.Generator().manual_seed(V + k))
    c = torch.zeros(9, dtype=torch.int64)
    vals, idx, ranks, shift, log_sum = ops.topk_rows(x, k, c, True)
    rv, ri, rr = topk_with_rank(x.t().contiguous().t(), k, c)          # the torch path
    assert torch.equal(ranks, rr)
    got = (x - shift.unsqueeze(1)) - log_sum.unsqueeze(1)
    want = torch.log_softmax(x.double(), dim=1).float()
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite], want[finite], atol=2e-5, rtol=1e-6)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    # the torch fallback of topk_rank_lse agrees
    fb = topk_rank_lse(x.t().contiguous().t(), k, c)
    assert torch.equal(torch.isnan(fb[3]), torch.isnan(shift))
    ok = torch.isfinite(log_sum) & torch.isfinite(fb[4])
    assert torch.allclose(fb[4][ok], log_sum[ok], atol=1e-5)


def test_each_row_alone_equals_the_batch():
    x = torch.randn(16, 49152, generator=torch.Generator().manual_seed(5))
    chosen = torch.arange(16) * 1000
    vals, idx, ranks = topk_with_rank(x, 64, chosen)
    for i in range(16):
        v, j, r = topk_with_rank(x[i: i + 1], 64, chosen[i: i + 1])
        assert torch.equal(v[0], vals[i]) and torch.equal(j[0], idx[i]) and r[0] == ranks[i]


def test_topk_errors_name_the_problem():
    x = torch.randn(2, 10)
    with pytest.raises(RuntimeError, match="out of range"):
        topk_rows(x, 11)
    with pytest.raises(RuntimeError, match="chosen"):
        topk_with_rank(x, 2, torch.tensor([0, 10]))
    with pytest.raises(RuntimeError, match="float32"):
        ops.topk_rows(x.double(), 2)


@pytest.mark.parametrize("P,L,V", [(1, 1, 5), (4, 50, 7), (32, 330, 49152), (3, 0, 10)])
def test_token_presence_equals_torch(P, L, V):
    g = torch.Generator().manual_seed(P * L + V)
    hist = torch.randint(0, V, (P, L), generator=g)
    length = torch.randint(0, L + 1, (P,), generator=g)
    prompt_len = torch.randint(0, L + 2, (P,), generator=g)
    got = token_presence(hist, prompt_len, length, V)
    want = token_presence_torch(hist, prompt_len, length, V)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_token_presence_known_counts():
    # prompt [3, 1, 3], output [1, 1, 4]; position 6 (token 9) is past the length
    hist = torch.tensor([[3, 1, 3, 1, 1, 4, 9]])
    rows, toks, counts = token_presence(hist, torch.tensor([3]), torch.tensor([6]), 10)
    assert rows.tolist() == [0, 0, 0] and toks.tolist() == [1, 3, 4]
    assert counts.tolist() == [2.0, 0.0, 1.0]


def test_token_presence_rejects_tokens_outside_the_vocabulary():
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        ops.token_presence(torch.tensor([[1, 12]]), torch.tensor([1]), torch.tensor([2]), 10)
    # past the length, any value is padding and ignored
    rows, toks, _ = ops.token_presence(torch.tensor([[1, 12]]), torch.tensor([1]), torch.tensor([1]), 10)
    assert toks.tolist() == [1]
