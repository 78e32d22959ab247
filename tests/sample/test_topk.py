"""``sample/topk.py``'s two-stage row top-k against ``torch.topk``: the same values in
the same (descending) order, indices that hold those values, with ties, -inf, a partial
last chunk and rows too narrow for two stages; each row's result independent of the
others in the batch."""
from __future__ import annotations

import pytest
import torch

from pagedllm.sample.topk import argmax_rows, chunk_size, topk_rows


@pytest.mark.parametrize("V", [49152, 49153, 32000, 151936, 300, 1])
@pytest.mark.parametrize("k", [1, 5, 20, 64])
@pytest.mark.parametrize("kind", ["normal", "ties", "masked"])
def test_same_values_as_torch_topk(V, k, kind):
    if k > V:
        pytest.skip("k > V")
    g = torch.Generator().manual_seed(V * 131 + k)
    x = torch.randn(7, V, generator=g)
    if kind == "ties":            # few distinct values: ties at the k-th value everywhere
        x = torch.randint(0, 4, (7, V), generator=g).float()
    if kind == "masked":          # most of the vocabulary masked out (a grammar, allowed ids)
        x = x.masked_fill(torch.rand(7, V, generator=g) < 0.99, float("-inf"))
    vals, idx = topk_rows(x, k)
    want, _ = x.topk(k, dim=1)
    assert torch.equal(vals, want)
    assert idx.dtype == torch.int64 and torch.equal(x.gather(1, idx), vals)
    assert all(len(set(r)) == k for r in idx.tolist())      # distinct columns


def test_each_row_alone_equals_the_batch():
    x = torch.randn(16, 49152, generator=torch.Generator().manual_seed(3)).bfloat16()
    vals, idx = topk_rows(x, 64)
    for i in range(16):
        v, j = topk_rows(x[i: i + 1], 64)
        assert torch.equal(v[0], vals[i]) and torch.equal(j[0], idx[i])
    assert chunk_size(5) == 128 and chunk_size(64) == 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V", [49152, 49153, 1000, 600, 300])
def test_argmax_rows_is_torch_argmax(V, dtype):
    """The same indices as torch.argmax, its tie rule (first index) and NaN rule (first
    NaN) included: all-equal rows, all -inf rows, a maximum in the partial last chunk, a
    tie across chunks, many ties within a chunk, a NaN row; narrow rows (fallback)."""
    g = torch.Generator().manual_seed(V)
    x = torch.randn(12, V, generator=g).to(dtype)
    x[3] = 1.0
    x[4] = -float("inf")
    x[6, -1] = 100.0
    x[7, 200] = x[7, 5000 % V] = 50.0
    x[8] = torch.round(x[8])
    x[9, 130] = x[9, 129] = 60.0
    assert torch.equal(argmax_rows(x), x.argmax(dim=1))
    x[5, 7] = float("nan")
    x[5, 9] = float("nan")
    assert torch.equal(argmax_rows(x), x.argmax(dim=1))
    assert argmax_rows(x[:0]).shape == (0,)
