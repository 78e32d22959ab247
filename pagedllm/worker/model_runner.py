"""ModelRunner: turns a SchedulerOutput into one flattened, unpadded batch, runs the
model, and samples.

Per step it builds (numpy, vectorised, on persistent host buffers): ``input_ids[T]``,
``positions[T]``, ``query_start_loc[B+1]``, ``seq_lens[B]``, ``slot_mapping[T]`` and
``block_table[B, max_blocks]``. Requests with one query token (decodes) are placed first,
which the attention backends use to batch them. Logits are computed only at the last
position of requests that sample this step.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from pagedllm.attention.backend import CommonAttentionMetadata, get_attention_backend
from pagedllm.config import EngineConfig
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.forward_context import set_forward_context
from pagedllm.layers import bind_kv_cache, describe_compute_path
from pagedllm.sample.sampler import Sampler, SamplingMetadata
from pagedllm.utils import empty_cpu_hugepages

logger = logging.getLogger("pagedllm")


class _ReqState:
    __slots__ = ("params", "generator")

    def __init__(self, params, generator):
        self.params = params
        self.generator = generator


class ModelRunner:
    """Owns the model weights, the KV-cache tensor and the sampler on one device."""

    def __init__(self, config: EngineConfig):
        from pagedllm.models.registry import build_model

        self.config = config
        self.device = config.device
        self.dtype = config.dtype
        arch = config.arch
        self.block_size = config.args.block_size
        self.attn = get_attention_backend(config.args.attention_backend, self.device, self.dtype)
        self.model = build_model(config.model_path, arch, self.dtype, self.device,
                                 max_positions=max(config.max_model_len, 1))
        self.sampler = Sampler()
        self.kv_cache: torch.Tensor | None = None
        self.states: dict[str, _ReqState] = {}
        self.eos_token_ids: set[int] = set(arch.eos_token_ids)
        n = config.args.max_num_batched_tokens
        self._ids = np.zeros(n, dtype=np.int64)
        self._pos = np.zeros(n, dtype=np.int64)

    def describe_compute_path(self) -> str:
        """One line for the start-up log: which attention backend, kernels and linear
        implementation this runner uses (so fallbacks are visible)."""
        attn = self.attn.name
        if attn == "cpu_kernel" and getattr(self.attn, "kernels", None) is None:
            attn = "cpu_kernel (kernels unavailable: torch ops)"
        return f"attention backend {attn}, {describe_compute_path(self.model)}"

    def kv_bytes_per_block(self) -> int:
        """Bytes of K and V for one block across all layers."""
        a = self.config.arch
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * a.num_hidden_layers * self.block_size * a.num_key_value_heads * a.head_dim * elem

    def initialize_kv_cache(self, num_blocks: int) -> None:
        a = self.config.arch
        shape = self.attn.kv_cache_shape(a.num_hidden_layers, num_blocks, self.block_size,
                                         a.num_key_value_heads, a.head_dim)
        # Uninitialised on purpose (a 4 GiB zero-fill costs seconds at start-up): the
        # attention backends only read slots that were written. On the CPU, in huge
        # pages: decode attention reads it at random block addresses.
        if self.device.type == "cpu":
            self.kv_cache = empty_cpu_hugepages(shape, self.dtype)
        else:
            self.kv_cache = torch.empty(shape, dtype=self.dtype, device=self.device)
        bind_kv_cache(self.model, self.kv_cache, self.attn)

    # ------------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.states.pop(rid, None)
        for sr in so.scheduled:
            if sr.sampling_params is not None:
                sp = sr.sampling_params
                g = None
                if sp.seed is not None:
                    g = torch.Generator(device=self.device)
                    g.manual_seed(sp.seed)
                self.states[sr.req_id] = _ReqState(sp, g)

    def _sampling_metadata(self, reqs) -> SamplingMetadata:
        params = [self.states[sr.req_id].params for sr in reqs]
        dev = self.device
        temp = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=dev)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)
        banned_rows, banned_cols = [], []
        for i, (sr, p) in enumerate(zip(reqs, params)):
            if sr.num_output_tokens < p.min_tokens:
                ids = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
                for t in ids:
                    banned_rows.append(i)
                    banned_cols.append(t)
        banned = None
        if banned_rows:
            banned = (torch.tensor(banned_rows, device=dev), torch.tensor(banned_cols, device=dev))
        return SamplingMetadata(
            temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
            generators=[self.states[sr.req_id].generator for sr in reqs],
            all_greedy=all(p.temperature == 0 for p in params),
            need_top_k=any(p.top_k > 0 and p.temperature > 0 for p in params),
            need_top_p=any(p.top_p < 1 and p.temperature > 0 for p in params),
            need_min_p=any(p.min_p > 0 and p.temperature > 0 for p in params),
            banned=banned)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> dict[str, int]:
        """Run one step.

        Returns:
            req_id → sampled token id, for each request whose ``sample`` flag is set.
        """
        self._update_states(so)
        if not so.scheduled:
            return {}
        # Decodes (one query token) first.
        reqs = sorted(so.scheduled, key=lambda r: r.num_scheduled_tokens != 1)
        B = len(reqs)
        bs = self.block_size
        q_lens = np.fromiter((r.num_scheduled_tokens for r in reqs), dtype=np.int64, count=B)
        ctx = np.fromiter((r.num_computed_tokens for r in reqs), dtype=np.int64, count=B)
        qsl = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        T = int(qsl[-1])
        num_decodes = int((q_lens == 1).sum())
        seq_lens = ctx + q_lens
        max_blocks = max(len(r.block_ids) for r in reqs)
        block_table = np.zeros((B, max_blocks), dtype=np.int32)
        for i, r in enumerate(reqs):
            block_table[i, : len(r.block_ids)] = r.block_ids
        ids = self._ids[:T] if T <= len(self._ids) else np.zeros(T, dtype=np.int64)
        pos = self._pos[:T] if T <= len(self._pos) else np.zeros(T, dtype=np.int64)
        ids[:] = [t for r in reqs for t in r.token_ids]
        req_of_tok = np.repeat(np.arange(B), q_lens)
        pos[:] = ctx[req_of_tok] + (np.arange(T) - qsl[:-1][req_of_tok])
        slot_mapping = block_table[req_of_tok, pos // bs].astype(np.int64) * bs + pos % bs

        dev = self.device
        to = (lambda a: torch.from_numpy(a)) if dev.type == "cpu" else (
            lambda a: torch.from_numpy(a).to(dev, non_blocking=True))
        common = CommonAttentionMetadata(
            num_reqs=B, num_tokens=T, num_decodes=num_decodes,
            query_start_loc=to(qsl.astype(np.int32)), seq_lens=to(seq_lens.astype(np.int32)),
            context_lens=to(ctx.astype(np.int32)), block_table=to(block_table),
            slot_mapping=to(slot_mapping), block_size=bs,
            query_start_loc_np=qsl, seq_lens_np=seq_lens, context_lens_np=ctx,
            block_table_np=block_table)
        attn_md = self.attn.build_metadata(common)
        with set_forward_context(attn_md):
            hidden = self.model(to(ids), to(pos))

        sample_rows = [i for i, r in enumerate(reqs) if r.sample]
        if not sample_rows:
            return {}
        last = torch.from_numpy(qsl[1:][sample_rows] - 1).to(dev)
        logits = self.model.compute_logits(hidden.index_select(0, last))
        sreqs = [reqs[i] for i in sample_rows]
        tokens = self.sampler(logits, self._sampling_metadata(sreqs)).tolist()
        return {r.req_id: t for r, t in zip(sreqs, tokens)}
