"""``sample/topk.py``'s two-stage row top-k against ``torch.topk``: the same values in
the same (descending) order, indices that hold those values, with ties, -inf, a partial
last chunk and rows too narrow for two stages; each row's result independent of the
others in the batch."""
from __future__ import annotations

import pytest
import torch

from pagedllm.sample.topk import chunk_size, topk_rows


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
