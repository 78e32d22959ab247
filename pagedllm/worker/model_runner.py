"""ModelRunner: turns a SchedulerOutput into one flattened, unpadded batch, runs the
model, and samples.

It keeps a persistent input batch (``worker/input_batch.py``) updated by the scheduler's
deltas; per step it gathers from it, vectorised: ``input_ids[T]``, ``positions[T]``,
``query_start_loc[B+1]``, ``seq_lens[B]``, ``slot_mapping[T]`` and
``block_table[B, max_blocks]``. Requests with one query token (decodes) are placed first,
which the attention backends use to batch them. Logits are computed only at the last
position of requests that reach the end of their known tokens this step.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from pagedllm.attention.backend import FP8_DTYPES, CommonAttentionMetadata, get_attention_backend
from pagedllm.config import EngineConfig
from pagedllm.forward_context import set_forward_context
from pagedllm.layers import bind_kv_cache, describe_compute_path, describe_kv_scales
from pagedllm.messages import ModelRunnerOutput, SchedulerOutput
from pagedllm.sample.sampler import Sampler, SamplingMetadata
from pagedllm.utils import cdiv, empty_cpu_hugepages
from pagedllm.worker.input_batch import CachedRequestState, InputBatch

logger = logging.getLogger("pagedllm")


class ModelRunner:
    """Owns the model weights, the KV-cache tensor (in ``config.kv_cache_dtype``) and the
    sampler on one device."""

    def __init__(self, config: EngineConfig):
        from pagedllm.models.registry import build_model

        self.config = config
        self.device = config.device
        self.dtype = config.dtype
        self.kv_cache_dtype = config.kv_cache_dtype
        arch = config.arch
        self.block_size = config.args.block_size
        self.attn = get_attention_backend(config.args.attention_backend, self.device, self.dtype,
                                          self.kv_cache_dtype)
        self.model = build_model(config.model_path, arch, self.dtype, self.device,
                                 max_positions=max(config.max_model_len, 1),
                                 quant_config=config.quant_config)
        self.sampler = Sampler()
        self.kv_cache: torch.Tensor | None = None
        self.requests: dict[str, CachedRequestState] = {}
        self.input_batch: InputBatch | None = None   # made with the KV cache

    def describe_compute_path(self) -> str:
        """One line for the start-up log: which attention backend, kernels and linear
        implementation this runner uses (so fallbacks are visible)."""
        scales = f", {describe_kv_scales(self.model)}" if self.kv_cache_dtype in FP8_DTYPES else ""
        return f"attention backend {self.attn.describe()}{scales}, {describe_compute_path(self.model)}"

    def kv_bytes_per_block(self) -> int:
        """Bytes of K and V for one block across all layers, in the cache's dtype."""
        a = self.config.arch
        elem = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        return 2 * a.num_hidden_layers * self.block_size * a.num_key_value_heads * a.head_dim * elem

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache and the input batch (after KV sizing has fixed
        ``config.max_model_len``)."""
        max_len = self.config.max_model_len
        self.input_batch = InputBatch(self.config.args.max_num_seqs, max_len,
                                      cdiv(max_len, self.block_size))
        a = self.config.arch
        shape = self.attn.kv_cache_shape(a.num_hidden_layers, num_blocks, self.block_size,
                                         a.num_key_value_heads, a.head_dim)
        # Uninitialised on purpose (a 4 GiB zero-fill costs seconds at start-up): the
        # attention backends only read slots that were written. On the CPU, in huge
        # pages: decode attention reads it at random block addresses.
        if self.device.type == "cpu":
            self.kv_cache = empty_cpu_hugepages(shape, self.kv_cache_dtype)
        else:
            self.kv_cache = torch.empty(shape, dtype=self.kv_cache_dtype, device=self.device)
        bind_kv_cache(self.model, self.kv_cache, self.attn)

    # ------------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        """Apply the step's deltas to the persistent batch: forget finished requests,
        take rows out for requests not scheduled this step (kept in ``requests``), add new
        ones, and extend (or, after a preemption, replace) block tables."""
        batch = self.input_batch
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            if rid in batch.row_of:
                batch.remove(rid)
        scheduled = so.num_scheduled_tokens
        for rid in [r for r in batch.row_of if r not in scheduled]:
            batch.remove(rid, self.requests[rid])
        for nr in so.scheduled_new_reqs:
            g = None
            if nr.sampling_params.seed is not None:
                g = torch.Generator(device=self.device)
                g.manual_seed(nr.sampling_params.seed)
            st = CachedRequestState(nr.req_id, nr.prompt_token_ids, nr.sampling_params,
                                    nr.eos_token_ids, nr.block_ids, nr.num_computed_tokens, g)
            self.requests[nr.req_id] = st
            batch.add(st)
        c = so.scheduled_cached_reqs
        for rid, resumed, new_blocks, n_computed in zip(c.req_ids, c.resumed_from_preemption,
                                                         c.new_block_ids, c.num_computed_tokens):
            row = batch.row_of.get(rid)
            if row is None:   # back after a preemption or an unscheduled step
                st = self.requests[rid]
                st.block_ids = list(new_blocks) if resumed else st.block_ids + list(new_blocks)
                st.num_computed_tokens = n_computed
                batch.add(st)
                continue
            if resumed:
                batch.set_block_ids(row, new_blocks)
            else:
                batch.append_block_ids(row, new_blocks)
            batch.num_computed_tokens[row] = n_computed

    def _sampling_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        """Sampling tensors for the batch rows that sample this step (int64 [N])."""
        b = self.input_batch
        dev = self.device
        temp = b.temperature[rows]
        top_k, top_p, min_p = b.top_k[rows], b.top_p[rows], b.min_p[rows]
        random = (temp > 0) & (top_k != 1)   # top_k=1 is greedy (see Sampler)
        banned = None
        if b.stop_ids:
            below_min = (b.num_tokens[rows] - b.num_prompt_tokens[rows]) < b.min_tokens[rows]
            pending = set(rows[below_min].tolist()) & b.stop_ids.keys()
            pairs = [(i, t) for i, r in enumerate(rows.tolist()) if r in pending for t in b.stop_ids[r]]
            if pairs:
                banned = tuple(torch.tensor(x, device=dev) for x in zip(*pairs))
        to = lambda a: torch.from_numpy(a).to(dev)  # noqa: E731
        return SamplingMetadata(
            temperature=to(temp), top_k=to(top_k), top_p=to(top_p), min_p=to(min_p),
            generators=[b.generators.get(r) for r in rows.tolist()] if random.any() else [],
            all_greedy=not random.any(),
            need_top_k=bool((random & (top_k > 0)).any()),
            need_top_p=bool((random & (top_p < 1)).any()),
            need_min_p=bool((random & (min_p > 0)).any()),
            banned=banned)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: update the persistent batch, run the model over every scheduled
        token, sample where a request reaches the end of its known tokens.

        Returns:
            the scheduled requests (decodes first) and the tokens each produced.
        """
        if so.grammar_bitmask is not None or so.scheduled_spec_decode_tokens:
            raise NotImplementedError("structured outputs and speculative decoding are not implemented")
        self._update_states(so)
        if so.is_empty:
            return ModelRunnerOutput([], [])
        b = self.input_batch
        bs = self.block_size
        req_ids = list(so.num_scheduled_tokens)
        B = len(req_ids)
        rows = np.fromiter((b.row_of[r] for r in req_ids), dtype=np.int64, count=B)
        q_lens = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=B)
        # Decodes (one query token) first.
        order = np.argsort(q_lens != 1, kind="stable")
        rows, q_lens = rows[order], q_lens[order]
        req_ids = [req_ids[i] for i in order.tolist()]
        ctx = b.num_computed_tokens[rows]
        qsl = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        T = int(qsl[-1])
        num_decodes = int((q_lens == 1).sum())
        seq_lens = ctx + q_lens
        block_table = b.block_table[rows, : int(b.num_blocks[rows].max())]
        req_of_tok = np.repeat(np.arange(B), q_lens)
        pos = ctx[req_of_tok] + (np.arange(T) - qsl[:-1][req_of_tok])
        ids = b.token_ids[rows[req_of_tok], pos].astype(np.int64)
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

        sampled: list[list[int]] = [[] for _ in range(B)]
        sample_idx = np.flatnonzero(seq_lens >= b.num_tokens[rows])
        if len(sample_idx):
            last = torch.from_numpy(qsl[1:][sample_idx] - 1).to(dev)
            logits = self.model.compute_logits(hidden.index_select(0, last))
            srows = rows[sample_idx]
            tokens = self.sampler(logits, self._sampling_metadata(srows)).cpu().numpy()
            b.append_tokens(srows, tokens)
            for i, t in zip(sample_idx.tolist(), tokens.tolist()):
                sampled[i] = [t]
        return ModelRunnerOutput(req_ids, sampled)
