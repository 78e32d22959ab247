"""Exact row-wise top-k and argmax of wide float rows in two stages (chunk maxima, then the
best chunks), or the C++ ``topk_rows`` for float32 CPU rows (ties by ascending index, NaN
above +inf); a row's result never depends on the batch. Why: docs/notes/sample.md."""
from __future__ import annotations

import torch

from pagedllm.kernels.cpu import load_cpu_kernels


def chunk_size(k: int) -> int:
    return 128 if k <= 16 else 32


def topk_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``k`` largest values of each row of float ``x`` [N, V]: (values [N, k] descending, int64 [N, k]).

    Raises:
        RuntimeError: k > V (as ``torch.topk``)."""
    ops = _kernel_for(x)
    if ops is not None:
        if k > x.shape[1]:
            raise RuntimeError(f"selected index k = {k} out of range for rows of {x.shape[1]}")
        vals, idx = ops.topk_rows(x, k)
        return vals, idx
    return two_stage_topk(x, k)


def two_stage_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_rows`` in torch ops (``torch.topk`` off the CPU or with fewer than 4 * k chunks)."""
    N, V = x.shape
    chunk = chunk_size(k)
    n_chunks = V // chunk
    if x.device.type != "cpu" or k < 1 or n_chunks < 4 * k:
        return x.topk(k, dim=1)
    main = n_chunks * chunk
    xc = x[:, :main].reshape(N, n_chunks, chunk)
    _, ci = xc.amax(dim=2).topk(k, dim=1)                                  # [N, k] chunks
    cand = xc.gather(1, ci.unsqueeze(2).expand(N, k, chunk)).reshape(N, k * chunk)
    cols = (ci.unsqueeze(2) * chunk + torch.arange(chunk, device=x.device)).reshape(N, k * chunk)
    if main < V:   # the last, partial chunk always takes part
        cand = torch.cat([cand, x[:, main:]], dim=1)
        cols = torch.cat([cols, torch.arange(main, V, device=x.device).expand(N, V - main)], dim=1)
    vals, j = cand.topk(k, dim=1)
    return vals, cols.gather(1, j)


def _kernel_for(x: torch.Tensor):
    if x.device.type != "cpu" or x.dtype != torch.float32 or not x.is_contiguous():
        return None
    return load_cpu_kernels()


def topk_with_rank(x: torch.Tensor, k: int,
                   chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``topk_rows(x, k)`` (k in 0..V) plus each row's rank of ``x[i, chosen[i]]`` (``chosen``
    int64 [N]): 1 + the count of strictly greater values. Returns (values, indices, ranks int64 [N]).

    Raises:
        RuntimeError: k > V, or a chosen index outside the row."""
    ops = _kernel_for(x)
    if ops is not None:
        vals, idx, ranks = ops.topk_rows(x, k, chosen.to(torch.int64).contiguous())
        return vals, idx, ranks
    c = x.gather(1, chosen.view(-1, 1))
    vals, idx = topk_rows(x, k) if k > 0 else (x[:, :0], chosen.new_zeros(x.shape[0], 0))
    return vals, idx, (x > c).sum(dim=1) + 1


def topk_rank_lse(x: torch.Tensor, k: int, chosen: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``topk_with_rank`` plus the normaliser ``log_softmax(x) = (x - shift) - log_sum``:
    returns (values, indices, ranks, shift float32 [N], log_sum float32 [N]).

    Raises:
        RuntimeError: k > V, or a chosen index outside the row."""
    ops = _kernel_for(x)
    if ops is not None:
        return tuple(ops.topk_rows(x, k, chosen.to(torch.int64).contiguous(), True))
    vals, idx, ranks = topk_with_rank(x, k, chosen)
    xf = x.float()
    shift = xf.amax(dim=1)
    log_sum = (xf - shift.unsqueeze(1)).exp().sum(dim=1).log()
    return vals, idx, ranks, shift, log_sum


# Values per chunk of ``argmax_rows``.
ARGMAX_CHUNK = 128


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=1)`` of float x [N, V] -> int64 [N], ties and NaN included, in two stages."""
    N, V = x.shape
    n_chunks = V // ARGMAX_CHUNK
    if x.device.type != "cpu" or n_chunks < 4 or N == 0:
        return x.argmax(dim=1)
    main = n_chunks * ARGMAX_CHUNK
    xc = x[:, :main].reshape(N, n_chunks, ARGMAX_CHUNK)
    cmax = xc.amax(dim=2)                                             # [N, C]
    if main < V:
        cmax = torch.cat([cmax, x[:, main:].amax(dim=1, keepdim=True)], dim=1)
    rmax = cmax.amax(dim=1, keepdim=True)                             # [N, 1]
    if torch.isnan(rmax).any():                                       # amax propagates NaN
        return x.argmax(dim=1)
    c = (cmax == rmax).to(torch.uint8).argmax(dim=1)                  # first chunk holding it
    cols = c.unsqueeze(1) * ARGMAX_CHUNK + torch.arange(ARGMAX_CHUNK, device=x.device)   # [N, chunk]
    cols = cols.clamp_max_(V - 1)             # the partial last chunk: repeat its last column
    vals = x.gather(1, cols)
    j = (vals == rmax).to(torch.uint8).argmax(dim=1)
    return cols.gather(1, j.unsqueeze(1)).squeeze(1)
