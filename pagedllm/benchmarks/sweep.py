"""``pagedllm bench sweep``: ``bench serve`` at increasing load (``--request-rates``, open
loop, or ``--concurrencies``, closed loop) to find the highest load meeting the SLO, and
the cost of a token there.

A point meets the SLO when each ``--slo METRIC:MS`` at ``--slo-percentile`` (default p99)
is within its limit, the error rate is at most ``--max-error-rate`` and a request
completed. ``best_load``: the highest load such that it and every lower one pass
(``--refine N`` bisects N more times). Cost at it, from measured throughput:
``cost_per_hour / (3600 * output_tok_per_s) * 1e6`` per 1M output tokens and
``cost_per_hour / (3600 * req_per_s) * 1e3`` per 1k requests. Each point carries its
:mod:`~pagedllm.benchmarks.cost` analysis; the best point's prices the break-even against
``--api-price`` at its throughput (the capacity within the SLO).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import sys
from pagedllm.entrypoints.cli import HelpFormatter
from typing import Any, Sequence

from .cost import add_cost_arguments, format_cost
from .datasets import Dataset, TokenSource
from .extras import require_bench_packages
from .metrics import parse_slos, pct_key
from .report import fmt_value, save_json
from .runner import run_benchmark
from .serve_options import BenchConfig, BenchError, add_common_arguments, positive_int, prepare

__all__ = ["evaluate_point", "best_load", "run_sweep", "cost_at", "format_sweep", "add_sweep_arguments",
           "sweep_main", "parse_loads", "register"]


def parse_loads(text: str, flag: str, integer: bool) -> list[float]:
    """A comma-separated, strictly increasing list of positive loads. Raises ``ValueError``
    naming ``flag``."""
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated numbers, got {text!r}") from None
    if not vals:
        raise ValueError(f"{flag}: no values given")
    for v in vals:
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"{flag}: values must be positive and finite, got {v:g}")
        if integer and v != int(v):
            raise ValueError(f"{flag}: values must be integers, got {v:g}")
    if any(b <= a for a, b in zip(vals, vals[1:])):
        raise ValueError(f"{flag}: values must be strictly increasing, got {text!r}")
    return [int(v) for v in vals] if integer else vals


def evaluate_point(summary: dict, slos_ms: dict, percentile: float, max_error_rate: float) -> tuple[bool, list[str]]:
    """(ok, violations) of one run's ``summary`` (``run_benchmark(...)["summary"]``, ms)."""
    key = pct_key(percentile)
    why = []
    if not summary.get("completed"):
        why.append("no request completed")
    for metric, limit in slos_ms.items():
        v = summary[f"{metric}_ms"].get(key)
        if v is None:
            if metric in ("tpot", "itl"):
                continue  # no decode samples: nothing violates a per-token SLO
            why.append(f"{metric} {key} n/a")
        elif v > limit:
            why.append(f"{metric} {key} {v:.1f} > {limit:g} ms")
    er = summary.get("error_rate") or 0.0
    if er > max_error_rate:
        why.append(f"error rate {er:.2%} > {max_error_rate:.2%}")
    return (not why), why


def best_load(points: Sequence[dict]) -> float | None:
    """Highest ``load`` such that it and all lower loads have ``meets_slo``; None if the lowest fails."""
    best = None
    for pt in sorted(points, key=lambda p: p["load"]):
        if not pt["meets_slo"]:
            break
        best = pt["load"]
    return best


def cost_at(point: dict | None, cost_per_hour: float | None) -> dict:
    """Cost per 1M output tokens and per 1k requests (USD) at a point's measured throughput."""
    out = {"cost_per_hour_usd": cost_per_hour, "cost_per_1m_output_tokens_usd": None,
           "cost_per_1k_requests_usd": None}
    if point is None or cost_per_hour is None:
        return out
    tok, req = point.get("output_token_throughput"), point.get("request_throughput")
    if tok:
        out["cost_per_1m_output_tokens_usd"] = cost_per_hour / (3600.0 * tok) * 1e6
    if req:
        out["cost_per_1k_requests_usd"] = cost_per_hour / (3600.0 * req) * 1e3
    return out


def _point_record(load: float, mode: str, res: dict, slos_ms: dict, percentile: float,
                  max_error_rate: float) -> dict:
    s = res["summary"]
    ok, why = evaluate_point(s, slos_ms, percentile, max_error_rate)
    key = pct_key(percentile)
    lat = {m: {"mean": s[f"{m}_ms"]["mean"], key: s[f"{m}_ms"].get(key), "p99": s[f"{m}_ms"].get("p99")}
           for m in ("ttft", "tpot", "itl", "e2e")}
    sm = res["server_metrics"]
    return {
        "load": load,
        "mode": mode,
        "request_rate": res["config"]["request_rate"],
        "max_concurrency": res["config"]["max_concurrency"],
        "num_requests": s["num_requests"],
        "completed": s["completed"],
        "error_rate": s["error_rate"],
        "retry_rate": s["retry_rate"],
        "abort_rate": s["abort_rate"],
        "duration_s": s["duration_s"],
        "request_throughput": s["request_throughput"],
        "output_token_throughput": s["output_token_throughput"],
        "total_token_throughput": s["total_token_throughput"],
        "goodput": s["goodput"],
        "latency_ms": lat,
        "meets_slo": ok,
        "violations": why,
        "server_queue_time_share": sm.get("queue_time_share"),
        "server_prefix_cache_hit_rate": sm.get("prefix_cache_hit_rate"),
        "server_preemptions": sm.get("num_preemptions"),
        "cost": res.get("cost"),
        "summary": s,
    }


async def run_sweep(cfg: BenchConfig, dataset: Dataset, tokens: TokenSource | None, mode: str,
                    loads: Sequence[float], slos_ms: dict, slo_percentile: float = 99.0,
                    max_error_rate: float = 0.0, refine: int = 0, early_stop: bool = True,
                    cost_per_hour: float | None = None) -> dict:
    """Run ``bench serve`` at each load (``mode`` "rate" or "concurrency"); ``cfg`` gives the
    rest (its ``max_concurrency`` caps rate mode); stops at the first failing point with
    ``early_stop``; warm-ups before the first point only. Returns ``points`` (by load),
    ``best_load``, ``best_point`` and the costs. Raises ``BenchError``/``ValueError`` on bad
    options."""
    if mode not in ("rate", "concurrency"):
        raise ValueError("mode must be 'rate' or 'concurrency'")
    if not slos_ms:
        raise ValueError("--slo: at least one SLO (e.g. ttft:500) is required")
    dataclasses.replace(cfg, request_rate=1.0 if mode == "rate" else math.inf,
                        max_concurrency=cfg.max_concurrency or int(loads[0])).validate()
    points: list[dict] = []
    first = True
    tag = f"[sweep {cfg.label or cfg.base_url}]"
    planned = len(loads) + max(0, refine)

    async def run_at(load: float) -> dict:
        nonlocal first
        if not cfg.quiet:
            of = f"of up to {planned}" if refine or early_stop else f"of {planned}"
            print(f"{tag} point {len(points) + 1} ({of}): {mode} {load:g}", file=sys.stderr, flush=True)
        if mode == "rate":
            c = dataclasses.replace(cfg, request_rate=float(load), num_warmups=cfg.num_warmups if first else 0)
        else:
            c = dataclasses.replace(cfg, request_rate=math.inf, max_concurrency=int(load),
                                    num_warmups=cfg.num_warmups if first else 0)
        c.goodput_ms = dict(slos_ms)
        c.progress = cfg.progress and not cfg.quiet
        c.progress_desc = f"{tag} {mode} {load:g}"
        c.quiet = True
        first = False
        res = await run_benchmark(c, dataset, tokens)
        if cfg.model is None:
            cfg.model = c.model
        pt = _point_record(load, mode, res, slos_ms, slo_percentile, max_error_rate)
        if not cfg.quiet:
            verdict = "meets SLO" if pt["meets_slo"] else "FAILS: " + "; ".join(pt["violations"])
            print(f"{tag} {mode} {load:g}: {pt['request_throughput'] or 0:.2f} req/s, "
                  f"{pt['output_token_throughput'] or 0:.1f} tok/s -> {verdict}", file=sys.stderr, flush=True)
        points.append(pt)
        return pt

    for load in loads:
        pt = await run_at(load)
        if early_stop and not pt["meets_slo"]:
            break
    for _ in range(max(0, refine)):
        ordered = sorted(points, key=lambda p: p["load"])
        lo = best_load(ordered)
        if lo is None:
            break
        above = [p["load"] for p in ordered if p["load"] > lo]
        if not above:
            break
        hi = min(above)
        mid = (lo + hi) / 2.0
        if mode == "concurrency":
            mid = int(mid)
            if mid <= lo:
                break
        await run_at(mid)
    points.sort(key=lambda p: p["load"])
    best = best_load(points)
    best_pt = next((p for p in points if p["load"] == best), None)
    if best_pt is not None and (best_pt.get("cost") or {}).get("api"):
        unit = "req/s" if mode == "rate" else "concurrent sessions"
        best_pt["cost"]["api"]["capacity_source"] = f"the sweep's highest load within the SLO, {best:g} {unit}"
    out = {
        "tool": "pagedllm bench sweep",
        "label": cfg.label,
        "base_url": cfg.base_url,
        "model": cfg.model,
        "mode": mode,
        "loads_requested": list(loads),
        "slos_ms": dict(slos_ms),
        "slo_percentile": slo_percentile,
        "slo_percentile_key": pct_key(slo_percentile),
        "max_error_rate": max_error_rate,
        "dataset": dataset.describe(),
        "points": points,
        "best_load": best,
        "best_point": None if best_pt is None else {k: v for k, v in best_pt.items() if k != "summary"},
    }
    out.update(cost_at(best_pt, cost_per_hour))
    return out


def format_sweep(sweeps: Sequence[dict]) -> str:
    """Text table of one sweep, or of several side by side (``--compare``)."""
    lines = []
    fv = fmt_value
    key = sweeps[0]["slo_percentile_key"]
    slo = " ".join(f"{k}:{v:g}ms" for k, v in sweeps[0]["slos_ms"].items())
    lines.append(f"SLO: {key} {slo}; max error rate {sweeps[0]['max_error_rate']:.2%}")
    block = f" | {'req/s':>7} {'tok/s':>8} {key + ' TTFT':>10} {key + ' TPOT':>10} {key + ' E2E':>10} {'err':>6} {'SLO':>4}"
    head = f"{'load':>8}" + block * len(sweeps)
    if len(sweeps) > 1:
        tags = f"{'':>8}"
        for sw in sweeps:
            tag = f"[{(sw.get('label') or sw['base_url'])}]"[: len(block) - 3]
            tags += " | " + tag.center(len(block) - 3)
        lines.append(tags)
    lines.append(head)
    lines.append("-" * len(head))
    loads = sorted({pt["load"] for sw in sweeps for pt in sw["points"]})
    for load in loads:
        row = f"{load:>8g}"
        for sw in sweeps:
            pt = next((p for p in sw["points"] if p["load"] == load), None)
            if pt is None:
                row += f" | {'-':>7} {'-':>8} {'-':>10} {'-':>10} {'-':>10} {'-':>6} {'-':>4}"
                continue
            lat = pt["latency_ms"]
            row += (f" | {fv(pt['request_throughput'], '.2f'):>7} {fv(pt['output_token_throughput'], '.1f'):>8}"
                    f" {fv(lat['ttft'][key], '.1f'):>10} {fv(lat['tpot'][key], '.1f'):>10}"
                    f" {fv(lat['e2e'][key], '.1f'):>10}"
                    f" {fv(pt['error_rate'], '.1%'):>6} {'ok' if pt['meets_slo'] else 'FAIL':>4}")
        lines.append(row)
    lines.append("")
    unit = "req/s" if sweeps[0]["mode"] == "rate" else "concurrent sessions"
    for sw in sweeps:
        tag = sw.get("label") or sw["base_url"]
        bp = sw["best_point"]
        if bp is None:
            lines.append(f"{tag}: no load met the SLO")
            continue
        lines.append(f"{tag}: highest load meeting the SLO = {sw['best_load']:g} {unit} "
                     f"({bp['request_throughput']:.2f} req/s, {bp['output_token_throughput']:.1f} output tok/s)")
        if sw.get("cost_per_hour_usd") is not None:
            lines.append(f"    at ${sw['cost_per_hour_usd']:g}/h: ${fv(sw['cost_per_1m_output_tokens_usd'], '.4f')} "
                         f"per 1M output tokens, ${fv(sw['cost_per_1k_requests_usd'], '.4f')} per 1k requests")
        if bp.get("cost"):
            lines.append(format_cost(bp["cost"], f"{tag}: cost at the highest load within the SLO"))
    return "\n".join(lines)


def register(subparsers: "argparse._SubParsersAction") -> None:
    p = subparsers.add_parser(
        "sweep", help="find the highest request rate / concurrency that meets an SLO",
        description="Run 'bench serve' at increasing load and report the highest load meeting the SLO.",
        formatter_class=HelpFormatter)
    add_sweep_arguments(p)
    p.set_defaults(func=sweep_main)


def add_sweep_arguments(p: Any) -> None:
    add_common_arguments(p, single_run=False)
    s = p.add_argument_group("sweep")
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument("--request-rates", default=None, metavar="R1,R2,...",
                   help="increasing offered request rates (req/s) to try")
    g.add_argument("--concurrencies", default=None, metavar="C1,C2,...",
                   help="increasing max concurrencies to try (requests sent as fast as allowed)")
    s.add_argument("--max-concurrency", type=positive_int, default=None,
                   help="in --request-rates mode, also cap sessions in flight")
    s.add_argument("--slo", nargs="+", required=True, metavar="METRIC:MS",
                   help="latency SLOs, e.g. --slo ttft:500 tpot:50 (metrics: ttft, tpot, itl, e2e)")
    s.add_argument("--slo-percentile", type=float, default=99.0, help="percentile the SLO applies to (default 99)")
    s.add_argument("--max-error-rate", type=float, default=0.0,
                   help="highest error rate a passing point may have (fraction, default 0)")
    s.add_argument("--refine", type=int, default=0, help="extra bisection runs between last pass and first fail")
    s.add_argument("--no-early-stop", action="store_true", help="run every load even after one fails")
    s.add_argument("--cost-per-hour", type=float, default=None, metavar="USD",
                   help="machine price; reports cost per 1M output tokens and per 1k requests")
    add_cost_arguments(s, cost_per_hour=False)
    s.add_argument("--compare", default=None, metavar="URL", help="run the same sweep against a second server")
    s.add_argument("--compare-model", default=None, help="model name on the --compare server")
    s.add_argument("--labels", default=None, metavar="A,B", help="names of the two servers in --compare output")
    s.add_argument("--save-result", default=None, metavar="FILE.json")
    s.add_argument("--plot", default=None, metavar="DIR", help="write sweep_throughput.png and sweep_latency.png")
    s.add_argument("--label", default=None)
    s.add_argument("--quiet", action="store_true")


def sweep_main(args: Any, tokenizer: Any = "load") -> int:
    """Entry point of ``pagedllm bench sweep``; returns the exit code (0 ok, 2 bad options, 1 failure)."""
    try:
        require_bench_packages("aiohttp", *(["matplotlib"] if args.plot else []), purpose="bench sweep")
        slos = parse_slos(args.slo, "--slo")
        if not 0 < args.slo_percentile <= 100:
            raise ValueError(f"--slo-percentile must be in (0, 100], got {args.slo_percentile}")
        if not 0 <= args.max_error_rate <= 1:
            raise ValueError(f"--max-error-rate must be in [0, 1], got {args.max_error_rate}")
        if args.refine < 0:
            raise ValueError(f"--refine must be >= 0, got {args.refine}")
        if args.cost_per_hour is not None and not args.cost_per_hour > 0:
            raise ValueError(f"--cost-per-hour must be > 0, got {args.cost_per_hour}")
        if args.request_rates is not None:
            mode, loads = "rate", parse_loads(args.request_rates, "--request-rates", integer=False)
        else:
            mode, loads = "concurrency", parse_loads(args.concurrencies, "--concurrencies", integer=True)
        labels = [x.strip() for x in args.labels.split(",")] if args.labels else None
        if labels is not None and len(labels) != (2 if args.compare else 1):
            raise ValueError("--labels: give one name per server (two with --compare)")
        if args.compare and not args.compare.startswith(("http://", "https://")):
            raise ValueError(f"--compare must be a URL starting with http://, got {args.compare!r}")
        if args.dataset == "trace":
            raise ValueError("--dataset trace: a trace replays its own timing and cannot be swept; "
                             "run 'bench serve' at several --trace-speedup values instead")
        args.request_rate = math.inf
        cfg, dataset, tokens = prepare(args, tokenizer, validate=False)
        probe = dataclasses.replace(cfg, request_rate=1.0 if mode == "rate" else math.inf,
                                    max_concurrency=cfg.max_concurrency or int(loads[0]))
        probe.validate()
    except (BenchError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    targets = [(args.base_url, args.model)]
    if args.compare:
        targets.append((args.compare, args.compare_model or args.model))
    sweeps = []
    try:
        for i, (url, model) in enumerate(targets):
            c = dataclasses.replace(cfg, base_url=url, model=model,
                                    label=(labels[i] if labels else (args.label if i == 0 else None)) or url)
            sweeps.append(asyncio.run(run_sweep(
                c, dataset, tokens, mode, loads, slos, args.slo_percentile, args.max_error_rate,
                args.refine, not args.no_early_stop, args.cost_per_hour)))
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_sweep(sweeps))
    if args.save_result:
        save_json({"tool": "pagedllm bench sweep", "sweeps": sweeps}, args.save_result)
    if args.plot:
        from .plots import plot_sweep

        for p in plot_sweep(sweeps, args.plot):
            if not cfg.quiet:
                print(f"wrote {p}", file=sys.stderr)
    return 0

