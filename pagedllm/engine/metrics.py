"""Engine statistics: periodic log lines and Prometheus metrics named as vLLM's
(``vllm:`` family), so existing dashboards work.

Definitions (seconds): TTFT = first token − arrival; ITL = gap between consecutive
tokens of one request; queue time = first scheduled − arrival; prefill time = first token
− first scheduled; decode time = finished − first token; e2e = finished − arrival;
TPOT per request = decode time / (output tokens − 1).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from pagedllm.messages import SchedulerStats

logger = logging.getLogger("pagedllm")


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e: float
    queue: float
    prefill: float
    decode: float
    ttft: float
    num_prompt_tokens: int
    num_generation_tokens: int
    num_preemptions: int = 0

    @property
    def tpot(self) -> float | None:
        n = self.num_generation_tokens - 1
        return self.decode / n if n > 0 else None


@dataclass
class IterationStats:
    """One step as the front end saw it; ``num_prompt_tokens`` includes prefix-cached
    tokens (as vLLM's)."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    num_aborted: int = 0  # requests aborted (client gone, failed step): no latency stats


class LoggingStatLogger:
    """Logs throughput, queue, KV use and prefix-cache hit rate every ``interval`` s."""

    def __init__(self, interval: float = 10.0):
        self.interval = interval
        self.last = time.monotonic()
        self.prompt = 0
        self.gen = 0
        self.q0 = self.h0 = 0
        self.d0 = self.a0 = self.n0 = 0

    def record(self, s: SchedulerStats, it: IterationStats) -> None:
        self.prompt += it.num_prompt_tokens
        self.gen += it.num_generation_tokens
        now = time.monotonic()
        dt = now - self.last
        if dt < self.interval:
            return
        dq, dh = s.prefix_cache_queries - self.q0, s.prefix_cache_hits - self.h0
        logger.info(
            "prompt %.1f tok/s, generation %.1f tok/s | running %d, waiting %d | KV cache %.1f%% | "
            "prefix cache hit rate %.1f%% | preemptions %d",
            self.prompt / dt, self.gen / dt, s.num_running, s.num_waiting, 100 * s.kv_cache_usage,
            100 * dh / dq if dq else 0.0, s.num_preemptions_total)
        drafts = s.spec_decode_num_drafts - self.n0
        if drafts:
            dd, da = s.spec_decode_num_draft_tokens - self.d0, s.spec_decode_num_accepted_tokens - self.a0
            logger.info("speculative decoding: acceptance rate %.1f%%, mean accepted length %.2f "
                        "(tokens per verified step, the target's own included), %d drafts, %d draft tokens",
                        100 * da / dd if dd else 0.0, 1 + da / drafts, drafts, dd)
        self.n0, self.d0, self.a0 = (s.spec_decode_num_drafts, s.spec_decode_num_draft_tokens,
                                     s.spec_decode_num_accepted_tokens)
        self.last, self.prompt, self.gen = now, 0, 0
        self.q0, self.h0 = s.prefix_cache_queries, s.prefix_cache_hits


_TIME_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0]
_TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000]


class PrometheusStatLogger:
    """Prometheus metrics in a private registry (``self.registry``), model-labelled."""

    def __init__(self, model_name: str):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        L = ["model_name"]
        self.model = model_name

        def hist(name, doc, buckets=_TIME_BUCKETS):
            return Histogram(name, doc, L, buckets=buckets, registry=r).labels(model_name)

        def ctr(name, doc):
            return Counter(name, doc, L, registry=r).labels(model_name)

        def gauge(name, doc):
            return Gauge(name, doc, L, registry=r).labels(model_name)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token (s)")
        self.itl = hist("vllm:inter_token_latency_seconds", "Inter-token latency (s)")
        self.tpot = hist("vllm:time_per_output_token_seconds", "Mean time per output token per request (s)")
        self.e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency (s)")
        self.queue = hist("vllm:request_queue_time_seconds", "Time waiting before first scheduled (s)")
        self.prefill = hist("vllm:request_prefill_time_seconds", "First scheduled to first token (s)")
        self.decode = hist("vllm:request_decode_time_seconds", "First token to finished (s)")
        self.prompt_hist = hist("vllm:request_prompt_tokens", "Prompt tokens per request", _TOKEN_BUCKETS)
        self.gen_hist = hist("vllm:request_generation_tokens", "Generated tokens per request", _TOKEN_BUCKETS)
        self.prompt_tokens = ctr("vllm:prompt_tokens",
                                 "Prompt tokens of requests that got their first token, prefix-cached ones included")
        self.gen_tokens = ctr("vllm:generation_tokens", "Tokens generated")
        self.preemptions = ctr("vllm:num_preemptions", "Preemptions")
        self.pc_queries = ctr("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.pc_hits = ctr("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.success = Counter("vllm:request_success", "Finished requests", L + ["finished_reason"],
                               registry=r)
        for reason in ("stop", "length", "abort"):  # exported at 0 from the start, as vLLM's
            self.success.labels(model_name, reason)
        self.running = gauge("vllm:num_requests_running", "Requests in the running batch")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0..1")
        self.spec_drafts = ctr("vllm:spec_decode_num_drafts", "Request-steps that verified draft tokens")
        self.spec_draft_tokens = ctr("vllm:spec_decode_num_draft_tokens", "Draft tokens verified")
        self.spec_accepted = ctr("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.spec_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                    "Draft tokens accepted, by position in the step's drafts",
                                    L + ["position"], registry=r)
        E = L + ["engine"]   # with data parallelism, one series per engine
        self.engine_running = Gauge("pagedllm:engine_num_requests_running", "Requests running, per engine", E,
                                    registry=r)
        self.engine_waiting = Gauge("pagedllm:engine_num_requests_waiting", "Requests waiting, per engine", E,
                                    registry=r)
        self.engine_alive = Gauge("pagedllm:engine_alive", "1 while the engine serves, 0 once it died", E,
                                  registry=r)
        self.engine_kv_usage = Gauge("pagedllm:engine_kv_cache_usage_perc", "KV-cache usage 0..1, per engine", E,
                                     registry=r)
        self._last_spec = [0, 0, 0]
        self._last_per_pos: list[int] = []
        self._last_preempt = self._last_q = self._last_h = 0

    def record(self, s: SchedulerStats, it: IterationStats) -> None:
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.kv_usage.set(s.kv_cache_usage)
        for i, (running, waiting, usage, alive) in enumerate(s.engines):
            self.engine_alive.labels(self.model, str(i)).set(int(alive))
            self.engine_running.labels(self.model, str(i)).set(running)
            self.engine_waiting.labels(self.model, str(i)).set(waiting)
            self.engine_kv_usage.labels(self.model, str(i)).set(usage)
        self.preemptions.inc(max(0, s.num_preemptions_total - self._last_preempt))
        self.pc_queries.inc(max(0, s.prefix_cache_queries - self._last_q))
        self.pc_hits.inc(max(0, s.prefix_cache_hits - self._last_h))
        self._last_preempt, self._last_q, self._last_h = (
            s.num_preemptions_total, s.prefix_cache_queries, s.prefix_cache_hits)
        spec = [s.spec_decode_num_drafts, s.spec_decode_num_draft_tokens, s.spec_decode_num_accepted_tokens]
        for c, now, last in zip((self.spec_drafts, self.spec_draft_tokens, self.spec_accepted), spec, self._last_spec):
            if now > last:
                c.inc(now - last)
        self._last_spec = spec
        per_pos = s.spec_decode_num_accepted_tokens_per_pos
        for j, v in enumerate(per_pos):
            last = self._last_per_pos[j] if j < len(self._last_per_pos) else 0
            if v > last:
                self.spec_per_pos.labels(self.model, str(j)).inc(v - last)
        self._last_per_pos = list(per_pos)
        self.prompt_tokens.inc(it.num_prompt_tokens)
        self.gen_tokens.inc(it.num_generation_tokens)
        for t in it.ttfts:
            self.ttft.observe(t)
        for t in it.itls:
            self.itl.observe(t)
        for f in it.finished:
            self.e2e.observe(f.e2e)
            self.queue.observe(f.queue)
            self.prefill.observe(f.prefill)
            self.decode.observe(f.decode)
            self.prompt_hist.observe(f.num_prompt_tokens)
            self.gen_hist.observe(f.num_generation_tokens)
            if f.tpot is not None:
                self.tpot.observe(f.tpot)
            self.success.labels(self.model, f.finish_reason).inc()
        if it.num_aborted:
            self.success.labels(self.model, "abort").inc(it.num_aborted)
