"""Continuous-batching scheduler with a token budget, chunked prefill and preemption.

Each step (as in vLLM V1): running requests first, in admission order, each asking for
all of its not-yet-computed tokens (1 for a decode, the rest of a prompt for a chunked
prefill) up to the budget left; then waiting requests in arrival order, prefix-cache hit
first, their prompts chunked to the budget left. When ``allocate_slots`` fails, the most
recently admitted running request is preempted: its blocks are freed and it goes back to
the front of the queue to be recomputed later (tokens it already produced are kept).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    """What the ModelRunner needs about one request this step.

    Attributes:
        req_id: request id.
        token_ids: ids of the ``num_scheduled_tokens`` tokens to compute, at positions
            ``num_computed_tokens ..``.
        num_computed_tokens: tokens already in the cache before this step.
        block_ids: the request's whole block table.
        sample: True when this step reaches the end of the known tokens, so a new token
            is sampled from the last position's logits.
        sampling_params: the request's SamplingParams (sent when the runner first sees
            the request; None afterwards).
        output_token_ids: tokens generated so far (for min_tokens; only when sampling).
    """

    req_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    sample: bool
    sampling_params: object | None = None
    num_output_tokens: int = 0

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    """One step's batch: requests with their token counts, and requests the runner can forget."""

    scheduled: list[ScheduledRequest]
    finished_req_ids: set[str] = field(default_factory=set)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_preempted: int = 0

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(r.num_scheduled_tokens for r in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class EngineCoreOutput:
    """Per request per step: new tokens, and the finish reason once it ended."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_blocks_used: int = 0
    num_blocks_total: int = 0
    num_preemptions_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class Scheduler:
    """Args:
        kv_cache_manager: the block allocator.
        max_num_batched_tokens: token budget per step.
        max_num_seqs: most requests running at once.
        max_model_len: most tokens (prompt + output) of one request.
        enable_chunked_prefill: split prompts larger than the budget left over steps;
            when off, a prompt waits until it fits whole (and must fit the budget).
    """

    def __init__(self, kv_cache_manager: KVCacheManager, max_num_batched_tokens: int,
                 max_num_seqs: int, max_model_len: int, enable_chunked_prefill: bool = True):
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

    # -- requests --------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a request.

        Raises:
            ValueError: duplicate id, or prompt + max_tokens over max_model_len.
        """
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        max_tokens = req.sampling_params.max_tokens or 0
        if req.num_prompt_tokens + max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({req.num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len})")
        if not self.enable_chunked_prefill and req.num_prompt_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"prompt ({req.num_prompt_tokens} tokens) exceeds max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) and chunked prefill is off")
        self.requests[req.request_id] = req
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
        self.requests.pop(req.request_id, None)
        self.finished_req_ids.add(req.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # -- scheduling ------------------------------------------------------------------
    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(req)

    def _make(self, req: Request, n: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        sample = start + n >= req.num_tokens
        first = req.request_id not in self.runner_known
        self.runner_known.add(req.request_id)
        return ScheduledRequest(
            req_id=req.request_id,
            token_ids=req.all_token_ids[start:start + n],
            num_computed_tokens=start,
            block_ids=self.kv.get_block_ids(req.request_id),
            sample=sample,
            sampling_params=req.sampling_params if first else None,
            num_output_tokens=req.num_output_tokens,
        )

    def schedule(self) -> SchedulerOutput:
        """Form this step's batch (never over the token budget or max_num_seqs)."""
        # The runner forgets finished requests at the start of this step, so an id that
        # is reused after finishing must be sent as new (with its sampling params).
        for rid in self.finished_req_ids:
            self.runner_known.discard(rid)
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        num_preempted = 0
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget,
                    self.max_model_len - req.num_computed_tokens)
            if n <= 0:
                i += 1
                continue
            while True:
                if self.kv.allocate_slots(req, n) is not None:
                    ok = True
                    break
                victim = self.running.pop()
                self._preempt(victim)
                num_preempted += 1
                if victim is req:
                    ok = False
                    break
            if not ok:
                break
            scheduled.append((req, n))
            budget -= n
            i += 1

        if num_preempted == 0:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                hit_blocks, n_hit = self.kv.get_computed_blocks(req)
                n = req.num_tokens - n_hit
                # Without chunked prefill a prompt waits until it fits the budget whole
                # (add_request rejects prompts over the whole budget). A preempted
                # request may have grown past the budget with its outputs: its
                # recomputation is chunked, or it would never run again.
                if not self.enable_chunked_prefill and n > budget and req.num_preemptions == 0:
                    break
                n = min(n, budget)
                if self.kv.allocate_slots(req, n, hit_blocks, n_hit) is None:
                    break
                self.waiting.popleft()
                req.num_computed_tokens = n_hit
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = n_hit
                if req.scheduled_time is None:
                    req.scheduled_time = time.time()
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                scheduled.append((req, n))
                budget -= n

        out = SchedulerOutput(
            scheduled=[self._make(r, n) for r, n in scheduled],
            finished_req_ids=self.finished_req_ids,
            num_preempted=num_preempted,
        )
        for r, n in scheduled:
            if r.num_computed_tokens >= r.num_prompt_tokens:
                out.num_decode_tokens += n
            else:
                out.num_prefill_tokens += n
        self.finished_req_ids = set()
        return out

    def update_from_output(self, so: SchedulerOutput,
                           sampled: dict[str, int]) -> list[EngineCoreOutput]:
        """Advance computed tokens, append sampled tokens, apply stop conditions and free
        finished requests.

        Args:
            sampled: req_id → the token sampled for it this step (requests with
                ``sample`` set only).
        """
        now = time.time()
        outputs: list[EngineCoreOutput] = []
        for sr in so.scheduled:
            req = self.requests.get(sr.req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            req.num_computed_tokens += sr.num_scheduled_tokens
            tok = sampled.get(sr.req_id)
            if tok is None:
                continue
            req.append_output_token(tok)
            if req.first_token_time is None:
                req.first_token_time = now
            sp = req.sampling_params
            status = None
            if req.num_output_tokens > sp.min_tokens:
                if not sp.ignore_eos and tok in req.eos_token_ids:
                    status = RequestStatus.FINISHED_STOPPED
                elif tok in sp.stop_token_ids:
                    status = RequestStatus.FINISHED_STOPPED
                    req.stop_reason = tok
            if status is None and (
                    (sp.max_tokens is not None and req.num_output_tokens >= sp.max_tokens)
                    or req.num_tokens >= self.max_model_len):
                status = RequestStatus.FINISHED_LENGTH
            if status is not None:
                req.status = status
                req.finished_time = now
                self.running.remove(req)
                self._free(req)
            outputs.append(self._output(req, [tok]))
        return outputs

    def _output(self, req: Request, new_tokens: list[int]) -> EngineCoreOutput:
        return EngineCoreOutput(
            request_id=req.request_id, new_token_ids=new_tokens,
            finish_reason=req.finish_reason, stop_reason=req.stop_reason,
            num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=max(req.num_cached_tokens, 0),
            arrival_time=req.arrival_time, scheduled_time=req.scheduled_time,
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
            prefix_cache_queries=s.queries, prefix_cache_hits=s.hits)
