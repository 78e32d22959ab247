"""Metric math for ``pagedllm bench``: per-request results, latency statistics, goodput,
and server-side Prometheus metrics scraped before and after a run.

Client-side latencies, in seconds internally and ms in reports: TTFT from the first send
(retries included) to the first chunk with text; ITL the gaps between text chunks (one gap
for a multi-token chunk, as vLLM's ``benchmark_serving``); TPOT ``(E2E - TTFT) /
(output_tokens - 1)``; E2E first send to stream end. Goodput: completed requests/s meeting
every SLO (DistServe, Zhong et al. OSDI'24; vLLM's ``--goodput``). Percentiles: numpy's
linear interpolation. Abandoned streams (``aborted``) are neither completed nor failed:
their TTFT counts when a token came (what the user waited for), not their TPOT, ITL, E2E.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np

__all__ = [
    "RequestResult",
    "percentile",
    "pct_key",
    "latency_stats",
    "compute_tpot",
    "parse_slos",
    "meets_slos",
    "summarize_results",
    "parse_prometheus_text",
    "server_metrics_delta",
    "DEFAULT_PERCENTILES",
    "SLO_METRICS",
]

DEFAULT_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)

#: SLO metric names accepted by ``--goodput`` / ``--slo`` (value in ms).
SLO_METRICS: dict[str, str] = {
    "ttft": "ttft",
    "tpot": "tpot",
    "e2e": "e2e",
    "e2el": "e2e",  # vLLM's spelling
    "itl": "itl",
}


@dataclass
class RequestResult:
    """Outcome of one benchmark request; ``scheduled_time``, ``start_time``,
    ``first_token_time``, ``end_time`` are ``time.perf_counter()`` seconds, ``itl`` gaps in
    seconds. ``output_tokens``: of the last attempt (a failed or abandoned one: its
    streamed text chunks).

    Load model (:mod:`~pagedllm.benchmarks.load_model`): ``aborted`` the client closed the
    stream on purpose (``success`` False, ``error`` None: neither completed nor failed);
    ``aborted_output_tokens`` the tokens read before closing (= ``output_tokens``; 0 when
    not aborted); ``abort_after_tokens`` the planned cut-off (None: read to the end).
    ``retried_prompt_tokens`` / ``retried_output_tokens``: summed over the attempts that
    were retried (not the last one), prompt tokens of each the server accepted (HTTP 200)
    and the tokens it streamed before failing (client's retry code; 0).

    Read by :mod:`~pagedllm.benchmarks.cost` besides those: ``cached_tokens`` prompt
    tokens the server's usage says came from its prefix cache (client; None: not reported);
    ``think_time_s`` the pause after the session's previous reply (tool / retrieval
    round-trip) and ``system_tokens`` the session's system-prompt tokens (runner; 0.0, None
    where the dataset has no system prompt)."""

    request_id: int
    success: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    output_tokens_source: str = "none"  # "usage", "tokenizer", "chunks"
    cached_tokens: int | None = None
    scheduled_time: float = 0.0
    start_time: float = 0.0
    first_token_time: float | None = None
    end_time: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    retries: int = 0
    session_id: str | None = None
    turn: int = 0
    generated_text: str = ""
    http_status: int | None = None
    aborted: bool = False
    aborted_output_tokens: int = 0
    abort_after_tokens: int | None = None
    retried_prompt_tokens: int = 0
    retried_output_tokens: int = 0
    think_time_s: float = 0.0
    system_tokens: int | None = None

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first (see module docstring)."""
        if not self.success or self.ttft is None or self.e2e is None:
            return None
        return compute_tpot(self.e2e, self.ttft, self.output_tokens)

    @property
    def client_wait(self) -> float:
        """Seconds waited on the client (concurrency limit) after the scheduled arrival."""
        return max(0.0, self.start_time - self.scheduled_time)

    def to_dict(self, t0: float) -> dict:
        """JSON-ready record; times relative to ``t0`` (seconds), latencies in ms."""

        def rel(t: float | None) -> float | None:
            return None if t is None else round(t - t0, 6)

        def ms(v: float | None) -> float | None:
            return None if v is None else round(v * 1e3, 4)

        return {
            "request_id": self.request_id,
            "session_id": self.session_id,
            "turn": self.turn,
            "success": self.success,
            "error": self.error,
            "http_status": self.http_status,
            "retries": self.retries,
            "retried_prompt_tokens": self.retried_prompt_tokens,
            "retried_output_tokens": self.retried_output_tokens,
            "aborted": self.aborted,
            "abort_after_tokens": self.abort_after_tokens,
            "aborted_output_tokens": self.aborted_output_tokens,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "output_tokens_source": self.output_tokens_source,
            "cached_tokens": self.cached_tokens,
            "think_time_s": self.think_time_s,
            "system_tokens": self.system_tokens,
            "scheduled_s": rel(self.scheduled_time),
            "start_s": rel(self.start_time),
            "first_token_s": rel(self.first_token_time),
            "end_s": rel(self.end_time),
            "ttft_ms": ms(self.ttft),
            "tpot_ms": ms(self.tpot),
            "e2e_ms": ms(self.e2e),
            "itl_ms": [round(x * 1e3, 4) for x in self.itl],
        }


def compute_tpot(e2e_s: float, ttft_s: float, output_tokens: int) -> float | None:
    """TPOT in seconds, ``(e2e_s - ttft_s) / (output_tokens - 1)``; None for fewer than 2
    tokens. Raises ``ValueError`` on negative times."""
    if e2e_s < 0 or ttft_s < 0:
        raise ValueError("latencies must be non-negative")
    if output_tokens < 2:
        return None
    return (e2e_s - ttft_s) / (output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``values`` with numpy's linear
    interpolation; ``None`` for an empty sequence. Raises ``ValueError`` for
    ``q`` outside [0, 100]."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=float), q))


def pct_key(q: float) -> str:
    """Result key of percentile ``q``: ``p99``, ``p99_9`` (``.`` -> ``_``)."""
    return f"p{q:g}".replace(".", "_")


def latency_stats(
    values_s: Sequence[float], percentiles: Iterable[float] = DEFAULT_PERCENTILES
) -> dict[str, float | None]:
    """Statistics of latencies in seconds, returned in ms: ``count``, ``mean``, ``median``,
    ``std``, ``min``, ``max`` and ``p<q>`` per percentile (always ``p90``, ``p99``); empty
    input gives None values and ``count`` 0."""
    qs = sorted(set(float(q) for q in percentiles) | {90.0, 99.0})
    out: dict[str, float | None] = {"count": len(values_s)}
    if len(values_s) == 0:
        for k in ("mean", "median", "std", "min", "max"):
            out[k] = None
        for q in qs:
            out[pct_key(q)] = None
        return out
    a = np.asarray(values_s, dtype=float) * 1e3
    out["mean"] = float(a.mean())
    out["median"] = float(np.median(a))
    out["std"] = float(a.std())
    out["min"] = float(a.min())
    out["max"] = float(a.max())
    for q in qs:
        out[pct_key(q)] = float(np.percentile(a, q))
    return out


def parse_slos(specs: Sequence[str] | None, flag: str = "--goodput") -> dict[str, float]:
    """Parse SLO specs (``["ttft:500", "tpot:50"]``) into ``{"ttft": 500.0, ...}`` (ms):
    ttft, tpot, itl (a request's largest gap), e2e (alias e2el). Raises ``ValueError`` naming
    ``flag`` on malformed input, unknown metrics or non-positive values."""
    slos: dict[str, float] = {}
    for spec in specs or []:
        for part in str(spec).replace(",", " ").split():
            name, sep, val = part.partition(":")
            if not sep:
                raise ValueError(f"{flag}: expected METRIC:MILLISECONDS (e.g. ttft:500), got {part!r}")
            key = SLO_METRICS.get(name.strip().lower())
            if key is None:
                raise ValueError(
                    f"{flag}: unknown metric {name!r}; choose from {', '.join(sorted(SLO_METRICS))}"
                )
            try:
                ms = float(val)
            except ValueError:
                raise ValueError(f"{flag}: {val!r} is not a number of milliseconds (in {part!r})") from None
            if not math.isfinite(ms) or ms <= 0:
                raise ValueError(f"{flag}: SLO for {name} must be a positive number of ms, got {val!r}")
            slos[key] = ms
    return slos


def meets_slos(r: RequestResult, slos_ms: Mapping[str, float]) -> bool:
    """True when a successful request meets every SLO (ms); a missing TPOT or ITL meets its
    SLO, a failed request never does."""
    if not r.success:
        return False
    for key, limit in slos_ms.items():
        limit_s = limit / 1e3
        if key == "ttft":
            if r.ttft is None or r.ttft > limit_s:
                return False
        elif key == "tpot":
            tp = r.tpot
            if tp is not None and tp > limit_s:
                return False
        elif key == "e2e":
            if r.e2e is None or r.e2e > limit_s:
                return False
        elif key == "itl":
            if r.itl and max(r.itl) > limit_s:
                return False
        else:  # pragma: no cover - parse_slos guards this
            raise ValueError(f"unknown SLO metric {key!r}")
    return True


def summarize_results(
    results: Sequence[RequestResult],
    duration_s: float,
    slos_ms: Mapping[str, float] | None = None,
    percentiles: Iterable[float] = DEFAULT_PERCENTILES,
) -> dict:
    """Aggregate the results of a run lasting ``duration_s`` seconds: throughputs per second,
    token totals of successful requests (``total_cached_tokens``: the cached prompt tokens
    their usage reported, None when none did), ``error_rate`` and ``retry_rate`` per issued
    request, ``total_retries``, ``goodput`` (req/s; None without SLOs; ``goodput_fraction``
    of the requests not abandoned); ``aborted``, ``abort_rate`` (per issued request) and
    ``total_aborted_output_tokens`` of abandoned streams; ``total_retried_prompt_tokens`` /
    ``total_retried_output_tokens`` of retried attempts.
    Raises ``ValueError`` if ``duration_s`` is not positive while results exist."""
    percentiles = tuple(percentiles)
    n = len(results)
    ok = [r for r in results if r.success]
    if n and duration_s <= 0:
        raise ValueError("duration_s must be positive")
    dur = duration_s if duration_s > 0 else float("nan")
    in_tok = sum(r.prompt_tokens for r in ok)
    out_tok = sum(r.output_tokens for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    aborted = [r for r in results if r.aborted]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    ttfts_seen = ttfts + [r.ttft for r in aborted if r.ttft is not None]
    tpots = [t for t in (r.tpot for r in ok) if t is not None]
    itls = [x for r in ok for x in r.itl]
    e2es = [r.e2e for r in ok if r.e2e is not None]
    waits = [r.client_wait for r in results]
    failed = n - len(ok) - len(aborted)
    retried = sum(1 for r in results if r.retries > 0)
    errors: dict[str, int] = {}
    for r in results:
        if not r.success and not r.aborted:
            key = (r.error or "unknown error")[:200]
            errors[key] = errors.get(key, 0) + 1
    sum_e2e = sum(e2es)
    summary = {
        "duration_s": duration_s,
        "num_requests": n,
        "completed": len(ok),
        "failed": failed,
        "error_rate": (failed / n) if n else None,
        "total_retries": sum(r.retries for r in results),
        "requests_retried": retried,
        "retry_rate": (retried / n) if n else None,
        "total_retried_prompt_tokens": sum(r.retried_prompt_tokens for r in results),
        "total_retried_output_tokens": sum(r.retried_output_tokens for r in results),
        "aborted": len(aborted),
        "abort_rate": (len(aborted) / n) if n else None,
        "total_aborted_output_tokens": sum(r.aborted_output_tokens for r in aborted),
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "total_cached_tokens": sum(cached) if cached else None,
        "request_throughput": len(ok) / dur if n else None,
        "input_token_throughput": in_tok / dur if n else None,
        "output_token_throughput": out_tok / dur if n else None,
        "total_token_throughput": (in_tok + out_tok) / dur if n else None,
        "goodput_slos_ms": dict(slos_ms) if slos_ms else None,
        "goodput": None,
        "good_requests": None,
        "goodput_fraction": None,
        # Client-side split of E2E time: waiting for the first token (queue +
        # prefill on the server, plus network) vs streaming the rest (decode).
        "client_prefill_share": (sum(ttfts) / sum_e2e) if sum_e2e > 0 else None,
        "client_decode_share": (1.0 - sum(ttfts) / sum_e2e) if sum_e2e > 0 else None,
        "ttft_ms": latency_stats(ttfts_seen, percentiles),
        "tpot_ms": latency_stats(tpots, percentiles),
        "itl_ms": latency_stats(itls, percentiles),
        "e2e_ms": latency_stats(e2es, percentiles),
        "client_wait_ms": latency_stats(waits, percentiles),
        "errors": errors,
    }
    if slos_ms:
        good = sum(1 for r in ok if meets_slos(r, slos_ms))
        summary["good_requests"] = good
        summary["goodput"] = good / dur if n else None
        meant = n - len(aborted)  # an abandoned stream was never going to meet an E2E SLO
        summary["goodput_fraction"] = (good / meant) if meant else None
    return summary


# ---------------------------------------------------------------------------
# Server-side Prometheus metrics
# ---------------------------------------------------------------------------

#: Histogram base names scraped from the server (vLLM's names).
SERVER_HISTOGRAMS = {
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "decode": "vllm:request_decode_time_seconds",
    "ttft": "vllm:time_to_first_token_seconds",
    "tpot": "vllm:time_per_output_token_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
}
SERVER_COUNTERS = {
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "num_preemptions": "vllm:num_preemptions_total",
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "requests_succeeded": "vllm:request_success_total",
    "spec_decode_num_drafts": "vllm:spec_decode_num_drafts_total",
    "spec_decode_num_draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "spec_decode_num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
}
SERVER_GAUGES = {
    "num_requests_running": "vllm:num_requests_running",
    "num_requests_waiting": "vllm:num_requests_waiting",
    "kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
}


def parse_prometheus_text(text: str) -> dict[str, float]:
    """Prometheus text -> ``{sample_name: value}``, summed over label sets, ``_bucket`` dropped;
    ``vllm:request_success_total`` is also kept per ``finished_reason``. Raises ``ValueError``
    on malformed text."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_bucket") or s.name.endswith("_created"):
                continue
            v = float(s.value)
            if math.isnan(v):
                continue
            out[s.name] = out.get(s.name, 0.0) + v
            reason = s.labels.get("finished_reason")
            if reason is not None:
                k = f"{s.name}{{finished_reason={reason}}}"
                out[k] = out.get(k, 0.0) + v
    return out


def _delta(before: Mapping[str, float], after: Mapping[str, float], name: str) -> float | None:
    if name not in after:
        return None
    return after[name] - before.get(name, 0.0)


def server_metrics_delta(
    before: Mapping[str, float] | None, after: Mapping[str, float] | None
) -> dict:
    """Server-side view of a run from two ``parse_prometheus_text`` snapshots: histogram means
    (Δsum / Δcount, ms), queue/prefill/decode shares of their total, prefix-cache hit rate
    (Δhits / Δqueries); None where not exposed; ``available`` False without both snapshots."""
    res: dict = {"available": bool(before is not None and after is not None)}
    keys_hist = [f"{k}_{suf}" for k in SERVER_HISTOGRAMS for suf in ("count", "sum_s", "mean_ms")]
    for k in keys_hist + list(SERVER_COUNTERS) + [
        "queue_time_share",
        "prefill_time_share",
        "decode_time_share",
        "prefill_decode_ratio",
        "prefix_cache_hit_rate",
        "spec_decode_acceptance_rate",
        "spec_decode_mean_accepted_length",
        "finished_reasons",
    ] + [f"{g}_after" for g in SERVER_GAUGES]:
        res[k] = None
    if before is None or after is None:
        return res
    for key, base in SERVER_HISTOGRAMS.items():
        cnt = _delta(before, after, base + "_count")
        sm = _delta(before, after, base + "_sum")
        res[f"{key}_count"] = cnt
        res[f"{key}_sum_s"] = sm
        res[f"{key}_mean_ms"] = (sm / cnt * 1e3) if (cnt and sm is not None and cnt > 0) else None
    for key, name in SERVER_COUNTERS.items():
        res[key] = _delta(before, after, name)
    for key, name in SERVER_GAUGES.items():
        res[f"{key}_after"] = after.get(name)
    parts = {k: res[f"{k}_sum_s"] for k in ("queue", "prefill", "decode")}
    present = {k: v for k, v in parts.items() if v is not None}
    total = sum(present.values())
    if present and total > 0:
        for k in ("queue", "prefill", "decode"):
            res[f"{k}_time_share"] = (parts[k] / total) if parts[k] is not None else None
    if parts["prefill"] is not None and parts["decode"] and parts["decode"] > 0:
        res["prefill_decode_ratio"] = parts["prefill"] / parts["decode"]
    q, h = res["prefix_cache_queries"], res["prefix_cache_hits"]
    if q is not None and h is not None and q > 0:
        res["prefix_cache_hit_rate"] = h / q
    drafts, dt, acc = (res[k] for k in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                         "spec_decode_num_accepted_tokens"))
    if dt and acc is not None:
        res["spec_decode_acceptance_rate"] = acc / dt
    if drafts and acc is not None:
        res["spec_decode_mean_accepted_length"] = 1 + acc / drafts
    prefix = SERVER_COUNTERS["requests_succeeded"] + "{finished_reason="
    reasons = {
        k[len(prefix) : -1]: after[k] - before.get(k, 0.0) for k in after if k.startswith(prefix)
    }
    if reasons:
        res["finished_reasons"] = reasons
    return res
