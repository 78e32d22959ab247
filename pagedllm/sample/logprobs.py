"""Log probabilities of chosen tokens and of the most likely ones, from the model's raw
distribution (``log_softmax`` of the logits before any processing: vLLM's default
``raw_logprobs`` mode)."""
from __future__ import annotations

import torch

from pagedllm.messages import TokenLogprobs
from pagedllm.sample.topk import topk_with_rank


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """float32 [N, V] ``log_softmax`` of ``logits`` [N, V] (any float dtype)."""
    return torch.log_softmax(logits.float(), dim=-1)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """Per row: the chosen token's logprob and rank, then the ``num_top[i]`` most likely.

    Args:
        logprobs: float32 [N, V], from ``raw_logprobs``.
        token_ids: int64 [N], the token chosen at each row (sampled, or the next prompt
            token for prompt logprobs).
        num_top: per row, how many top tokens to add (0..20).

    Returns:
        N ``TokenLogprobs``: ``token_ids[0]`` is the chosen token with its rank (1 = the
        most likely; ties share the best rank), then the top tokens in order (ranks 1..k).
    """
    N = logprobs.shape[0]
    if N == 0:
        return []
    chosen = logprobs.gather(1, token_ids.view(-1, 1)).squeeze(1)
    k = max(num_top)
    top_v, top_i, ranks = topk_with_rank(logprobs, k, token_ids)
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
