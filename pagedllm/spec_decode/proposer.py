"""The runner's proposers (``propose``, ``remove_requests``, ``reset_request``,
``kv_bytes_per_block``, ``initialize_kv_cache``, ``describe``) from ``--speculative-config``."""
from __future__ import annotations

import numpy as np
import torch

from pagedllm.attention.backend import build_common_metadata
from pagedllm.attention.registry import get_attention_backend
from pagedllm.config import EngineConfig
from pagedllm.forward_context import set_forward_context


class ModelFreeProposer:
    """Adapts an n-gram or suffix proposer (token lookups, no model, no KV cache)."""

    is_model = False   # proposing is cheap: propose k, then keep what pays

    def __init__(self, impl, description: str):
        self.impl = impl
        self._description = description

    def describe(self) -> str:
        return self._description

    def kv_bytes_per_block(self, block_size: int) -> int:
        return 0

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        pass

    def propose(self, req_ids, token_ids, num_prompt_tokens, num_tokens_wanted, batch=None, rows=None):
        return self.impl.propose(req_ids, token_ids, num_prompt_tokens, num_tokens_wanted)

    def remove_requests(self, req_ids) -> None:
        self.impl.remove_requests(list(req_ids))

    def reset_request(self, req_id: str) -> None:
        pass   # the request's tokens are unchanged by a preemption


class DraftModelProposer:
    """A smaller model with the target's tokenizer proposes k argmax tokens (one-hot proposals),
    with its own paged KV cache on the target's block tables. ``config``: the target's
    engine config, whose ``speculative_config`` names the draft. Design: docs/notes/spec-decode.md.

    Raises:
        ValueError: ``speculative_config.draft_arch`` is None."""

    is_model = True   # each draft depth is a forward: the runner sizes proposals first

    def __init__(self, config: EngineConfig):
        from pagedllm.models.loader import build_model

        spec = config.speculative_config
        if spec.draft_arch is None:
            raise ValueError("speculative_config.draft_arch is not set: EngineConfig.from_args reads the "
                             "draft model's architecture")
        self.path = spec.model
        self.k = spec.num_speculative_tokens
        self.arch = spec.draft_arch
        self.device = config.device
        self.kv_cache_dtype = config.kv_cache_dtype
        self.attn = get_attention_backend(config.args.attention_backend, self.device, config.dtype,
                                          self.kv_cache_dtype)
        self.model = build_model(spec.model, self.arch, config.dtype, self.device,
                                 max_positions=max(config.max_model_len, 1))
        self.kv_cache: torch.Tensor | None = None
        self.block_size = 0
        self.num_computed: dict[str, int] = {}   # known tokens whose K/V the draft cache holds

    def describe(self) -> str:
        return (f"draft model {self.path} ({self.arch.architecture}, {self.arch.num_hidden_layers} layers), "
                f"k={self.k}")

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.arch.kv_bytes_per_block(block_size, self.kv_cache_dtype)

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        from pagedllm.layers import bind_kv_cache

        a = self.arch
        shape = self.attn.kv_cache_shape(a.num_hidden_layers, num_blocks, block_size,
                                         a.num_key_value_heads, a.head_dim)
        self.kv_cache = torch.empty(shape, dtype=self.kv_cache_dtype, device=self.device)
        self.block_size = block_size
        bind_kv_cache(self.model, self.kv_cache, self.attn)

    def remove_requests(self, req_ids) -> None:
        for rid in req_ids:
            self.num_computed.pop(rid, None)

    def reset_request(self, req_id: str) -> None:
        self.num_computed.pop(req_id, None)

    def _forward(self, batch, rows: np.ndarray, ctx: np.ndarray, q_lens: np.ndarray,
                 ids: np.ndarray | None) -> np.ndarray:
        """One draft forward over ``rows``: argmax at each request's last query position, int64 [B]."""
        block_table = batch.block_table[rows, : int(batch.num_blocks[rows].max())]
        common, pos, rot = build_common_metadata(ctx, q_lens, block_table, self.block_size, self.device)
        if ids is None:
            ids = batch.token_ids[rows[rot], pos]
        dev = self.device
        with set_forward_context(self.attn.build_metadata(common)):
            hidden = self.model(torch.from_numpy(ids.astype(np.int64)).to(dev), torch.from_numpy(pos).to(dev))
        last = torch.from_numpy(common.query_start_loc_np[1:] - 1).to(dev)
        return self.model.compute_logits(hidden.index_select(0, last)).argmax(dim=-1).cpu().numpy()

    @torch.inference_mode()
    def propose(self, req_ids, token_ids, num_prompt_tokens, num_tokens_wanted, batch=None, rows=None):
        """Drafts per request; ``batch`` / ``rows``: the runner's persistent batch and the rows."""
        wanted = np.array(num_tokens_wanted, dtype=np.int64)
        if not wanted.any():
            return [[] for _ in req_ids]   # nothing to draft: the catch-up waits for the next proposal
        sel = np.flatnonzero(wanted > 0)
        if len(sel) < len(req_ids):
            sub = self.propose([req_ids[i] for i in sel], [token_ids[i] for i in sel],
                               [num_prompt_tokens[i] for i in sel], wanted[sel].tolist(), batch, rows[sel])
            out = [[] for _ in req_ids]
            for i, p in zip(sel.tolist(), sub):
                out[i] = p
            return out
        B = len(req_ids)
        n = np.array([len(t) for t in token_ids], dtype=np.int64)
        # never write past the slots the request holds (the scheduler reserved k)
        room = batch.num_blocks[rows].astype(np.int64) * self.block_size - n + 1
        k = np.minimum(np.array(num_tokens_wanted, dtype=np.int64), room)
        c = np.array([min(self.num_computed.get(r, 0), int(m) - 1) for r, m in zip(req_ids, n)], dtype=np.int64)
        q = n - c
        order = np.argsort(q != 1, kind="stable")
        first = np.empty(B, dtype=np.int64)
        first[order] = self._forward(batch, rows[order], c[order], q[order], None)
        for rid, m in zip(req_ids, n.tolist()):
            self.num_computed[rid] = m
        drafts = [[int(t)] if kk > 0 else [] for t, kk in zip(first, k)]
        last = first
        for j in range(1, int(k.max(initial=0))):
            act = np.flatnonzero(k > j)
            toks = self._forward(batch, rows[act], n[act] + j - 1, np.ones(len(act), dtype=np.int64),
                                 last[act])
            last = last.copy()
            last[act] = toks
            for i, t in zip(act.tolist(), toks.tolist()):
                drafts[i].append(t)
        return drafts


def make_proposer(config: EngineConfig):
    """The proposer ``config.speculative_config`` asks for.

    Raises:
        ValueError: unknown speculative method."""
    spec = config.speculative_config
    if spec.method == "ngram":
        from pagedllm.spec_decode.ngram_proposer import NgramProposer

        return ModelFreeProposer(
            NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max),
            f"ngram k={spec.num_speculative_tokens}, n={spec.prompt_lookup_min}..{spec.prompt_lookup_max}")
    if spec.method == "suffix":
        from pagedllm.spec_decode.suffix_proposer import SuffixProposer

        return ModelFreeProposer(
            SuffixProposer(spec.num_speculative_tokens, spec.suffix_decoding_max_tree_depth,
                           spec.suffix_decoding_max_cached_requests, spec.suffix_decoding_max_spec_factor,
                           spec.suffix_decoding_min_token_prob),
            f"suffix k={spec.num_speculative_tokens}, depth {spec.suffix_decoding_max_tree_depth}")
    if spec.method == "draft_model":
        return DraftModelProposer(config)
    raise ValueError(f"unknown speculative method {spec.method!r}")
