"""The report side of ``pagedllm bench serve`` (the result dict, ``SCHEMA_VERSION``, its
table; the side-by-side comparison of several endpoint types) and the output helpers every
``bench`` / ``profile`` command shares.

Result dict: ``schema_version``, ``tool``, ``label``, ``date``, ``start_unix_s``,
``config`` (:class:`BenchConfig` fields, ``endpoint_kind``, ``num_prompts_effective``),
``dataset``, ``tokenizer_exact``, ``summary`` (``summarize_results`` plus
``peak_in_flight``, ``num_sessions``, ``num_warmups``), ``server_metrics``
(``server_metrics_delta``), ``cached_tokens`` (usage against ``/metrics``), ``requests``
(``RequestResult.to_dict``), ``cost`` (:func:`~pagedllm.benchmarks.cost.analyze`). A
comparison: ``schema_version``, ``tool``, ``endpoint_types``, ``baseline``, ``comparison``
(:func:`comparison_rows`), ``runs``.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Sequence

from .cost import analyze, format_cost
from .datasets import Dataset, TokenSource
from .metrics import RequestResult, server_metrics_delta, summarize_results
from .serve_options import BenchConfig

if TYPE_CHECKING:
    from .runner import LoadRun

__all__ = ["SCHEMA_VERSION", "build_result", "peak_in_flight", "format_report", "fmt_value", "json_safe",
           "save_json", "cached_tokens_check", "comparison_rows", "build_comparison", "format_comparison"]

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
    server = server_metrics_delta(run.metrics_before, run.metrics_after)
    res = {
        "schema_version": SCHEMA_VERSION,
        "tool": "pagedllm bench serve",
        "label": cfg.label,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(run.wall0)),
        "start_unix_s": run.wall0,
        "config": config,
        "dataset": dataset.describe(),
        "tokenizer_exact": tokens.exact,
        "summary": summary,
        "server_metrics": server,
        "cached_tokens": cached_tokens_check(summary, server),
        "requests": [r.to_dict(run.t0) for r in results],
    }
    res["cost"] = analyze(res, cfg.cost_per_hour, cfg.api_price, cfg.what_if_system_len)
    return res


def cached_tokens_check(summary: dict, server: dict) -> dict:
    """The run's cached prompt tokens two ways: ``in_usage`` (summed over the successful
    requests' usage), ``prefix_cache_hits`` (the ``/metrics`` counter's growth over the run)
    and ``difference`` (hits - usage; None unless both are known). On pagedllm the two agree
    except for hits of requests readmitted after a preemption, of sequences 1..n-1 with
    ``n`` > 1, and of failed requests (docs/api.md)."""
    usage, hits = summary.get("total_cached_tokens"), server.get("prefix_cache_hits")
    diff = None if usage is None or hits is None else hits - usage
    return {"in_usage": usage, "prefix_cache_hits": hits, "difference": diff}


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
    cached = res.get("cached_tokens") or {}
    row("Cached prompt tokens (usage)", cached.get("in_usage"), ".0f")
    row("Prefix cache hits (tokens)", cached.get("prefix_cache_hits"), ".0f")
    row("Hits not in usage (hits - usage)", cached.get("difference"), ".0f")
    if m.get("spec_decode_num_drafts"):
        row("Spec decode acceptance rate", m["spec_decode_acceptance_rate"], ".2%")
        row("Spec decode mean accepted length", m["spec_decode_mean_accepted_length"])
    row("Server-side mean TTFT (ms)", m["ttft_mean_ms"])
    if s["errors"]:
        title("Errors")
        for e, n in sorted(s["errors"].items(), key=lambda kv: -kv[1])[:5]:
            lines.append(f"{n:>6} x {e[:w + 6]}")
    if res.get("cost"):
        lines.append(format_cost(res["cost"]))
    lines.append("=" * (w + 16))
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# bench serve over several endpoint types
# ---------------------------------------------------------------------------


def comparison_rows(runs: Sequence[dict], baseline: str | None = None) -> list[dict]:
    """One row per run (a result dict each, same workload): ``endpoint_type``, request and
    token counts, ``output_token_throughput`` (tok/s) and its ratio to the ``baseline``
    run's (``vs_baseline``; default baseline: the chat run, else the first), TTFT / TPOT
    median and p99 (ms), the cached-token check, ``prefix_cache_reset``."""
    by_kind = {r["config"]["endpoint_kind"]: r for r in runs}
    base = by_kind.get(baseline or ("chat" if "chat" in by_kind else runs[0]["config"]["endpoint_kind"]))
    base_tps = base["summary"]["output_token_throughput"] if base else None
    rows = []
    for r in runs:
        s, c = r["summary"], r.get("cached_tokens") or {}
        tps = s["output_token_throughput"]
        rows.append({
            "endpoint_type": r["config"]["endpoint_kind"],
            "completed": s["completed"], "failed": s["failed"],
            "total_input_tokens": s["total_input_tokens"], "total_output_tokens": s["total_output_tokens"],
            "output_token_throughput": tps,
            "vs_baseline": (tps / base_tps) if tps is not None and base_tps else None,
            "ttft_median_ms": s["ttft_ms"]["median"], "ttft_p99_ms": s["ttft_ms"]["p99"],
            "tpot_median_ms": s["tpot_ms"]["median"], "tpot_p99_ms": s["tpot_ms"]["p99"],
            "cached_tokens_in_usage": c.get("in_usage"), "prefix_cache_hits": c.get("prefix_cache_hits"),
            "cached_tokens_difference": c.get("difference"),
            "prefix_cache_reset": r.get("prefix_cache_reset"),
        })
    return rows


def build_comparison(runs: Sequence[dict]) -> dict:
    """The comparison document of ``runs`` (module doc)."""
    kinds = [r["config"]["endpoint_kind"] for r in runs]
    return {"schema_version": SCHEMA_VERSION, "tool": "pagedllm bench serve", "endpoint_types": kinds,
            "baseline": "chat" if "chat" in kinds else kinds[0], "comparison": comparison_rows(runs),
            "runs": list(runs)}


def format_comparison(doc: dict) -> str:
    """The side-by-side table of a :func:`build_comparison` document ("n/a" where missing)."""
    cols = [("endpoint", "endpoint_type", ""), ("ok", "completed", ""), ("fail", "failed", ""),
            ("in tok", "total_input_tokens", ""), ("out tok", "total_output_tokens", ""),
            ("out tok/s", "output_token_throughput", ".2f"), (f"vs {doc['baseline']}", "vs_baseline", ".3f"),
            ("TTFT p50", "ttft_median_ms", ".1f"), ("TTFT p99", "ttft_p99_ms", ".1f"),
            ("TPOT p50", "tpot_median_ms", ".1f"), ("cached", "cached_tokens_in_usage", ".0f"),
            ("hits", "prefix_cache_hits", ".0f")]
    cells = [[h for h, _, _ in cols]] + [[fmt_value(row.get(key), spec) for _, key, spec in cols]
                                          for row in doc["comparison"]]
    width = [max(len(r[i]) for r in cells) for i in range(len(cols))]
    table = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, width)))
             for r in cells]
    lines = [" Endpoint comparison (same workload) ".center(len(table[0]), "="), *table,
             "latencies in ms; cached: cached prompt tokens in usage; hits: /metrics prefix-cache hits"]
    if any(r.get("prefix_cache_reset") is False for r in doc["comparison"]):
        lines.append("note: the prefix cache could not be reset between endpoint types; later runs may have "
                     "found earlier runs' prompts cached")
    return "\n".join(lines)
