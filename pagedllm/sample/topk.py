"""Exact row-wise top-k of a wide row (logits over a vocabulary) in two stages, for the
sampler's top-k candidates and the logprobs' top tokens; and the row-wise argmax (k = 1,
``argmax_rows``) the same way.

``torch.topk`` over [N, V] costs ~3 ms for 32 x 49,152 float32 on 2 CPU threads (more than
the argmax of a greedy step); a chunk's maximum is ~15x cheaper to find than a top-k. The
row is cut into chunks (``chunk_size(k)`` values): the k chunks with the largest maxima hold the
row's k largest values (any value outside them is below k chunk maxima, so it ranks
k + 1 or lower), and ``topk`` runs over those k chunks' values only (32 x 49,152 float32,
2 threads: 0.4 against 2.9 ms for k = 5, 1.2 against 3.5 ms for k = 64). Exact: the same
values as ``torch.topk`` (descending); among equal values the indices kept may differ,
as ``torch.topk`` leaves that order unspecified. Row by row, so a row's result never
depends on the other rows of the batch.

Where the C++ CPU kernels are built (``pagedllm.kernels.cpu``), float32 rows on the CPU go
to their ``topk_rows`` instead: one pass over the row, a vector compare against the
current k-th value discarding nearly every element before a heap of the k best sees it
(32 x 49,152 float32, 2 threads: ~0.1 against 0.26 ms for k = 5, 0.73 ms for k = 64), the
rank of a given token counted in the same pass (``topk_with_rank``). Its order is fully
defined: values descending, equal values by ascending index, NaN above +inf.
"""
from __future__ import annotations

import torch

from pagedllm.kernels.cpu import load_cpu_kernels


def chunk_size(k: int) -> int:
    """Values per chunk: large for a few top values (fewer chunk maxima to rank), small
    for many (fewer candidates to rank); the fastest on this project's CPUs."""
    return 128 if k <= 16 else 32


def topk_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest values of each row of ``x`` [N, V] (float) and their column
    indices: (values [N, k] descending, int64 [N, k]). Falls back to ``torch.topk`` where
    the two stages would not save work (fewer than 4 * k chunks) and off the CPU.

    Raises:
        RuntimeError: k > V (as ``torch.topk``).
    """
    ops = _kernel_for(x)
    if ops is not None:
        if k > x.shape[1]:
            raise RuntimeError(f"selected index k = {k} out of range for rows of {x.shape[1]}")
        vals, idx = ops.topk_rows(x, k)
        return vals, idx
    return two_stage_topk(x, k)


def two_stage_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_rows`` in torch ops (the chunk maxima, then ``topk`` over the k best chunks):
    the path for other dtypes and devices, and the reference of the C++ kernel's tests."""
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
    """The C++ kernels' module when it can take ``x`` (contiguous float32 on the CPU), else
    None."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or not x.is_contiguous():
        return None
    return load_cpu_kernels()


def topk_with_rank(x: torch.Tensor, k: int,
                   chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``topk_rows(x, k)`` and each row's rank of ``x[i, chosen[i]]``: 1 + the number of
    values of row i strictly greater than it (ordered comparison: a NaN never counts, and
    a NaN chosen value ranks 1), as ``(x > x[i, chosen[i]]).sum() + 1``.

    Args:
        x: float [N, V]; k: 0..V; chosen: int64 [N], column indices in [0, V).

    Returns:
        (values [N, k] descending, indices int64 [N, k], ranks int64 [N]).

    Raises:
        RuntimeError: k > V, or a chosen index outside the row.
    """
    ops = _kernel_for(x)
    if ops is not None:
        vals, idx, ranks = ops.topk_rows(x, k, chosen.to(torch.int64).contiguous())
        return vals, idx, ranks
    c = x.gather(1, chosen.view(-1, 1))
    vals, idx = topk_rows(x, k) if k > 0 else (x[:, :0], chosen.new_zeros(x.shape[0], 0))
    return vals, idx, (x > c).sum(dim=1) + 1


def topk_rank_lse(x: torch.Tensor, k: int, chosen: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``topk_with_rank(x, k, chosen)`` and each row's log-softmax normaliser, so that
    ``log_softmax(x) = (x - shift) - log_sum`` row by row (torch's formula): ``shift`` the
    row's maximum, ``log_sum`` = log sum_j exp(x[j] - shift). A row holding a NaN has a
    NaN normaliser (as ``torch.log_softmax``'s row).

    Args:
        x: float32 [N, V] (other dtypes and devices through torch ops); k: 0..V;
        chosen: int64 [N], column indices in [0, V).

    Returns:
        (values [N, k] descending, indices int64 [N, k], ranks int64 [N],
        shift float32 [N], log_sum float32 [N]).

    Raises:
        RuntimeError: k > V, or a chosen index outside the row.
    """
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
    """``x.argmax(dim=1)`` of x [N, V] (float; int64 [N]) with its rule for ties (the first
    index of the maximum) and NaN (the first NaN), on the CPU in two stages: the row's chunk
    maxima (``ARGMAX_CHUNK`` values each, plus the partial last chunk), the first chunk
    whose maximum is the row's, then the first index of that value in that chunk. On the
    CPU ``torch.argmax`` is ~10x slower than ``amax`` over the same values (64 x 49,152
    float32, 2 threads: 2.2 ms against 0.24): a greedy decode step of 64 requests spent
    ~4 ms in it. Exact: the same indices as ``torch.argmax``; a row's result depends on
    that row only. Rows holding a NaN, rows narrower than 4 chunks, and other devices go to
    ``torch.argmax``."""
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
