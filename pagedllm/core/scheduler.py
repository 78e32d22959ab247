"""Continuous-batching scheduler with a token budget, chunked prefill and preemption
(after vLLM V1's).

Each step: running requests first, in admission order, then waiting ones in arrival
order, prompts chunked to the budget left. When ``allocate_slots`` fails, the most
recently admitted running request is preempted (blocks freed, back to the queue front,
recomputed later). Speculative decoding and structured outputs: docs/notes/core.md.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.messages import (CachedRequestData, EngineCoreOutput, GrammarBitmask, ModelRunnerOutput,
                               NewRequestData, SchedulerOutput, SchedulerStats)
from pagedllm.structured_output import GrammarCompileError, StructuredOutputManager

logger = logging.getLogger("pagedllm")


@dataclass
class _StepPlan:
    """``Scheduler.schedule``'s decisions so far: ``budget`` tokens left; ``scheduled``
    (request, tokens, new block ids per group, admitted now) in order; drafts by id."""

    budget: int
    scheduled: list[tuple[Request, int, list[list[int]], bool]] = field(default_factory=list)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    num_preempted: int = 0


class Scheduler:
    """Args: ``enable_chunked_prefill`` off = a prompt waits until it fits the budget
    whole; ``num_lookahead_slots``: KV slots reserved past a sampling request's tokens
    (``SpeculativeConfig.num_lookahead_slots``); ``structured_output``: None when no
    request has ``structured_outputs``."""

    def __init__(self, kv_cache_manager: KVCacheManager, max_num_batched_tokens: int,
                 max_num_seqs: int, max_model_len: int, enable_chunked_prefill: bool = True,
                 num_lookahead_slots: int = 0, structured_output: StructuredOutputManager | None = None):
        self.kv = kv_cache_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.finished_req_ids: set[str] = set()
        self.runner_known: set[str] = set()
        self.num_preemptions_total = 0
        self.num_lookahead_slots = num_lookahead_slots
        # speculative decoding counters (cumulative, as vLLM's spec_decode metrics)
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos: list[int] = []
        self.num_freed_blocks: dict[str, int] = {}   # rejected-slot blocks the runner must drop
        self.structured_output = structured_output
        self.failed_outputs: list[EngineCoreOutput] = []   # finished outside a step (see take_failed_outputs)

    # -- requests --------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a request already validated by the Processor (asserted, not rechecked)."""
        assert req.request_id not in self.requests, req.request_id
        assert req.num_prompt_tokens + req.sampling_params.max_tokens <= self.max_model_len
        assert self.enable_chunked_prefill or req.num_prompt_tokens <= self.max_num_batched_tokens
        self.requests[req.request_id] = req
        if req.sampling_params.structured_outputs is not None:
            assert self.structured_output is not None, "a constrained request needs a StructuredOutputManager"
            self.structured_output.add_request(req.request_id, req.sampling_params.structured_outputs)
        self.waiting.append(req)

    def finish_requests(self, request_ids, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> list[Request]:
        """Finish (abort) requests wherever they are; frees their blocks at once."""
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.status.finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                try:
                    self.waiting.remove(req)
                except ValueError:
                    pass
            req.status = status
            req.finished_time = time.time()
            self._free(req)
            done.append(req)
        return done

    def _free(self, req: Request) -> None:
        self.kv.free(req)
        self.num_freed_blocks.pop(req.request_id, None)
        self.requests.pop(req.request_id, None)
        self.finished_req_ids.add(req.request_id)
        if req.sampling_params.structured_outputs is not None:
            self.structured_output.remove_request(req.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # -- scheduling ------------------------------------------------------------------
    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        self.num_freed_blocks.pop(req.request_id, None)
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(req)

    def schedule(self) -> SchedulerOutput:
        """Form this step's batch within the token budget and ``max_num_seqs``: running
        requests first, then, if none was preempted, waiting ones."""
        # The runner forgets finished requests at the start of this step, so an id that
        # is reused after finishing must be sent as new (with its sampling params).
        self.runner_known.difference_update(self.finished_req_ids)
        plan = _StepPlan(budget=self.max_num_batched_tokens)
        self._schedule_running(plan)
        if plan.num_preempted == 0:
            self._schedule_waiting(plan)
        out = self._scheduler_output(plan)
        self.finished_req_ids = set()
        return out

    def _schedule_running(self, plan: _StepPlan) -> None:
        """Schedule running requests in admission order until the budget is spent or one
        preempts itself."""
        i = 0
        while i < len(self.running) and plan.budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, plan.budget,
                    self.max_model_len - req.num_computed_tokens)
            if n <= 0:
                i += 1
                continue
            spec = self._drafts_to_verify(req, n, plan.budget)
            n += len(spec)
            lookahead = self.num_lookahead_slots if req.num_computed_tokens + n >= req.num_tokens else 0
            n_before = self.kv.num_table_entries(req.request_id)
            if not self._allocate_or_preempt(req, n, lookahead, plan):
                break
            if spec:
                plan.spec_tokens[req.request_id] = spec
            plan.scheduled.append((req, n, self.kv.group_block_ids_from(req.request_id, n_before), False))
            plan.budget -= n
            i += 1

    def _drafts_to_verify(self, req: Request, n: int, budget: int) -> list[int]:
        """``req``'s drafts to verify: none unless it decodes (``n`` == 1); else cut to its
        grammar's prefix and so that accepting all stays within ``max_tokens``,
        ``max_model_len`` and ``budget``."""
        spec = req.spec_token_ids
        if not (spec and n == 1 and req.num_computed_tokens + 1 == req.num_tokens):
            return []
        if req.sampling_params.structured_outputs is not None:
            spec = self.structured_output.validate_drafts(req.request_id, spec)
        room = min(req.sampling_params.max_tokens - req.num_output_tokens,
                   self.max_model_len - req.num_tokens, budget) - 1
        return spec[:max(room, 0)]

    def _allocate_or_preempt(self, req: Request, n: int, lookahead: int, plan: _StepPlan) -> bool:
        """Allocate ``n`` + ``lookahead`` slots for ``req``, preempting the newest running
        requests; False when ``req`` itself was preempted."""
        while self.kv.allocate_slots(req, n, num_lookahead_tokens=lookahead) is None:
            victim = self.running.pop()
            self._preempt(victim)
            plan.num_preempted += 1
            if victim is req:
                return False
        return True

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        """Admit waiting requests in order while budget and seats last; one whose grammar
        is compiling keeps its place without blocking the rest."""
        skipped: list[Request] = []   # grammars still compiling: they keep their place
        while self.waiting and plan.budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.sampling_params.structured_outputs is not None and not self._grammar_ready(req):
                if req.status != RequestStatus.FINISHED_ABORTED:
                    skipped.append(req)
                self.waiting.popleft()
                continue
            n = self._admit(req, plan.budget)
            if n is None:
                break
            plan.scheduled.append((req, n, self.kv.get_group_block_ids(req.request_id), True))
            plan.budget -= n
        self.waiting.extendleft(reversed(skipped))

    def _admit(self, req: Request, budget: int) -> int | None:
        """Admit the queue's first ``req`` (prefix hit + up to ``budget`` tokens); the tokens
        scheduled, or None (nothing changed) when they do not fit."""
        hit_blocks, n_hit = self.kv.get_computed_blocks(req)
        n = req.num_tokens - n_hit
        # Without chunked prefill a prompt waits until it fits the budget whole
        # (the Processor rejects prompts over the whole budget). A preempted
        # request may have grown past the budget with its outputs: its
        # recomputation is chunked, or it would never run again.
        if not self.enable_chunked_prefill and n > budget and req.num_preemptions == 0:
            return None
        n = min(n, budget)
        lookahead = self.num_lookahead_slots if n_hit + n >= req.num_tokens else 0
        if self.kv.allocate_slots(req, n, hit_blocks, n_hit, lookahead) is None:
            return None
        self.waiting.popleft()
        self.kv.record_admission(req, n_hit)
        req.num_computed_tokens = n_hit
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = n_hit
        if req.scheduled_time is None:
            req.scheduled_time = time.time()
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return n

    def _scheduler_output(self, plan: _StepPlan) -> SchedulerOutput:
        """The step's ``SchedulerOutput``: new requests whole, held ones as deltas."""
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        num_scheduled: dict[str, int] = {}
        out = SchedulerOutput(new_reqs, cached, num_scheduled, self.max_num_batched_tokens - plan.budget,
                              scheduled_spec_decode_tokens=plan.spec_tokens,
                              finished_req_ids=self.finished_req_ids, num_preempted=plan.num_preempted)
        for req, n, block_ids, admitted in plan.scheduled:
            rid = req.request_id
            num_scheduled[rid] = n
            if rid not in self.runner_known:
                self.runner_known.add(rid)
                new_reqs.append(NewRequestData(
                    rid, req.prompt_token_ids, req.sampling_params, sorted(req.eos_token_ids), block_ids,
                    req.num_computed_tokens))
            else:
                cached.req_ids.append(rid)
                cached.resumed_from_preemption.append(admitted)
                cached.new_block_ids.append(block_ids)
                cached.num_computed_tokens.append(req.num_computed_tokens)
                cached.num_freed_blocks.append(0 if admitted else self.num_freed_blocks.pop(rid, 0))
            if req.num_computed_tokens >= req.num_prompt_tokens:
                out.num_decode_tokens += n
            else:
                out.num_prefill_tokens += n
        if self.structured_output is not None:
            out.grammar_bitmask = self._grammar_bitmask(plan)
        return out

    def _grammar_bitmask(self, plan: _StepPlan) -> GrammarBitmask | None:
        """Bitmask rows of the constrained requests that sample this step, drafts included."""
        spec = plan.spec_tokens
        return self.structured_output.grammar_bitmask(
            [(req.request_id, spec.get(req.request_id, [])) for req, n, _, _ in plan.scheduled
             if req.sampling_params.structured_outputs is not None
             and req.num_computed_tokens + n - len(spec.get(req.request_id, ())) >= req.num_tokens])

    def _grammar_ready(self, req: Request) -> bool:
        """Whether ``req``'s grammar has compiled; a failed compile aborts it."""
        try:
            return self.structured_output.is_ready(req.request_id)
        except GrammarCompileError as e:
            logger.error("request %s: %s", req.request_id, e)
            req.status = RequestStatus.FINISHED_ABORTED
            req.finished_time = time.time()
            self._free(req)
            self.failed_outputs.append(self._output(req, []))
            return False

    def take_failed_outputs(self) -> list[EngineCoreOutput]:
        """Outputs of requests aborted while scheduling (failed grammar), once."""
        out, self.failed_outputs = self.failed_outputs, []
        return out

    def update_from_output(self, so: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advance computed tokens, append sampled tokens, apply stop conditions, free
        finished requests."""
        now = time.time()
        outputs: list[EngineCoreOutput] = []
        sampled = dict(zip(runner_output.req_ids, runner_output.sampled_token_ids))
        proposed = dict(zip(runner_output.req_ids, runner_output.spec_token_ids))
        logprobs = runner_output.logprobs
        prompt_lp = runner_output.prompt_logprobs
        for rid, n in so.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            tokens = sampled.get(rid)
            spec = so.scheduled_spec_decode_tokens.get(rid)
            if spec and tokens:
                num_accepted = len(tokens) - 1
                self._count_spec(len(spec), num_accepted)
                # K/V of rejected drafts stays in their slots until overwritten; the
                # count covers accepted tokens only
                req.num_computed_tokens += n - (len(spec) - num_accepted)
            else:
                req.num_computed_tokens += n
            req.spec_token_ids = proposed.get(rid) or []
            if rid in prompt_lp:
                req.pending_prompt_logprobs.extend(prompt_lp[rid])
            if not tokens:
                continue
            if req.first_token_time is None:
                req.first_token_time = now
            new_tokens = []
            constrained = req.sampling_params.structured_outputs is not None
            for tok in tokens:
                req.append_output_token(tok)
                new_tokens.append(tok)
                status = self._check_stop(req, tok)
                if constrained:
                    if not self.structured_output.accept_tokens(rid, [tok]):
                        # the bitmask allows only accepted tokens, so every token was masked:
                        # the request's own constraints exclude each other (e.g. a choice
                        # that is complete while min_tokens bans EOS, allowed_token_ids
                        # outside the grammar, a regex that matches nothing), or a bug
                        logger.warning("request %s: no token satisfies both its grammar and its other token "
                                       "constraints (min_tokens, allowed_token_ids, bad_words; token %d "
                                       "rejected); ending it with finish_reason abort", rid, tok)
                        status = RequestStatus.FINISHED_ABORTED
                    elif self.structured_output.is_terminated(rid):
                        status = RequestStatus.FINISHED_STOPPED
                if status is not None:
                    req.status = status
                    req.finished_time = now
                    self.running.remove(req)
                    self._free(req)
                    break
            if spec and req.status == RequestStatus.RUNNING and len(spec) >= len(tokens):
                freed = self.kv.free_tail(req, req.num_tokens)
                if freed:
                    self.num_freed_blocks[rid] = self.num_freed_blocks.get(rid, 0) + freed
            out = self._output(req, new_tokens)
            if rid in logprobs:
                out.new_logprobs = logprobs[rid][: len(new_tokens)]
            if req.sampling_params.prompt_logprobs is not None and req.pending_prompt_logprobs:
                out.new_prompt_logprobs, req.pending_prompt_logprobs = req.pending_prompt_logprobs, []
            outputs.append(out)
        return outputs

    def _count_spec(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_draft:
            per_pos.extend([0] * (num_draft - len(per_pos)))
        for j in range(num_accepted):
            per_pos[j] += 1

    def _check_stop(self, req: Request, tok: int) -> RequestStatus | None:
        """The finished status ``tok`` (just appended) gives ``req``, or None to go on."""
        sp = req.sampling_params
        if req.num_output_tokens > sp.min_tokens:
            if not sp.ignore_eos and tok in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if tok in sp.stop_token_ids:
                req.stop_reason = tok
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= sp.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _output(self, req: Request, new_tokens: list[int]) -> EngineCoreOutput:
        return EngineCoreOutput(
            request_id=req.request_id, new_token_ids=new_tokens,
            finish_reason=req.finish_reason, stop_reason=req.stop_reason,
            num_cached_tokens=max(req.num_cached_tokens, 0), scheduled_time=req.scheduled_time,
            first_token_time=req.first_token_time, finished_time=req.finished_time,
            num_preemptions=req.num_preemptions)

    def abort_output(self, req: Request) -> EngineCoreOutput:
        return self._output(req, [])

    def stats(self) -> SchedulerStats:
        s = self.kv.stats
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage(),
            num_blocks_used=self.kv.num_blocks - self.kv.num_free_blocks,
            num_blocks_total=self.kv.num_blocks,
            num_preemptions_total=self.num_preemptions_total,
            prefix_cache_queries=s.queries, prefix_cache_hits=s.hits,
            spec_decode_num_drafts=self.num_drafts, spec_decode_num_draft_tokens=self.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos))
