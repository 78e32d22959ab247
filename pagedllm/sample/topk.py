"""Exact row-wise top-k and argmax of wide rows (logits over a vocabulary) in two stages:
chunk maxima, then ``topk`` over the k best chunks. Same values as ``torch.topk``; a row's
result never depends on the other rows. Float32 CPU rows go to the C++ ``topk_rows`` where
built (order: values descending, equal values by ascending index, NaN above +inf).
Why and figures: docs/notes/sample.md."""
from __future__ import annotations

import torch

from pagedllm.kernels.cpu import load_cpu_kernels


def chunk_size(k: int) -> int:
    """Values per chunk for a top-k of ``k`` (tuned on this project's CPUs)."""
    return 128 if k <= 16 else 32


def topk_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest values of each row of ``x`` [N, V] (float) and their column indices:
    (values [N, k] descending, int64 [N, k]).

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
    """The C++ kernels' module if it can take ``x`` (contiguous float32 on the CPU), else None."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or not x.is_contiguous():
        return None
    return load_cpu_kernels()


def topk_with_rank(x: torch.Tensor, k: int,
                   chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``topk_rows(x, k)`` plus each row's rank of ``x[i, chosen[i]]``: 1 + the count of values
    strictly greater (a NaN never counts).

    Args:
        x: float [N, V]; k: 0..V; chosen: int64 [N] in [0, V).

    Returns:
        (values [N, k] descending, indices int64 [N, k], ranks int64 [N]).

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
    """``topk_with_rank`` plus the log-softmax normaliser:
    ``log_softmax(x) = (x - shift) - log_sum`` (torch's formula; a NaN row gives NaN).

    Args:
        x: float32 [N, V] (other dtypes and devices via torch ops); k: 0..V; chosen: int64 [N].

    Returns:
        (values [N, k], indices int64 [N, k], ranks int64 [N], shift float32 [N], log_sum float32 [N]).

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
    """``x.argmax(dim=1)`` of float x [N, V] -> int64 [N], exact incl. ties (first index) and
    NaN, in two stages on the CPU (figures: docs/benchmarks.md)."""
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
