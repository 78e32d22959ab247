"""Logprobs of chosen and most likely tokens from the raw distribution (vLLM's default
``raw_logprobs`` mode). Why raw logits are restored: docs/notes/sample.md."""
from __future__ import annotations

import torch

from pagedllm.messages import TokenLogprobs
from pagedllm.sample.topk import topk_rank_lse


def gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """Per row of raw float32 ``logits`` [N, V]: the logprob and rank (1 = most likely) of
    ``token_ids[i]`` (int64 [N]), then the ``num_top[i]`` (0..20) most likely, as N ``TokenLogprobs``."""
    N = logits.shape[0]
    if N == 0:
        return []
    k = max(num_top)
    top_v, top_i, ranks, shift, log_sum = topk_rank_lse(logits, k, token_ids)
    chosen = (logits.gather(1, token_ids.view(-1, 1)).squeeze(1).float() - shift) - log_sum
    top_v = (top_v.float() - shift.unsqueeze(1)) - log_sum.unsqueeze(1)
    top_v, top_i = top_v.tolist(), top_i.tolist()
    ids, vals, rk = token_ids.tolist(), chosen.tolist(), ranks.tolist()
    out = []
    for i in range(N):
        n = num_top[i]
        if n:
            out.append(TokenLogprobs([ids[i]] + top_i[i][:n], [vals[i]] + top_v[i][:n], rk[i]))
        else:
            out.append(TokenLogprobs([ids[i]], [vals[i]], rk[i]))
    return out
