"""Token sampling from processed logits: greedy, temperature, min-p, top-k, top-p, per-request seeds."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.sample.topk import argmax_rows, topk_rows
from pagedllm.sampling_params import is_greedy


@dataclass
class SamplingMetadata:
    """Per-row sampling settings, N rows: temperature float32 [N]; top_k int64 [N] (0 = off);
    top_p, min_p float32 [N] (1.0 / 0.0 = off); a ``torch.Generator`` per seeded row, else
    None; ``all_greedy`` and ``need_*``: whether every row is greedy / some row uses a filter."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    generators: list[torch.Generator | None]
    all_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool


# Rows with top-k above this, or without top-k, sort the whole row (why: docs/notes/sample.md).
_TOPK_WIDTH_MAX = 4096


def _sort_filter(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    sorted_logits, idx = logits.sort(dim=-1, descending=False)
    V = logits.shape[-1]
    if k is not None:
        kk = torch.where(k > 0, k, torch.full_like(k, V)).clamp(max=V)
        thresh = sorted_logits.gather(1, (V - kk).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < thresh, float("-inf"))
    if p is not None:
        probs = sorted_logits.softmax(dim=-1)
        cum = probs.cumsum(dim=-1)
        drop = cum <= (1 - p).unsqueeze(1)
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, idx, sorted_logits)


def _topk_compact(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor | None, width: int,
                  min_p: torch.Tensor | None = None,
                  temperature: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min-p, top-k (ties at the k-th value kept) and top-p over each row's ``width`` largest
    logits (divided by ``temperature`` float32 [n] if given), for rows with 0 < k <= width.
    Returns (values [n, width] descending, dropped -inf; ids int64 [n, width]; ok bool [n],
    False where ties at the k-th value reach past ``width``)."""
    vals, idx = topk_rows(logits, width)                   # descending
    if temperature is not None:
        vals = vals / temperature.unsqueeze(1)
    if min_p is not None:
        vals = vals.masked_fill(vals < vals[:, :1] + torch.log(min_p).unsqueeze(1), float("-inf"))
    thresh = vals.gather(1, (k - 1).unsqueeze(1))
    # Ties at the k-th value may reach past the width only if the last candidate ties
    # too (the values are sorted); fewer survivors of min-p than k (threshold -inf) are
    # all among the candidates.
    ok = ((vals[:, -1:] < thresh) | torch.isneginf(thresh)).squeeze(1)
    vals = vals.masked_fill(vals < thresh, float("-inf"))
    if p is not None:
        probs = vals.softmax(dim=-1)
        above = probs.cumsum(dim=-1) - probs
        vals = vals.masked_fill((above >= p.unsqueeze(1)) & (p < 1).unsqueeze(1), float("-inf"))
    return vals, idx, ok


def _topk_filter(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor | None,
                 width: int) -> tuple[torch.Tensor, torch.Tensor]:
    vals, idx, ok = _topk_compact(logits, k, p, width)
    return torch.full_like(logits, float("-inf")).scatter_(1, idx, vals), ok


def _topk_width(k: int, vocab_size: int) -> int:
    """The ``topk`` width for top-k ``k``: the power of two >= k (at least 64), or 0 (sort)."""
    if not 0 < k <= _TOPK_WIDTH_MAX or k >= vocab_size:
        return 0
    w = max(64, 1 << (k - 1).bit_length())
    return w if w < vocab_size else 0


def _apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Mask logits outside the top-k set and the top-p nucleus (Holtzman et al. 2020); the
    most likely token always survives. A row's path depends on its own k only."""
    if k is None:
        return _sort_filter(logits, None, p)
    V = logits.shape[-1]
    widths = [_topk_width(kk, V) for kk in k.tolist()]
    out = torch.empty_like(logits)
    sort_rows = [i for i, w in enumerate(widths) if w == 0]
    for w in sorted(set(widths) - {0}):
        rows = torch.tensor([i for i, x in enumerate(widths) if x == w], device=logits.device)
        res, ok = _topk_filter(logits[rows], k[rows], None if p is None else p[rows], w)
        out[rows] = res
        sort_rows += rows[~ok].tolist()
    if sort_rows:
        rows = torch.tensor(sorted(sort_rows), device=logits.device)
        out[rows] = _sort_filter(logits[rows], k[rows], None if p is None else p[rows])
    return out


def fill_exponential_(row: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Exp(1) draws into ``row`` (float32, contiguous) in place, as -log(U), U from
    ``generator`` (global if None). Returns ``row``. Why not ``exponential_``: docs/notes/sample.md."""
    torch.rand(row.shape, generator=generator, out=row)
    return row.log_().neg_()


def fill_exponential_rows_(q: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """``fill_exponential_`` for each row of ``q`` [n, W], row j from ``generators[j]``. Returns ``q``."""
    for row, g in zip(q, generators):
        torch.rand(row.shape, generator=g, out=row)
    return q.log_().neg_()


def _probs(logits: torch.Tensor, md: SamplingMetadata, renormalize: bool) -> torch.Tensor:
    temp = torch.where(md.temperature > 0, md.temperature, torch.ones_like(md.temperature))
    x = logits.float() / temp.unsqueeze(1)
    if md.need_min_p:
        # p_i < min_p * p_max  <=>  x_i < x_max + log(min_p)
        top = x.max(dim=-1, keepdim=True).values
        x = x.masked_fill(x < top + torch.log(md.min_p).unsqueeze(1), float("-inf"))
    if md.need_top_k or md.need_top_p:
        x = _apply_top_k_top_p(x, md.top_k if md.need_top_k else None,
                               md.top_p if md.need_top_p else None)
    return x.softmax(dim=-1)


def compute_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The distribution each random row samples from, float32 [N, V] with rows summing to 1,
    from processed logits [N, V] (any float dtype); greedy rows are only guaranteed finite."""
    return _probs(logits, md, renormalize=True)


class Sampler:
    """Float32 logits [N, V] → token ids int64 [N]: argmax for greedy rows (first index on
    ties), else the exponential race argmax(p / E), E ~ Exp(1), per row from its own
    generator, so a seeded row never depends on the batch. Design: docs/notes/sample.md."""

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        if md.all_greedy:
            return argmax_rows(logits)
        random = (~is_greedy(md.temperature, md.top_k)).tolist()
        N, V = logits.shape
        # the greedy rows' argmax (all rows' when some are greedy: one pass either way)
        out = (argmax_rows(logits) if not all(random) else
               torch.zeros(N, dtype=torch.int64, device=logits.device))
        widths = [_topk_width(k, V) if r and md.need_top_k else 0 for k, r in zip(md.top_k.tolist(), random)]
        full = [i for i, (r, w) in enumerate(zip(random, widths)) if r and w == 0]
        dev = logits.device
        for w in sorted(set(widths) - {0}):
            rows = [i for i, x in enumerate(widths) if x == w]
            ri = torch.tensor(rows, device=dev)
            x = logits if len(rows) == N else logits.index_select(0, ri)
            vals, idx, ok = _topk_compact(x.float(), md.top_k[ri], md.top_p[ri] if md.need_top_p else None, w,
                                          md.min_p[ri] if md.need_min_p else None, md.temperature[ri])
            probs = vals.softmax(dim=-1)
            q = fill_exponential_rows_(torch.empty_like(probs), [md.generators[i] for i in rows])
            pick = idx.gather(1, (probs / q).argmax(dim=-1, keepdim=True)).squeeze(1)
            okl = ok.tolist()
            out[ri] = pick
            full += [i for i, good in zip(rows, okl) if not good]
        if full:
            full.sort()
            ri = torch.tensor(full, device=dev)
            sub = SamplingMetadata(md.temperature[ri], md.top_k[ri], md.top_p[ri], md.min_p[ri],
                                   [md.generators[i] for i in full], False,
                                   md.need_top_k, md.need_top_p, md.need_min_p)
            probs = _probs(logits.index_select(0, ri), sub, renormalize=False)
            q = fill_exponential_rows_(torch.empty_like(probs), sub.generators)
            out[ri] = argmax_rows(probs / q)
        return out
