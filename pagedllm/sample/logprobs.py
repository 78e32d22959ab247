"""Log probabilities of chosen tokens and of the most likely ones, from the model's raw
distribution (``log_softmax`` of the logits before any processing: vLLM's default
``raw_logprobs`` mode). The runner hands over the raw logits themselves: the edits of
``process_logits`` are undone after sampling (``RawLogitsSave``) instead of a full
[N, V] ``log_softmax`` taken before them (on 2 CPU threads, 0.5-1 ms for 32 x 49,152,
as much as the row copy it would replace)."""
from __future__ import annotations

import torch

from pagedllm.messages import TokenLogprobs
from pagedllm.sample.topk import topk_rank_lse


def gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """Per row: the chosen token's logprob and rank, then the ``num_top[i]`` most likely,
    all of ``log_softmax(logits)`` without materialising it: one pass per row finds the
    top tokens, the chosen token's rank and the normaliser (``topk_rank_lse``), and only
    the values returned are shifted, as ``(x - max) - log sum exp(x - max)``.

    Args:
        logits: float32 [N, V], the model's raw logits (before any processing).
        token_ids: int64 [N], the token chosen at each row (sampled, or the next prompt
            token for prompt logprobs).
        num_top: per row, how many top tokens to add (0..20).

    Returns:
        N ``TokenLogprobs``: ``token_ids[0]`` is the chosen token with its rank (1 = the
        most likely; ties share the best rank), then the top tokens in order (ranks 1..k).
    """
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
