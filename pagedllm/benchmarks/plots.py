"""PNG plots for ``bench serve`` and ``bench sweep`` results (matplotlib's object API and
Agg canvas: no pyplot, no global backend switch)."""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from .extras import import_bench_package

__all__ = ["plot_latency_cdfs", "plot_timeline", "plot_serve_result", "plot_sweep", "plot_cost", "plot_compare"]

_COLORS = {
    "wait": "#b0b0b0",
    "queue": "#f2a93b",
    "prefill": "#4c78a8",
    "ttft": "#4c78a8",
    "decode": "#54a24b",
    "failed": "#e45756",
}


def _figure(w: float, h: float):
    backend_agg = import_bench_package("matplotlib.backends.backend_agg", "--plot")
    fig = import_bench_package("matplotlib.figure", "--plot").Figure(figsize=(w, h), dpi=100)
    backend_agg.FigureCanvasAgg(fig)
    return fig


def _save(fig, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, format="png")
    return path


def plot_latency_cdfs(res: dict, path: str) -> str:
    """Empirical CDFs of TTFT, TPOT, ITL and E2E (ms) of a serve result; returns ``path``."""
    reqs = [r for r in res["requests"] if r["success"]]
    series = {
        "TTFT": [r["ttft_ms"] for r in reqs if r["ttft_ms"] is not None],
        "TPOT": [r["tpot_ms"] for r in reqs if r["tpot_ms"] is not None],
        "ITL": [x for r in reqs for x in r["itl_ms"]],
        "E2E": [r["e2e_ms"] for r in reqs if r["e2e_ms"] is not None],
    }
    fig = _figure(10, 7.5)
    axes = fig.subplots(2, 2)
    title = res.get("label") or res.get("dataset", {}).get("name", "")
    fig.suptitle(f"Latency CDFs {title}".strip())
    for ax, (name, vals) in zip(axes.flat, series.items()):
        ax.set_title(name)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.grid(True, alpha=0.3)
        if not vals:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
            continue
        v = np.sort(np.asarray(vals, dtype=float))
        y = np.arange(1, v.size + 1) / v.size
        ax.step(v, y, where="post", color="#4c78a8", lw=1.8)
        for q, c in ((50, "#54a24b"), (99, "#e45756")):
            pv = float(np.percentile(v, q))
            ax.axvline(pv, color=c, ls="--", lw=1, label=f"p{q} = {pv:.1f} ms")
        ax.set_ylim(0, 1.02)
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def plot_timeline(res: dict, path: str, max_requests: int = 400) -> str:
    """Per-request timeline (Gantt chart) of a serve result; returns ``path``. Bars: client
    wait, TTFT (split into queue and prefill in the ratio of the server's mean times, when
    /metrics has them), decode."""
    m = res.get("server_metrics") or {}
    q, p = m.get("queue_mean_ms"), m.get("prefill_mean_ms")
    qfrac = q / (q + p) if (q is not None and p is not None and q + p > 0) else None
    reqs = sorted(res["requests"], key=lambda r: (r["start_s"], r["request_id"]))[:max_requests]
    fig = _figure(11, max(4.0, min(12.0, 2.0 + 0.04 * len(reqs))))
    ax = fig.add_subplot(1, 1, 1)
    bars: dict[str, tuple[list, list]] = {k: ([], []) for k in ("wait", "queue", "prefill", "ttft", "decode", "failed")}
    for y, r in enumerate(reqs):
        sched, start, end = r["scheduled_s"], r["start_s"], r["end_s"]
        if start - sched > 0:
            bars["wait"][0].append((sched, start - sched))
            bars["wait"][1].append(y)
        if not r["success"]:
            bars["failed"][0].append((start, max(end - start, 1e-4)))
            bars["failed"][1].append(y)
            continue
        ft = r["first_token_s"] if r["first_token_s"] is not None else end
        if qfrac is None:
            bars["ttft"][0].append((start, ft - start))
            bars["ttft"][1].append(y)
        else:
            split = start + qfrac * (ft - start)
            bars["queue"][0].append((start, split - start))
            bars["queue"][1].append(y)
            bars["prefill"][0].append((split, ft - split))
            bars["prefill"][1].append(y)
        bars["decode"][0].append((ft, end - ft))
        bars["decode"][1].append(y)
    labels = {"wait": "client wait (concurrency limit)", "queue": "server queue (est.)",
              "prefill": "prefill (est.)", "ttft": "queue + prefill (TTFT)", "decode": "decode",
              "failed": "failed"}
    for key, (spans, ys) in bars.items():
        if not spans:
            continue
        for (x0, w), y in zip(spans, ys):
            ax.broken_barh([(x0, w)], (y - 0.4, 0.8), facecolors=_COLORS[key])
        ax.plot([], [], color=_COLORS[key], lw=8, label=labels[key])
    ax.set_xlabel("time since benchmark start (s)")
    ax.set_ylabel("request (by send time)")
    ax.set_ylim(-1, max(len(reqs), 1))
    ax.invert_yaxis()
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=5, fontsize=8, frameon=False)
    shown = f" (first {len(reqs)} of {len(res['requests'])})" if len(res["requests"]) > len(reqs) else ""
    ax.set_title(f"Per-request timeline{shown}")
    fig.tight_layout()
    return _save(fig, path)


def plot_serve_result(res: dict, out_dir: str, prefix: str = "") -> list[str]:
    """Write ``latency_cdf.png``, ``timeline.png`` and (with a ``cost`` analysis) ``cost.png``
    into ``out_dir``; returns their paths."""
    out = [
        plot_latency_cdfs(res, os.path.join(out_dir, f"{prefix}latency_cdf.png")),
        plot_timeline(res, os.path.join(out_dir, f"{prefix}timeline.png")),
    ]
    if res.get("cost"):
        out.append(plot_cost(res["cost"], os.path.join(out_dir, f"{prefix}cost.png"), res.get("label") or ""))
    return out


_COST_COLORS = {"prompt_computed": "#4c78a8", "prompt_cached": "#9ecae9", "output_delivered": "#54a24b",
                "retried": "#e45756", "aborted": "#f58518", "never_received": "#b279a2",
                "idle_tool_wait": "#eeca3b", "idle": "#d0d0d0", "unattributed": "#777777",
                "tool_wait": "#eeca3b", "client_wait": "#b0b0b0", "server_queue": "#f2a93b", "prefill": "#4c78a8",
                "decode": "#54a24b", "failed": "#e45756"}


def plot_cost(cost: dict, path: str, title: str = "") -> str:
    """Four panels of a :func:`~pagedllm.benchmarks.cost.analyze` result: machine time and
    tokens by row (stacked shares), the sessions' time by phase, cost share by prompt
    length, and (with an API price) $ per 1M output tokens against utilisation with the
    break-even; returns ``path``."""
    fig = _figure(13, 8)
    (a1, a2), (a3, a4) = fig.subplots(2, 2)
    fig.suptitle(f"What the run cost, and why {title}".strip())

    def stacked(ax, bars: list[tuple[str, list[tuple[str, str, float]]]], xlabel: str) -> None:
        seen = set()
        for y, (name, parts) in enumerate(bars):
            left = 0.0
            for key, label, v in parts:
                if not v or v <= 0:
                    continue
                ax.barh(y, v, left=left, color=_COST_COLORS.get(key, "#999999"),
                        label=None if key in seen else label)
                seen.add(key)
                if v >= 0.06:
                    ax.text(left + v / 2, y, f"{v:.0%}", ha="center", va="center", fontsize=7)
                left += v
        ax.set_yticks(range(len(bars)))
        ax.set_yticklabels([b[0] for b in bars])
        ax.set_xlim(0, 1)
        ax.set_xlabel(xlabel)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=3, frameon=False)

    rows = cost["rows"]
    stacked(a1, [("machine time", [(r["key"], r["label"], r["time_share"]) for r in rows]),
                 ("tokens", [(r["key"], r["label"], r["token_share"]) for r in rows if r["tokens"] is not None])],
            "share of the run")
    a1.set_title("Machine time and tokens")
    st = cost["session_time"]["rows"]
    stacked(a2, [("sessions", [(r["key"], r["label"], r["share"]) for r in st])], "share of the sessions' time")
    a2.set_title("Where the sessions' time went")
    pl = cost["drivers"]["prompt_length"]
    a3.bar([g["bucket"] for g in pl], [100 * (g["share"] or 0) for g in pl], color="#4c78a8")
    for i, g in enumerate(pl):
        if g["usd_per_1m_output_tokens"] is not None:
            a3.text(i, 100 * (g["share"] or 0), f"${g['usd_per_1m_output_tokens']:.3g}/1M out", ha="center",
                    va="bottom", fontsize=7)
    a3.set_ylabel("% of the run's cost")
    a3.set_xlabel("prompt tokens")
    a3.set_title("Cost by prompt length")
    api = cost.get("api") or {}
    self_cap = api.get("self_host_usd_per_1m_output_tokens_at_capacity")
    if self_cap is not None and api.get("api_usd_per_1m_output_tokens") is not None:
        u = np.linspace(0.02, 1.0, 200)
        a4.plot(100 * u, self_cap / u, color="#4c78a8", label="self-hosted")
        a4.axhline(api["api_usd_per_1m_output_tokens"], color="#e45756", ls="--", label="managed API")
        be = api.get("break_even_utilisation")
        if be is not None and be <= 1:
            a4.axvline(100 * be, color="#555555", ls=":", label=f"break-even {be:.0%}")
        a4.set_yscale("log")
        a4.set_xlabel(f"utilisation, % of {api['capacity_output_tok_s']:.1f} output tok/s")
        a4.set_ylabel("$ per 1M output tokens")
        a4.legend(fontsize=8)
    else:
        a4.text(0.5, 0.5, "no break-even: needs --api-price and --cost-per-hour", ha="center", va="center",
                transform=a4.transAxes, fontsize=9)
    a4.set_title("Self-host or managed API")
    for ax in (a3, a4):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


def plot_sweep(sweeps: Sequence[dict], out_dir: str) -> list[str]:
    """``sweep_throughput.png`` and ``sweep_latency.png`` for one or more ``run_sweep``
    results (several = ``--compare``); returns their paths."""
    if not sweeps:
        return []
    mode = sweeps[0]["mode"]
    xlabel = "offered request rate (req/s)" if mode == "rate" else "max concurrency"
    pkey = sweeps[0]["slo_percentile_key"]
    markers = ["o", "s", "^", "D"]

    fig = _figure(11, 4.5)
    ax1, ax2 = fig.subplots(1, 2)
    for i, sw in enumerate(sweeps):
        pts = sw["points"]
        x = [pt["load"] for pt in pts]
        lab = sw.get("label") or sw["base_url"]
        ax1.plot(x, [pt["request_throughput"] or 0 for pt in pts], marker=markers[i % 4], label=lab)
        ax2.plot(x, [pt["output_token_throughput"] or 0 for pt in pts], marker=markers[i % 4], label=lab)
        if sw.get("best_load") is not None:
            for ax in (ax1, ax2):
                ax.axvline(sw["best_load"], ls=":", color=f"C{i}", lw=1)
    if mode == "rate":
        lim = max(pt["load"] for sw in sweeps for pt in sw["points"])
        ax1.plot([0, lim], [0, lim], color="#999999", ls="--", lw=1, label="offered rate")
    ax1.set_title("Request throughput")
    ax1.set_ylabel("completed req/s")
    ax2.set_title("Output token throughput")
    ax2.set_ylabel("tokens/s")
    for ax in (ax1, ax2):
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    p1 = _save(fig, os.path.join(out_dir, "sweep_throughput.png"))

    metrics = [("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e", "E2E")]
    fig = _figure(13, 4.5)
    axes = fig.subplots(1, 3)
    slos = sweeps[0].get("slos_ms") or {}
    for ax, (key, name) in zip(axes, metrics):
        for i, sw in enumerate(sweeps):
            pts = sw["points"]
            x = [pt["load"] for pt in pts]
            lab = sw.get("label") or sw["base_url"]
            keys = ["p99"] + ([pkey] if pkey != "p99" else [])
            for k in keys:
                y = [pt["latency_ms"][key].get(k) for pt in pts]
                y = [np.nan if v is None else v for v in y]
                ax.plot(x, y, marker=markers[i % 4], color=f"C{i}", ls="-" if k == "p99" else "--",
                        label=f"{lab} {k}" if len(keys) > 1 else lab)
        if key in slos:
            ax.axhline(slos[key], color="#e45756", ls=":", lw=1.2, label=f"SLO {slos[key]:g} ms ({pkey})")
        ax.set_title(f"{name} ({', '.join(sorted({'p99', pkey}))})")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("ms")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    p2 = _save(fig, os.path.join(out_dir, "sweep_latency.png"))
    out = [p1, p2]
    for i, sw in enumerate(sweeps):
        bp = sw.get("best_point") or {}
        if bp.get("cost"):
            name = "sweep_cost.png" if i == 0 else f"sweep_cost_{i + 1}.png"
            out.append(plot_cost(bp["cost"], os.path.join(out_dir, name), sw.get("label") or sw["base_url"]))
    return out


def plot_compare(rows: Sequence, labels: Sequence[str], out_dir: str) -> str:
    """``compare.png``: A against B as bars, one panel per row of ``bench serve --compare``
    that has a merit (``better`` set) and two values, not both 0; returns its path."""
    rows = [r for r in rows if r.better is not None and r.a is not None and r.b is not None and (r.a or r.b)]
    n = max(1, len(rows))
    cols = min(4, n)
    fig = _figure(3.2 * cols, 3.0 * ((n + cols - 1) // cols))
    axes = np.atleast_1d(fig.subplots((n + cols - 1) // cols, cols)).ravel()
    for ax, r in zip(axes, rows):
        pct = r.spec.endswith("%")
        vals = [v * 100 if pct else v for v in (r.a, r.b)]
        ax.bar([0, 1], vals, color=["C0", "C1"])
        ax.set_xticks([0, 1], ["A", "B"])
        ax.set_title(f"{r.name}{' (%)' if pct else ''}\n({r.better} is better)", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    for ax in axes[len(rows):]:
        ax.set_visible(False)
    fig.suptitle(f"A = {labels[0]}   B = {labels[1]}", fontsize=9)
    fig.tight_layout()
    return _save(fig, os.path.join(out_dir, "compare.png"))
