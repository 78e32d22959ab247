"""The report side of ``pagedllm bench serve`` (the result dict, ``SCHEMA_VERSION``, its
table) and the output helpers every ``bench`` / ``profile`` command shares.

Result dict: ``schema_version``, ``tool``, ``label``, ``date``, ``start_unix_s``,
``config`` (:class:`BenchConfig` fields, ``endpoint_kind``, ``num_prompts_effective``),
``dataset``, ``tokenizer_exact``, ``summary`` (``summarize_results`` plus
``peak_in_flight``, ``num_sessions``, ``num_warmups``), ``server_metrics``
(``server_metrics_delta``), ``requests`` (``RequestResult.to_dict``).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Sequence

from .datasets import Dataset, TokenSource
from .metrics import RequestResult, server_metrics_delta, summarize_results
from .serve_options import BenchConfig

if TYPE_CHECKING:
    from .runner import LoadRun

__all__ = ["SCHEMA_VERSION", "build_result", "peak_in_flight", "format_report", "fmt_value", "json_safe",
           "save_json"]

SCHEMA_VERSION = 1


# ---------------------------------------------------------------------------
# Shared output helpers
# ---------------------------------------------------------------------------


def fmt_value(v: Any, spec: str = ".2f") -> str:
    """``v`` for a text table: "n/a" for None or NaN, floats with ``spec``, anything else ``str``."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def json_safe(o: Any) -> Any:
    """``o`` with non-finite floats made strict JSON: NaN -> None, infinities -> "inf"/"-inf"
    (recursing into dicts, lists and tuples)."""
    if isinstance(o, float) and not math.isfinite(o):
        return None if math.isnan(o) else ("inf" if o > 0 else "-inf")
    if isinstance(o, dict):
        return {k: json_safe(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [json_safe(v) for v in o]
    return o


def output_file(path: str) -> str:
    """The ``--output-json`` argparse type: ``path`` if ``save_json`` will be able to write it
    (not a directory; nearest existing parent a writable directory), checked before the run.

    Raises:
        argparse.ArgumentTypeError: where it cannot.
    """
    import argparse

    p = os.path.abspath(path)
    if os.path.isdir(p):
        raise argparse.ArgumentTypeError(f"{path!r} is a directory; give a file name")
    parent = os.path.dirname(p)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"{path!r}: {parent!r} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{path!r}: cannot write in {parent!r}")
    return path


def save_json(obj: dict, path: str) -> None:
    """Write ``obj`` to ``path`` as strict, indented JSON (see :func:`json_safe`; other
    non-JSON values via ``str``), creating parent directories. Raises ``OSError``."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(json_safe(obj), f, indent=2, allow_nan=False, default=str)
        f.write("\n")


# ---------------------------------------------------------------------------
# bench serve result
# ---------------------------------------------------------------------------


def peak_in_flight(results: Sequence[RequestResult]) -> int:
    """Most requests in flight at once (between ``start_time`` and ``end_time``);
    a request ending when another starts does not overlap it."""
    events = sorted([(r.start_time, 1) for r in results] + [(r.end_time, -1) for r in results],
                    key=lambda e: (e[0], e[1]))
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def build_result(cfg: BenchConfig, dataset: Dataset, tokens: TokenSource, run: "LoadRun") -> dict:
    """The result dict of one run (module doc); throughputs per measured second, latencies ms."""
    results = run.results
    duration = max(run.measured_s if run.measured_s is not None else run.t_end - run.t0, 1e-9)
    summary = summarize_results(results, duration, cfg.goodput_ms or None, cfg.percentiles)
    summary["peak_in_flight"] = peak_in_flight(results) if results else 0
    summary["num_sessions"] = len({r.session_id for r in results})
    summary["num_warmups"] = run.num_warmups
    config = asdict(cfg)
    config["request_rate"] = "inf" if math.isinf(cfg.request_rate) else cfg.request_rate
    config["percentiles"] = list(cfg.percentiles)
    config["endpoint_kind"] = run.endpoint_kind
    config["num_prompts_effective"] = run.num_prompts
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "pagedllm bench serve",
        "label": cfg.label,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(run.wall0)),
        "start_unix_s": run.wall0,
        "config": config,
        "dataset": dataset.describe(),
        "tokenizer_exact": tokens.exact,
        "summary": summary,
        "server_metrics": server_metrics_delta(run.metrics_before, run.metrics_after),
        "requests": [r.to_dict(run.t0) for r in results],
    }


def format_report(res: dict) -> str:
    """Human-readable table of a ``run_benchmark`` result ("n/a" for missing values)."""
    s, m, c = res["summary"], res["server_metrics"], res["config"]
    w = 44
    lines = []

    def title(t: str) -> None:
        lines.append(f"{'-' * 8} {t} ".ljust(w + 16, "-"))

    def row(k: str, v: Any, spec: str = ".2f") -> None:
        val = fmt_value(v, spec)
        lines.append(k + val.rjust(max(len(val) + 2, w + 16 - len(k))))

    lines.append("=" * (w + 16))
    lines.append(" Serving Benchmark Result ".center(w + 16, "="))
    lines.append("=" * (w + 16))
    row("Dataset", res["dataset"]["name"])
    row("Model", c.get("model"))
    row("Request rate (req/s)", c["request_rate"])
    row("Max concurrency", c["max_concurrency"])
    row("Requests issued", s["num_requests"])
    row("Successful requests", s["completed"])
    row("Failed requests", s["failed"])
    row("Error rate", s["error_rate"], ".2%")
    row("Retries (total)", s["total_retries"])
    row("Retry rate (requests retried)", s["retry_rate"], ".2%")
    if s.get("total_retries"):
        row("Retried attempts: prompt tokens", s.get("total_retried_prompt_tokens"))
        row("Retried attempts: output tokens", s.get("total_retried_output_tokens"))
    row("Abandoned streams", s.get("aborted"))
    row("Abandoned-stream rate", s.get("abort_rate"), ".2%")
    if s.get("aborted"):
        row("Output tokens read before abandoning", s.get("total_aborted_output_tokens"))
    row("Benchmark duration (s)", s["duration_s"])
    row("Total input tokens", s["total_input_tokens"])
    row("Total output tokens", s["total_output_tokens"])
    row("Request throughput (req/s)", s["request_throughput"])
    if s.get("goodput_slos_ms"):
        slo = " ".join(f"{k}:{v:g}" for k, v in s["goodput_slos_ms"].items())
        row(f"Goodput (req/s) [{slo} ms]", s["goodput"])
        row("Requests meeting SLOs", s["goodput_fraction"], ".2%")
    row("Input token throughput (tok/s)", s["input_token_throughput"])
    row("Output token throughput (tok/s)", s["output_token_throughput"])
    row("Total token throughput (tok/s)", s["total_token_throughput"])
    row("Peak requests in flight", s.get("peak_in_flight"))
    for key, name in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st)"),
                      ("itl_ms", "Inter-token Latency"), ("e2e_ms", "End-to-end Latency")):
        title(name)
        st = s[key]
        short = key.split("_")[0].upper()
        for stat in ("mean", "median", "p90", "p99", "max"):
            row(f"{stat.capitalize() if stat in ('mean', 'median', 'max') else stat.upper()} {short} (ms)", st.get(stat))
        for k, v in st.items():
            if k.startswith("p") and k not in ("p90", "p99", "p50"):
                row(f"{k.upper()} {short} (ms)", v)
    title("Client time split")
    row("Waiting for first token (share of E2E)", s["client_prefill_share"], ".2%")
    row("Streaming after first token (share)", s["client_decode_share"], ".2%")
    row("Mean client-side wait (ms)", s["client_wait_ms"]["mean"])
    title("Server metrics (Prometheus, over the run)")
    if not m["available"]:
        row("/metrics", "n/a")
    row("Mean queue time (ms)", m["queue_mean_ms"])
    row("Mean prefill time (ms)", m["prefill_mean_ms"])
    row("Mean decode time (ms)", m["decode_mean_ms"])
    row("Queue time share", m["queue_time_share"], ".2%")
    row("Prefill time share", m["prefill_time_share"], ".2%")
    row("Decode time share", m["decode_time_share"], ".2%")
    row("Preemptions", m["num_preemptions"], ".0f")
    row("Prefix cache hit rate", m["prefix_cache_hit_rate"], ".2%")
    if m.get("spec_decode_num_drafts"):
        row("Spec decode acceptance rate", m["spec_decode_acceptance_rate"], ".2%")
        row("Spec decode mean accepted length", m["spec_decode_mean_accepted_length"])
    row("Server-side mean TTFT (ms)", m["ttft_mean_ms"])
    if s["errors"]:
        title("Errors")
        for e, n in sorted(s["errors"].items(), key=lambda kv: -kv[1])[:5]:
            lines.append(f"{n:>6} x {e[:w + 6]}")
    lines.append("=" * (w + 16))
    return "\n".join(lines)
