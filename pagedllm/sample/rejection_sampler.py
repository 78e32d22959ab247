"""Lossless rejection sampling of speculative-decoding drafts (Leviathan et al. 2023;
Chen et al. 2023)."""
from __future__ import annotations

import torch

from pagedllm.sample.sampler import SamplingMetadata, _probs, fill_exponential_
from pagedllm.sample.topk import argmax_rows
from pagedllm.sampling_params import is_greedy


def _per_position(md: SamplingMetadata, req_of_pos: torch.Tensor) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=md.temperature[req_of_pos], top_k=md.top_k[req_of_pos],
        top_p=md.top_p[req_of_pos], min_p=md.min_p[req_of_pos], generators=[],
        all_greedy=md.all_greedy, need_top_k=md.need_top_k, need_top_p=md.need_top_p,
        need_min_p=md.need_min_p)


class RejectionSampler:
    """Verifies drafts so that outputs are distributed as the target's own samples (Leviathan
    et al. 2023, Algorithm 1; Chen et al. 2023). Request ``i`` with ``k_i`` drafts owns
    ``k_i + 1`` consecutive rows of ``target_logits`` (row j: after its j first drafts; the
    last: the bonus position). Draws per request from its own generator. Design:
    docs/notes/sample.md."""

    def __call__(self, target_logits: torch.Tensor, draft_token_ids: list[list[int]],
                 md: SamplingMetadata, draft_probs: torch.Tensor | None = None) -> list[list[int]]:
        """Accept a prefix of each request's drafts (``draft_token_ids``, k_i >= 0 each) and add one
        token. ``target_logits``: float32 [sum(k_i + 1), V], processed; ``md``: N rows, as for
        the Sampler; ``draft_probs``: float32 [sum k_i, V] request-major, or None (one-hot).
        Returns per request its accepted drafts plus one token.

        Raises:
            ValueError: inconsistent shapes or lengths, or a draft token outside [0, V)."""
        N = len(draft_token_ids)
        ks = [len(d) for d in draft_token_ids]
        K = sum(ks)
        flat = [t for d in draft_token_ids for t in d]
        self._check(target_logits, flat, ks, md, draft_probs)
        if N == 0:
            return []
        V = target_logits.shape[1]
        dev = target_logits.device

        k_t = torch.tensor(ks, dtype=torch.int64, device=dev)
        lens = k_t + 1
        starts = torch.cumsum(lens, 0) - lens                     # first row of each request
        req_of_pos = torch.repeat_interleave(torch.arange(N, device=dev), lens)    # [T]
        pos_in_req = torch.arange(K + N, device=dev) - starts[req_of_pos]
        draft_rows = (pos_in_req < k_t[req_of_pos]).nonzero().squeeze(1)          # [K]
        req_of_draft, j_of_draft = req_of_pos[draft_rows], pos_in_req[draft_rows]
        drafts = torch.tensor(flat, dtype=torch.int64, device=dev)
        greedy_ids = argmax_rows(target_logits)                                   # [T]
        accepted = greedy_ids[draft_rows] == drafts                               # [K]

        if md.all_greedy:
            n_acc = self._prefix_len(accepted, req_of_draft, j_of_draft, k_t)
            tokens = greedy_ids[starts + n_acc]
        else:
            random = ~is_greedy(md.temperature, md.top_k)                         # [N]
            p_raw = _probs(target_logits, _per_position(md, req_of_pos), renormalize=False)
            p = p_raw / p_raw.sum(dim=-1, keepdim=True) if md.need_min_p else p_raw
            rand_list = random.tolist()
            E = torch.ones(N, V, dtype=torch.float32, device=dev)
            u = torch.zeros(K, dtype=torch.float32, device=dev)
            d0 = 0
            for i, k in enumerate(ks):
                if rand_list[i]:
                    g = md.generators[i]
                    fill_exponential_(E[i], g)
                    if k:
                        u[d0:d0 + k].uniform_(generator=g)
                d0 += k
            p_d = p[draft_rows, drafts]
            if draft_probs is None:
                acc_rand = u < p_d
            else:
                acc_rand = u * draft_probs[torch.arange(K, device=dev), drafts].float() < p_d
            accepted = torch.where(random[req_of_draft], acc_rand, accepted)
            n_acc = self._prefix_len(accepted, req_of_draft, j_of_draft, k_t)
            final_rows = starts + n_acc                                           # [N]
            dist = p_raw[final_rows]
            rej = (random & (n_acc < k_t)).nonzero().squeeze(1)
            if rej.numel():
                p_rej = p[final_rows[rej]]
                qi = torch.cumsum(k_t, 0)[rej] - k_t[rej] + n_acc[rej]           # draft row
                if draft_probs is None:
                    resid = p_rej.scatter(1, drafts[qi].unsqueeze(1), 0.0)
                else:
                    resid = (p_rej - draft_probs[qi].float()).clamp_min(0.0)
                empty = (resid.sum(dim=-1, keepdim=True) <= 0)
                dist[rej] = torch.where(empty, p_rej, resid)
            sampled = argmax_rows(dist / E)
            tokens = torch.where(random, sampled, greedy_ids[final_rows])

        n_list, t_list = n_acc.tolist(), tokens.tolist()
        return [d[:n] + [t] for d, n, t in zip(draft_token_ids, n_list, t_list)]

    @staticmethod
    def _prefix_len(accepted: torch.Tensor, req: torch.Tensor, j: torch.Tensor,
                    k_t: torch.Tensor) -> torch.Tensor:
        """Per request, the number of leading accepted drafts (int64 [N])."""
        rejected = ~accepted
        return k_t.clone().scatter_reduce_(0, req[rejected], j[rejected], reduce="amin")

    @staticmethod
    def _check(target_logits: torch.Tensor, flat: list[int], ks: list[int],
               md: SamplingMetadata, draft_probs: torch.Tensor | None) -> None:
        N, K = len(ks), len(flat)
        if target_logits.dim() != 2:
            raise ValueError(f"target_logits must be [T, V], got shape "
                             f"{tuple(target_logits.shape)}")
        T, V = target_logits.shape
        if T != K + N:
            raise ValueError(f"target_logits has {T} rows but the {N} requests' drafts need "
                             f"sum(k_i + 1) = {K + N}")
        if md.temperature.shape[0] != N:
            raise ValueError(f"sampling metadata has {md.temperature.shape[0]} rows for {N} "
                             "requests")
        if not md.all_greedy and len(md.generators) != N:
            raise ValueError(f"sampling metadata has {len(md.generators)} generators for {N} "
                             "requests")
        if flat and not (0 <= min(flat) and max(flat) < V):
            raise ValueError(f"draft token ids must lie in [0, {V})")
        if draft_probs is not None and tuple(draft_probs.shape) != (K, V):
            raise ValueError(f"draft_probs must be [sum k_i, V] = [{K}, {V}], "
                             f"got {tuple(draft_probs.shape)}")
