"""ModelRunner: turns a SchedulerOutput into one flattened, unpadded batch, runs the
model, and samples (after vLLM V1's GPUModelRunner).

Per step it gathers from the persistent ``InputBatch``: ``input_ids[T]``,
``positions[T]``, ``query_start_loc[B+1]``, ``seq_lens[B]``, ``slot_mapping[T]`` and
``block_table[B, max_blocks]``, decodes (one query token) first. Logits are computed only
where a request reaches the end of its known tokens (k + 1 rows for k drafts). One
attention metadata per (KV-cache group, window). How drafts, KV-cache groups and grammar
bitmasks flow through a step: docs/notes/worker.md.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.attention.backend import FP8_DTYPES, build_common_metadata
from pagedllm.attention.registry import get_attention_backend
from pagedllm.config import EngineConfig
from pagedllm.distributed import get_tp_size
from pagedllm.forward_context import set_forward_context
from pagedllm.layers import bind_kv_cache, describe_compute_path, describe_kv_scales
from pagedllm.messages import ModelRunnerOutput, SchedulerOutput
from pagedllm.sample.logits_processors import LogitsProcessorInputs, RawLogitsSave, process_logits, token_presence
from pagedllm.sample.logprobs import gather_logprobs
from pagedllm.sample.rejection_sampler import RejectionSampler
from pagedllm.sample.sampler import Sampler, SamplingMetadata
from pagedllm.sampling_params import is_greedy
from pagedllm.spec_decode.adaptive import AdaptiveDraftLength
from pagedllm.structured_output import apply_token_bitmask, unpack_bitmask
from pagedllm.utils import cdiv
from pagedllm.worker.compiled_step import CompiledStep, make_compiled_step
from pagedllm.worker.input_batch import CachedRequestState, InputBatch
from pagedllm.worker.input_buffers import InputBuffers
from pagedllm.worker.prefill import calibrate_smoothquant

logger = logging.getLogger("pagedllm")


@dataclass
class SamplingStep:
    """One step's sampling inputs and outputs (``ModelRunner._sample``). ``hidden``
    [T, hidden_size]; ``rows``, ``num_draft`` int64 [B]; ``query_start_loc`` int64 [B+1];
    ``sample_idx`` int64 [S] (indices into ``req_ids``). ``sampled`` and ``logprobs`` are
    filled by ``_sample``."""

    scheduler_output: SchedulerOutput
    hidden: torch.Tensor
    req_ids: list[str]
    rows: np.ndarray
    query_start_loc: np.ndarray
    sample_idx: np.ndarray
    num_draft: np.ndarray
    sampled: list[list[int]] = field(init=False)
    logprobs: dict[str, list] = field(default_factory=dict)

    def __post_init__(self):
        self.sampled = [[] for _ in self.req_ids]


class ModelRunner:
    """Owns the model weights, the KV-cache tensor (in ``config.kv_cache_dtype``) and the
    sampler on one device."""

    def __init__(self, config: EngineConfig):
        from pagedllm.models.loader import build_model

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
                                 quant_config=config.quant_config, calibrate=calibrate_smoothquant,
                                 load_format=config.args.load_format, seed=config.args.seed)
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler()
        self.spec = config.speculative_config
        self.proposer = None
        self.draft_length = None
        if self.spec is not None:
            from pagedllm.spec_decode.proposer import make_proposer

            self.proposer = make_proposer(config)
            self.draft_length = AdaptiveDraftLength(self.spec.num_speculative_tokens,
                                                    enabled=self.spec.adaptive)
        self.kv_cache_config = config.kv_cache_config
        kvc = self.kv_cache_config
        # one attention metadata per (KV-cache group, window) pair; every layer's index into them
        self.attn_groups: list[tuple[int, int | None]] = []
        self.layer_attn_group: dict[int, int] = {}
        self.layer_cache_slot: dict[int, int] = {}
        for layer in range(arch.num_hidden_layers):
            g, slot = kvc.layer_location(layer)
            key = (g, kvc.layer_windows[layer])
            if key not in self.attn_groups:
                self.attn_groups.append(key)
            self.layer_attn_group[layer] = self.attn_groups.index(key)
            self.layer_cache_slot[layer] = slot
        self.kv_cache: torch.Tensor | None = None
        self.requests: dict[str, CachedRequestState] = {}
        self._prompt_lp_sent: dict[str, int] = {}   # prompt positions whose logprobs were sent
        self.input_batch: InputBatch | None = None   # made with the KV cache
        self.input_buffers: InputBuffers | None = None   # the step's device inputs, made with the KV cache
        self.compiled_step: CompiledStep | None = None   # CUDA graphs or the CPU's fused stack

    def describe_compute_path(self) -> str:
        """One start-up log line: attention backend, kernels, linear implementation."""
        scales = f", {describe_kv_scales(self.model)}" if self.kv_cache_dtype in FP8_DTYPES else ""
        spec = f", speculative decoding: {self.proposer.describe()}" if self.proposer is not None else ""
        attn = self.attn.describe(self.config.arch.head_dim, self.block_size,
                                  list(self.kv_cache_config.layer_windows))
        why = f" [{self.attn.why}]" if self.attn.why else ""
        extra = [self.compiled_step.compute_path()] if self.compiled_step is not None else []
        return f"attention backend {attn}{why}{scales}, {describe_compute_path(self.model, extra)}{spec}"

    def describe_decoder(self) -> str | None:
        """How the decoder layers run once the KV cache is bound (the compiled step's
        ``compute_path``: CUDA graphs, the CPU's fused stack, or per-layer and why), or None."""
        return self.compiled_step.compute_path()[1] if self.compiled_step is not None else None

    def metadata_for_graph(self, common):
        """The attention metadata a captured step reads: one object, or one per attention group."""
        if len(self.attn_groups) == 1:
            return self.attn.build_graph_metadata(common, self.attn_groups[0][1])
        return [self.attn.build_graph_metadata(common, window) for _, window in self.attn_groups]

    def kv_bytes_per_block(self) -> int:
        """Bytes of K and V for one block id across ``layers_per_block`` layers (plus the
        draft model's cache, which shares block ids)."""
        own = self.config.arch.kv_bytes_per_block(self.block_size, self.kv_cache_dtype,
                                                  self.kv_cache_config.layers_per_block, get_tp_size())
        return own + (self.proposer.kv_bytes_per_block(self.block_size) if self.proposer is not None else 0)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache and the input batch (after KV sizing)."""
        max_len = self.config.max_model_len
        kvc = self.kv_cache_config
        self.input_batch = InputBatch(self.config.args.max_num_seqs, max_len,
                                      cdiv(max_len, self.block_size), kvc.num_groups)
        a = self.config.arch
        shape = self.attn.kv_cache_shape(kvc.layers_per_block, num_blocks, self.block_size,
                                         a.num_kv_heads_per_rank(get_tp_size()), a.head_dim)
        # Uninitialised on purpose: backends only read slots that were written. Normal
        # pages, not huge pages. Why: docs/notes/worker.md.
        self.kv_cache = torch.empty(shape, dtype=self.kv_cache_dtype, device=self.device)
        bind_kv_cache(self.model, self.kv_cache, self.attn, self.layer_cache_slot, self.layer_attn_group)
        if self.proposer is not None:
            self.proposer.initialize_kv_cache(num_blocks, self.block_size)
        args = self.config.args
        self.input_buffers = InputBuffers(max(args.max_num_batched_tokens, args.max_num_seqs), args.max_num_seqs,
                                          cdiv(max_len, self.block_size), self.device)
        self.compiled_step = make_compiled_step(self)
        capture = getattr(self.compiled_step, "capture", None)
        if capture is not None:
            capture()   # the worker logs how long it took and what it holds

    # ------------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        """Apply the step's deltas to the persistent batch (finished, unscheduled, new
        requests; block tables extended or, after a preemption, replaced)."""
        batch = self.input_batch
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            self._prompt_lp_sent.pop(rid, None)
            if rid in batch.row_of:
                batch.remove(rid)
        if self.proposer is not None and so.finished_req_ids:
            self.proposer.remove_requests(so.finished_req_ids)
            for rid in so.finished_req_ids:
                self.draft_length.remove(rid)
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
        freed = c.num_freed_blocks or [0] * len(c.req_ids)
        for rid, resumed, new_blocks, n_computed, n_freed in zip(
                c.req_ids, c.resumed_from_preemption, c.new_block_ids, c.num_computed_tokens, freed):
            if resumed and self.proposer is not None:
                self.proposer.reset_request(rid)   # its blocks are new: a draft cache starts over
            row = batch.row_of.get(rid)
            if row is None:   # back after a preemption or an unscheduled step
                st = self.requests[rid]
                st.block_ids = ([list(ids) for ids in new_blocks] if resumed else
                                [old[: len(old) - n_freed] + list(ids) for old, ids in zip(st.block_ids, new_blocks)])
                st.num_computed_tokens = n_computed
                batch.add(st)
                continue
            if resumed:
                batch.set_block_ids(row, new_blocks)
            else:
                batch.num_blocks[row] -= n_freed
                batch.append_block_ids(row, new_blocks)
            batch.num_computed_tokens[row] = n_computed

    def _processor_inputs(self, lrows: np.ndarray, lens: np.ndarray) -> LogitsProcessorInputs:
        """``process_logits`` inputs for N logit rows: ``lrows`` int64 [N] batch rows,
        ``lens`` int64 [N] tokens before each sampled position (drafts included)."""
        b = self.input_batch
        dev = self.device
        inp = LogitsProcessorInputs()
        N = len(lrows)
        V = self.config.arch.vocab_size
        lr = lrows.tolist()
        if b.allowed_ids:
            idx = [i for i in range(N) if lr[i] in b.allowed_ids]
            if idx:
                mask = torch.zeros(len(idx), V, dtype=torch.bool)
                for j, i in enumerate(idx):
                    mask[j, torch.from_numpy(b.allowed_ids[lr[i]])] = True
                inp.allowed = (torch.tensor(idx, device=dev), mask.to(dev))
        pairs: list[tuple[int, int]] = []
        if b.stop_ids or b.bad_words:
            n_out = lens - b.num_prompt_tokens[lrows]
            for i in range(N):
                r = lr[i]
                ids = b.stop_ids.get(r)
                if ids is not None and n_out[i] < b.min_tokens[r]:
                    pairs.extend((i, t) for t in ids)
                words = b.bad_words.get(r)
                if words:
                    out = b.token_ids[r, b.num_prompt_tokens[r]: lens[i]]
                    for w in words:
                        k = len(w) - 1
                        if k == 0 or (len(out) >= k and out[len(out) - k:].tolist() == w[:-1]):
                            pairs.append((i, w[-1]))
        if pairs:
            inp.banned = tuple(torch.tensor(x, device=dev) for x in zip(*pairs))
        if b.logit_bias:
            rows_, toks_, vals_ = [], [], []
            for i in range(N):
                bias = b.logit_bias.get(lr[i])
                if bias is not None:
                    rows_.append(np.full(len(bias[0]), i))
                    toks_.append(bias[0])
                    vals_.append(bias[1])
            if rows_:
                inp.bias = (torch.from_numpy(np.concatenate(rows_)).to(dev),
                            torch.from_numpy(np.concatenate(toks_)).to(dev),
                            torch.from_numpy(np.concatenate(vals_)).to(dev))
        rep, freq, pres = (b.repetition_penalty[lrows], b.frequency_penalty[lrows], b.presence_penalty[lrows])
        need = np.flatnonzero((rep != 1) | (freq != 0) | (pres != 0))
        if len(need):
            prow, plen = lrows[need], lens[need]
            hist = torch.from_numpy(b.token_ids[prow, : int(plen.max())].astype(np.int64)).to(dev)
            to = lambda a: torch.from_numpy(a).to(dev)  # noqa: E731
            inp.seen = token_presence(hist, to(b.num_prompt_tokens[prow]), to(plen), V)
            inp.penalty_rows = to(need.astype(np.int64))
            inp.repetition, inp.frequency, inp.presence = to(rep[need]), to(freq[need]), to(pres[need])
        return inp

    def _sampling_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        """Sampling tensors for the batch rows that sample this step (int64 [N])."""
        b = self.input_batch
        dev = self.device
        temp = b.temperature[rows]
        top_k, top_p, min_p = b.top_k[rows], b.top_p[rows], b.min_p[rows]
        random = ~is_greedy(temp, top_k)
        to = lambda a: torch.from_numpy(a).to(dev)  # noqa: E731
        return SamplingMetadata(
            temperature=to(temp), top_k=to(top_k), top_p=to(top_p), min_p=to(min_p),
            generators=[b.generators.get(r) for r in rows.tolist()] if random.any() else [],
            all_greedy=not random.any(),
            need_top_k=bool((random & (top_k > 0)).any()),
            need_top_p=bool((random & (top_p < 1)).any()),
            need_min_p=bool((random & (min_p > 0)).any()))

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: update the batch, run the model over every scheduled token
        (drafts included), sample, propose next drafts. Requests in the output are in batch
        order (decodes first)."""
        self._update_states(so)
        if so.is_empty:
            return ModelRunnerOutput([], [])
        b = self.input_batch
        req_ids = list(so.num_scheduled_tokens)
        B = len(req_ids)
        rows = np.fromiter((b.row_of[r] for r in req_ids), dtype=np.int64, count=B)
        q_lens = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=B)
        # Decodes (one query token) first.
        order = np.argsort(q_lens != 1, kind="stable")
        rows, q_lens = rows[order], q_lens[order]
        req_ids = [req_ids[i] for i in order.tolist()]
        spec = so.scheduled_spec_decode_tokens
        num_draft = np.zeros(B, dtype=np.int64)
        if spec:
            for i, rid in enumerate(req_ids):
                d = spec.get(rid)
                if d:
                    r, nt = rows[i], b.num_tokens[rows[i]]
                    b.token_ids[r, nt: nt + len(d)] = d   # inputs past the known tokens
                    num_draft[i] = len(d)
        ctx = b.num_computed_tokens[rows]
        max_blocks = int(b.num_blocks[rows].max())
        buffers = self.input_buffers
        common, pos, req_of_tok = build_common_metadata(ctx, q_lens, b.block_tables[0, rows, :max_blocks],
                                                        self.block_size, self.device, buffers)
        ids = b.token_ids[rows[req_of_tok], pos].astype(np.int64)
        if buffers.fits(len(ids), B, max_blocks):
            ids_t, pos_t = buffers.stage("input_ids", ids), buffers.stage("positions", pos)
        else:
            ids_t, pos_t = torch.from_numpy(ids).to(self.device), torch.from_numpy(pos).to(self.device)
        t_start = time.perf_counter()
        attn_md = self._attention_metadata(common, ctx, q_lens, rows, max_blocks)
        with set_forward_context(attn_md):
            hidden = self.compiled_step.run(ids_t, pos_t, common, attn_md) if self.compiled_step else None
            if hidden is None:
                hidden = self.model(ids_t, pos_t)

        qsl = common.query_start_loc_np
        sample_idx = np.flatnonzero(common.seq_lens_np >= b.num_tokens[rows])
        step = SamplingStep(so, hidden, req_ids, rows, qsl, sample_idx, num_draft)
        if len(sample_idx):
            self._sample(step)
        prompt_lp = self._prompt_logprobs(hidden, req_ids, rows, qsl, ctx, q_lens)
        spec_out = []
        if self.proposer is not None:
            # sampled token lists are on the host now, so the forward has finished
            step_s = time.perf_counter() - t_start
            if len(sample_idx) == B and int(q_lens.max()) <= 1 + self.spec.num_speculative_tokens:
                # a decode step (no prompt chunk): what T scored tokens cost
                self.draft_length.cost_model.record(common.num_tokens, step_s)
            spec_out = self._propose(req_ids, rows, sample_idx)
        return ModelRunnerOutput(req_ids, step.sampled, spec_out, step.logprobs, prompt_lp)

    def _attention_metadata(self, common, ctx, q_lens, rows, max_blocks):
        """One metadata object, or a list per (KV-cache group, window) pair."""
        if len(self.attn_groups) == 1:
            return self.attn.build_metadata(common, self.attn_groups[0][1])
        commons = {0: common}
        out = []
        for g, window in self.attn_groups:
            if g not in commons:
                commons[g] = build_common_metadata(ctx, q_lens, self.input_batch.block_tables[g, rows, :max_blocks],
                                                   self.block_size, self.device)[0]
            out.append(self.attn.build_metadata(commons[g], window))
        return out

    def _sample(self, step: SamplingStep) -> None:
        """Sample ``step.sample_idx`` (1 logit row per plain request, k + 1 with k drafts);
        logprobs come from the raw logits. Fills ``step.sampled``/``step.logprobs`` and
        appends the tokens to the batch."""
        b = self.input_batch
        dev = self.device
        so, hidden, req_ids, rows = step.scheduler_output, step.hidden, step.req_ids, step.rows
        sample_idx, num_draft, sampled = step.sample_idx, step.num_draft, step.sampled
        spec = so.scheduled_spec_decode_tokens
        ends = step.query_start_loc[1:][sample_idx]
        nd = num_draft[sample_idx]
        counts = nd + 1
        first = np.cumsum(counts) - counts            # first logit row of each request
        idx = np.repeat(ends - counts - first, counts) + np.arange(int(counts.sum()))
        srows = rows[sample_idx]
        lrows = np.repeat(srows, counts)
        lens = np.repeat(b.num_tokens[srows], counts) + (np.arange(len(lrows)) - np.repeat(first, counts))
        logits = self.model.compute_logits(hidden.index_select(0, torch.from_numpy(idx).to(dev)))
        n_lp = b.num_logprobs[lrows]
        lp_rows = np.flatnonzero(n_lp >= 0)
        grammar = None
        if so.grammar_bitmask is not None:
            row_req_ids = [req_ids[i] for i, c in zip(sample_idx.tolist(), counts.tolist()) for _ in range(c)]
            grammar = lambda x: self._apply_grammar_bitmask(x, row_req_ids, so)  # noqa: E731
        proc_inp = self._processor_inputs(lrows, lens)
        # logprobs read the raw logits: what processing overwrites in their rows is kept
        # and written back after sampling (the samplers only read ``logits``)
        raw_save = (RawLogitsSave(logits, proc_inp, torch.from_numpy(lp_rows).to(dev), grammar is not None)
                    if len(lp_rows) else None)
        process_logits(logits, proc_inp, grammar)
        chosen = np.zeros(len(lrows), dtype=np.int64)   # token chosen at each logit row (-1: none)
        chosen[:] = -1
        plain = nd == 0
        if plain.any():
            pi = sample_idx[plain]
            prow = srows[plain]
            # every row plain (no drafts): the logit rows are the requests' rows, no copy
            x = logits if plain.all() else logits.index_select(0, torch.from_numpy(first[plain]).to(dev))
            tokens = self.sampler(x, self._sampling_metadata(prow)).cpu().numpy()
            b.append_tokens(prow, tokens)
            chosen[first[plain]] = tokens
            for i, t in zip(pi.tolist(), tokens.tolist()):
                sampled[i] = [t]
        if not plain.all():
            sp_ = ~plain
            si = sample_idx[sp_]
            rsel = np.flatnonzero(np.repeat(sp_, counts))
            drafts = [spec[req_ids[i]] for i in si.tolist()]
            outs = self.rejection_sampler(logits.index_select(0, torch.from_numpy(rsel).to(dev)), drafts,
                                          self._sampling_metadata(srows[sp_]))
            for i, r, f, d, toks in zip(si.tolist(), srows[sp_].tolist(), first[sp_].tolist(), drafts, outs):
                nt = b.num_tokens[r]
                b.token_ids[r, nt: nt + len(toks)] = toks
                b.num_tokens[r] = nt + len(toks)
                chosen[f: f + len(toks)] = toks
                sampled[i] = toks
                self.draft_length.record(req_ids[i], len(d), len(toks) - 1)
        if raw_save is not None:
            raw_save.restore(logits)
            keep = chosen[lp_rows] >= 0
            if keep.any():
                # every logit row wanted and kept (no rejected drafts): no [N, V] copy
                sel = lp_rows[keep]
                ent = gather_logprobs(logits if len(sel) == len(lrows) else
                                      logits.index_select(0, torch.from_numpy(sel).to(dev)),
                                      torch.from_numpy(chosen[lp_rows][keep]).to(dev),
                                      n_lp[lp_rows][keep].tolist())
                owner = np.repeat(sample_idx, counts)[lp_rows][keep]
                for i, e in zip(owner.tolist(), ent):
                    step.logprobs.setdefault(req_ids[i], []).append(e)

    def _prompt_logprobs(self, hidden, req_ids, rows, qsl, ctx, q_lens) -> dict[str, list]:
        """Prompt logprobs computed this step; each position is sent once, even after a
        preemption."""
        b = self.input_batch
        want = np.flatnonzero(b.num_prompt_logprobs[rows] >= 0)
        out: dict[str, list] = {}
        for i in want.tolist():
            rid, r = req_ids[i], rows[i]
            n_prompt = int(b.num_prompt_tokens[r])
            # position p predicts prompt token p + 1
            lo = max(int(ctx[i]), self._prompt_lp_sent.get(rid, 0))
            hi = min(int(ctx[i] + q_lens[i]), n_prompt - 1)
            if hi <= lo:
                continue
            h = hidden[int(qsl[i]) + lo - int(ctx[i]): int(qsl[i]) + hi - int(ctx[i])]
            nxt = torch.from_numpy(b.token_ids[r, lo + 1: hi + 1].astype(np.int64)).to(self.device)
            out[rid] = gather_logprobs(self.model.compute_logits(h), nxt, [int(b.num_prompt_logprobs[r])] * (hi - lo))
            self._prompt_lp_sent[rid] = hi
        return out

    def _apply_grammar_bitmask(self, logits: torch.Tensor, row_req_ids: list[str], so: SchedulerOutput) -> None:
        """Set forbidden tokens' logits (float32 [N, vocab]) to -inf in place (XGrammar's
        bitmask, Dong et al. 2024). ``row_req_ids``: each row's request, its consecutive rows
        matching its rows in ``so.grammar_bitmask``."""
        gb = so.grammar_bitmask
        if gb is None:
            return
        first = gb.req_first_row
        src, dst = [], []
        prev, j = None, 0
        for r, rid in enumerate(row_req_ids):
            j = j + 1 if rid == prev else 0
            prev = rid
            f = first.get(rid)
            if f is not None:
                src.append(f + j)
                dst.append(r)
        if not dst:
            return
        packed = unpack_bitmask(gb)
        bitmask = torch.full((logits.shape[0], gb.num_words), -1, dtype=torch.int32)
        bitmask[dst] = packed[src]
        apply_token_bitmask(logits, bitmask, dst)

    def _propose(self, req_ids: list[str], rows: np.ndarray, sample_idx: np.ndarray) -> list[list[int]]:
        """Next-step drafts per sampling request (others: []), k capped by
        ``AdaptiveDraftLength``."""
        b = self.input_batch
        out: list[list[int]] = [[] for _ in req_ids]
        max_len = self.config.max_model_len
        want_i, want_k = [], []
        for i in sample_idx.tolist():
            k = min(self.spec.num_speculative_tokens, max_len - int(b.num_tokens[rows[i]]) - 1)
            if k > 0:
                want_i.append(i)
                want_k.append(k)
        if not want_i:
            return out
        prow = rows[want_i]
        ids = [req_ids[i] for i in want_i]
        # seeded sampled requests: their draft count must not depend on the batch
        independent = [r in b.generators and not is_greedy(b.temperature[r], b.top_k[r])
                       for r in prow.tolist()]
        tokens = [b.token_ids[r, : b.num_tokens[r]] for r in prow.tolist()]
        if self.proposer.is_model:
            # a draft model costs a forward per draft depth: decide before proposing
            keep = self.draft_length.choose(ids, want_k, len(sample_idx), independent)
            t0 = time.perf_counter()
            proposals = self.proposer.propose(ids, tokens, b.num_prompt_tokens[prow].tolist(), keep,
                                              batch=b, rows=prow)
            self.draft_length.record_proposer(time.perf_counter() - t0, max(keep, default=0))
        else:
            proposals = self.proposer.propose(ids, tokens, b.num_prompt_tokens[prow].tolist(), want_k,
                                              batch=b, rows=prow)
            keep = self.draft_length.choose(ids, [len(p) for p in proposals], len(sample_idx), independent)
        for i, p, k in zip(want_i, proposals, keep):
            out[i] = list(p[:k])
        return out
