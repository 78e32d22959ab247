"""OutputProcessor (after vLLM V1's): the front end's per-sequence state, turning the
core's ``EngineCoreOutput``s into ``RequestOutput``s (detokenization, stop strings, which
the caller must then abort in the core, logprobs, metrics and step stats); sequences of
an n > 1 request belong to a ``ParentRequest``.
"""
from __future__ import annotations

import dataclasses
import time

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.metrics import FinishedRequestStats, IterationStats
from pagedllm.engine.parallel_sampling import ParentRequest
from pagedllm.messages import FINISH_ABORT, FINISH_STOP, EngineCoreOutput, EngineCoreRequest, TokenLogprobs
from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


class RequestState:
    """A followed sequence: ``request_id`` the core's id, ``public_id`` the caller's (the
    parent's for a child), ``index`` its place among the parent's n (0 otherwise)."""

    __slots__ = ("request_id", "prompt", "prompt_token_ids", "detok", "token_ids", "finish_reason",
                 "stop_reason", "metrics", "last_token_time", "num_cached_tokens", "public_id", "index",
                 "parent", "logprobs", "prompt_logprobs", "cumulative_logprob", "want_logprobs",
                 "want_prompt_logprobs")

    def __init__(self, req: EngineCoreRequest, prompt: str | None, detok: IncrementalDetokenizer,
                 parent: ParentRequest | None = None, index: int = 0):
        self.request_id = req.request_id
        self.parent = parent
        self.public_id = req.request_id if parent is None else parent.request_id
        self.index = index
        sp = req.sampling_params
        self.want_logprobs = sp.logprobs is not None
        self.want_prompt_logprobs = sp.prompt_logprobs is not None
        self.logprobs: list[dict[int, Logprob]] | None = [] if self.want_logprobs else None
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = [None] if self.want_prompt_logprobs else None
        self.cumulative_logprob: float | None = 0.0 if self.want_logprobs else None
        self.prompt = prompt
        self.prompt_token_ids = req.prompt_token_ids
        self.detok = detok
        self.token_ids: list[int] = []
        self.finish_reason = None
        self.stop_reason = None
        self.metrics = RequestMetrics(arrival_time=req.arrival_time)
        self.last_token_time: float | None = None
        self.num_cached_tokens = 0

    def completion(self, finished: bool) -> CompletionOutput:
        """This sequence's completion so far."""
        text = self.detok.text if finished else self.detok.text[: self.detok.sent]
        return CompletionOutput(self.index, text, list(self.token_ids), self.finish_reason, self.stop_reason,
                                None if self.logprobs is None else list(self.logprobs), self.cumulative_logprob)

    def finished_stats(self) -> FinishedRequestStats:
        """Latency and token counts of this finished sequence (seconds)."""
        m = self.metrics
        sched = m.first_scheduled_time or m.arrival_time
        first = m.first_token_time or m.finished_time
        return FinishedRequestStats(
            finish_reason=self.finish_reason, e2e=m.finished_time - m.arrival_time,
            queue=sched - m.arrival_time, prefill=first - sched, decode=m.finished_time - first,
            ttft=first - m.arrival_time, num_prompt_tokens=len(self.prompt_token_ids),
            num_generation_tokens=len(self.token_ids), num_preemptions=m.num_preemptions)


@dataclasses.dataclass
class OutputProcessorOutput:
    """``request_outputs`` in the core's order; ``reqs_to_abort``: core ids a stop string
    finished here; ``reqs_to_add``: parents' child requests to send to the core now."""

    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]
    reqs_to_add: list[EngineCoreRequest]


class OutputProcessor:
    """``tokenizer``: a fast tokenizer, used from the engine thread only.
    ``request_states`` by core id; ``parent_requests`` (n > 1) by caller id."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}
        self._token_text: dict[int, str] = {}

    def is_request_id_in_use(self, request_id: str) -> bool:
        return request_id in self.request_states or request_id in self.parent_requests

    def add_request(self, req: EngineCoreRequest, prompt: str | None, parent: ParentRequest | None = None,
                    index: int = 0) -> None:
        """Follow ``req``, or sequence ``index`` of ``parent``."""
        sp = req.sampling_params
        detok = IncrementalDetokenizer(self.tokenizer, sp.stop_strings, sp.include_stop_str_in_output,
                                       sp.skip_special_tokens, sp.min_tokens)
        if parent is not None:
            self.parent_requests.setdefault(parent.request_id, parent)
        self.request_states[req.request_id] = RequestState(req, prompt, detok, parent, index)

    def unfinished_request_ids(self) -> list[str]:
        """The callers' ids of the requests not finished yet."""
        return list(dict.fromkeys(st.public_id for st in self.request_states.values()))

    def abort_requests(self, request_ids: list[str], it: IterationStats) -> list[str]:
        """Stop following the callers' ``request_ids`` (a parent whole, even via one of its
        sequences), counted in ``it.num_aborted``; returns the core's ids to abort."""
        core_ids = []
        for rid in request_ids:
            st = self.request_states.get(rid)
            if st is not None and st.parent is not None:
                rid = st.parent.request_id
            parent = self.parent_requests.pop(rid, None)
            if parent is None:
                core_ids.append(rid)
            else:
                parent.abort()
                core_ids.extend(parent.child_ids)
        for rid in core_ids:
            if self.request_states.pop(rid, None) is not None:
                it.num_aborted += 1
        return core_ids

    def fail_requests(self, request_ids: list[str], it: IterationStats) -> tuple[list[str], list[str]]:
        """Stop following sequences the core failed (parents fail whole). Returns the
        callers' failed ids and the core ids of failed parents' other sequences to abort."""
        failed: list[str] = []
        for rid in request_ids:
            st = self.request_states.pop(rid, None)
            if st is not None:
                it.num_aborted += 1
                if st.public_id not in failed:
                    failed.append(st.public_id)
        siblings = []
        for pid in failed:
            parent = self.parent_requests.pop(pid, None)
            if parent is not None:
                siblings.extend(parent.alive_children(self.request_states))
        return failed, siblings

    def process_outputs(self, core_outputs: list[EngineCoreOutput], it: IterationStats) -> OutputProcessorOutput:
        """Apply one step's outputs: a cumulative RequestOutput (plus delta) per followed
        sequence; finished ones are dropped; ``it`` gets token counts and latencies."""
        now = time.time()
        results = []
        stop_aborts: list[str] = []
        released: list[EngineCoreRequest] = []
        for co in core_outputs:
            st = self.request_states.get(co.request_id)
            if st is None:
                continue
            new_ids = co.new_token_ids
            n_before = st.detok.num_tokens
            # the core finishes a request with "stop" only on an EOS or stop token id, the
            # last of its new tokens (stop strings are matched here)
            matched = st.detok.update(new_ids, stop_terminated=co.finish_reason == FINISH_STOP)
            if matched is not None:
                # a stop string inside a chunk of several tokens (speculative decoding):
                # the tokens after it are dropped, never returned
                new_ids = new_ids[: st.detok.num_tokens - n_before]
            st.token_ids.extend(new_ids)
            if st.want_logprobs and co.new_logprobs:
                for e in co.new_logprobs[: len(new_ids)]:
                    st.logprobs.append(self._logprob_dict(e))
                    st.cumulative_logprob += e.logprobs[0]
            if st.want_prompt_logprobs and co.new_prompt_logprobs:
                st.prompt_logprobs.extend(self._logprob_dict(e) for e in co.new_prompt_logprobs)
            if st.parent is not None and st.index == 0 and (new_ids or co.finish_reason is not None):
                released.extend(st.parent.take_pending(self.request_states))
            it.num_generation_tokens += len(new_ids)
            m = st.metrics
            m.first_scheduled_time = co.scheduled_time
            m.num_preemptions = co.num_preemptions
            st.num_cached_tokens = co.num_cached_tokens
            if st.parent is not None and st.index == 0:
                st.parent.num_cached_tokens = co.num_cached_tokens
            if new_ids:
                if m.first_token_time is None:
                    m.first_token_time = co.first_token_time or now
                    it.ttfts.append(m.first_token_time - m.arrival_time)
                    # the whole prompt, prefix-cached tokens included (as vLLM, and as the
                    # request's usage.prompt_tokens), counted once per request
                    it.num_prompt_tokens += len(st.prompt_token_ids)
                elif st.last_token_time is not None:
                    it.itls.append(now - st.last_token_time)
                st.last_token_time = now
            finish, stop_reason = co.finish_reason, co.stop_reason
            if matched is not None:
                if finish is None:
                    stop_aborts.append(co.request_id)
                finish, stop_reason = FINISH_STOP, matched
            finished = finish is not None
            if finished:
                m.finished_time = co.finished_time or now
                st.finish_reason, st.stop_reason = finish, stop_reason
                self.request_states.pop(co.request_id, None)
                if finish != FINISH_ABORT:
                    it.finished.append(st.finished_stats())
                else:
                    it.num_aborted += 1
            delta = st.detok.delta(finished)
            results.append(self._make_output(st, finished, delta, new_ids))
        return OutputProcessorOutput(results, stop_aborts, released)

    def _make_output(self, st: RequestState, finished: bool, delta: str, delta_ids: list[int]) -> RequestOutput:
        """The caller's view after news of sequence ``st``."""
        outputs = [st.completion(finished)]
        if st.parent is not None:
            outputs, finished = st.parent.add_completion(st.index, outputs[0], finished)
            if finished:
                self.parent_requests.pop(st.public_id, None)
        cached = st.num_cached_tokens if st.parent is None else st.parent.num_cached_tokens
        return RequestOutput(st.public_id, st.prompt, st.prompt_token_ids, outputs, finished,
                             st.metrics, cached, delta, list(delta_ids),
                             prompt_logprobs=None if st.prompt_logprobs is None else list(st.prompt_logprobs),
                             delta_index=st.index)

    def _logprob_dict(self, e: TokenLogprobs) -> dict[int, Logprob]:
        """vLLM's per-position shape: token id -> Logprob, the chosen token first."""
        d: dict[int, Logprob] = {}
        for j, (t, lp) in enumerate(zip(e.token_ids, e.logprobs)):
            if t not in d:
                d[t] = Logprob(lp, e.rank if j == 0 else j, self.token_text(t))
        return d

    def token_text(self, token_id: int) -> str:
        """One token's text on its own (cached), as logprobs show it."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text
