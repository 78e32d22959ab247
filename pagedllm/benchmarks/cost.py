"""What a ``bench serve`` run cost, and why (``--cost-per-hour``, ``--api-price``).

:func:`analyze` reads one result dict (:func:`~pagedllm.benchmarks.report.build_result`):
its request records, ``summary`` and ``server_metrics`` (``/metrics`` deltas over the run).
It splits the run's machine time into engine time for prompt tokens computed, output
tokens delivered, retried attempts, abandoned streams and tokens the server generated that
no record received, and idle time (during agent tool / retrieval waits, or with nothing in
flight); the same rows in tokens, with the prefix cache's tokens and the compute they
saved. Also: the sessions' wall time by phase (queueing, prefill, decode, tool waits),
money per 1M output tokens, per request and per session, cost by prompt length, session
and system-prompt length, what-if savings, and a managed API's price for the same tokens
with the utilisation at which self-hosting breaks even. :func:`format_cost` prints it;
:func:`compare_cost_rows` gives ``bench serve --compare`` its cost rows for two runs.
Formulas and assumptions: docs/notes/benchmarks.md ("cost.py").
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from .argtypes import non_negative_int

__all__ = ["ApiPrice", "parse_api_price", "api_price_arg", "add_cost_arguments", "union_length", "api_cost_usd",
           "break_even_utilisation", "analyze", "format_cost", "compare_cost_rows", "PROMPT_BUCKETS",
           "RETRY_CUT"]

#: Prompt-length bucket edges (tokens): <1k, 1k-4k, 4k-16k, >=16k.
PROMPT_BUCKETS = (1024, 4096, 16384)
#: System-prompt length bucket edges, used when a run has more than 6 distinct lengths.
SYSTEM_BUCKETS = (512, 2048, 8192)
#: The retry what-if: this fraction of the retried attempts avoided.
RETRY_CUT = 0.05


@dataclass(frozen=True)
class ApiPrice:
    """A managed API's price table, USD per 1M tokens; ``cached_input_per_1m`` None: cached
    prompt tokens are billed at the input price."""

    input_per_1m: float
    output_per_1m: float
    cached_input_per_1m: float | None = None

    @property
    def cached_rate(self) -> float:
        """USD per 1M cached prompt tokens."""
        return self.input_per_1m if self.cached_input_per_1m is None else self.cached_input_per_1m


def parse_api_price(text: str, flag: str = "--api-price") -> ApiPrice:
    """``"INPUT_PER_1M,OUTPUT_PER_1M[,CACHED_INPUT_PER_1M]"`` (USD, finite, >= 0, input and
    output not both 0) -> :class:`ApiPrice`. Raises ``ValueError`` whose message starts with
    ``flag`` (none when ``flag`` is empty)."""
    pre = f"{flag}: " if flag else ""
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) not in (2, 3) or not all(parts):
        raise ValueError(f"{pre}expected INPUT_PER_1M,OUTPUT_PER_1M[,CACHED_INPUT_PER_1M] in USD per 1M tokens "
                         f"(e.g. 3,15,0.3), got {text!r}")
    vals = []
    for name, p in zip(("input", "output", "cached input"), parts):
        try:
            v = float(p)
        except ValueError:
            raise ValueError(f"{pre}the {name} price {p!r} is not a number (in {text!r})") from None
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{pre}the {name} price must be a finite number >= 0, got {p!r}")
        vals.append(v)
    if vals[0] == 0 and vals[1] == 0:
        raise ValueError(f"{pre}input and output prices are both 0: nothing to compare with")
    return ApiPrice(*vals)


def api_price_arg(text: str) -> ApiPrice:
    """Argparse type of ``--api-price`` (argparse names the flag). Raises ``ArgumentTypeError``."""
    try:
        return parse_api_price(text, flag="")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_cost_arguments(group: Any, cost_per_hour: bool = True) -> None:
    """Register ``--api-price``, ``--what-if-system-len`` and (``cost_per_hour``) ``--cost-per-hour``
    on an argparse group."""
    if cost_per_hour:
        group.add_argument("--cost-per-hour", type=float, default=None, metavar="USD",
                           help="machine price per hour: the cost attribution in USD, per 1M output tokens, "
                                "per request and per session")
    group.add_argument("--api-price", type=api_price_arg, default=None, metavar="IN,OUT[,CACHED]",
                       help="a managed API's USD per 1M input, output[, cached input] tokens: its cost for the "
                            "run's tokens and the utilisation at which self-hosting breaks even (with "
                            "--cost-per-hour)")
    group.add_argument("--what-if-system-len", type=non_negative_int, default=None, metavar="TOKENS",
                       help="price cutting the system prompt to this many tokens (default: a third of the run's)")


# ---------------------------------------------------------------------------
# Arithmetic on known inputs
# ---------------------------------------------------------------------------


def union_length(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds covered by the union of ``(start, end)`` intervals, each clipped to [lo, hi]."""
    total, cur_a, cur_b = 0.0, None, None
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals):
        if b <= a:
            continue
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total


def api_cost_usd(price: ApiPrice, uncached_input: float, cached_input: float, output: float) -> float:
    """USD a managed API bills for these token counts: ``(uncached * input + cached *
    cached_rate + output * output_rate) / 1e6``."""
    return (uncached_input * price.input_per_1m + cached_input * price.cached_rate
            + output * price.output_per_1m) / 1e6


def break_even_utilisation(cost_per_hour: float, capacity_tok_s: float, api_usd_per_output_token: float) -> float | None:
    """Utilisation ``u*`` at which self-hosting costs what the API does per output token:
    ``cost_per_hour / (3600 * capacity_tok_s * u*) == api_usd_per_output_token``, so
    ``u* = cost_per_hour / (3600 * capacity_tok_s * api_usd_per_output_token)``; above it
    self-hosting is cheaper (``u* > 1``: never, at this capacity). None when the capacity or
    the API's price is not positive."""
    if not capacity_tok_s or capacity_tok_s <= 0 or not api_usd_per_output_token or api_usd_per_output_token <= 0:
        return None
    return cost_per_hour / (3600.0 * capacity_tok_s * api_usd_per_output_token)


# ---------------------------------------------------------------------------
# The analysis
# ---------------------------------------------------------------------------


@dataclass
class _Req:
    """One request record, in the quantities the analysis needs (tokens may be fractional
    where the cache figure is the run's hit rate)."""

    sid: Any
    ok: bool
    aborted: bool
    failed: bool        # failed for good after its last attempt streamed tokens
    prompt: float       # prompt tokens of the last attempt where it reached the engine, else 0
    cached: float
    out: float          # delivered output tokens, tokens read before abandoning, or streamed before failing
    r_prompt: float
    r_out: float
    prompt_len: float   # the record's prompt length (bucketing; failed: the estimate)
    sched: float
    start: float
    first: float | None
    end: float
    think: float
    system: int | None
    engine_s: float = 0.0
    machine_s: float = 0.0


def _records(res: dict, hit_rate: float) -> list[_Req]:
    out = []
    for r in res.get("requests") or []:
        ab = bool(r.get("aborted"))
        ok = bool(r.get("success")) and not ab
        o = float(r.get("aborted_output_tokens") or 0) if ab else float(r.get("output_tokens") or 0)
        failed = not ok and not ab and o > 0
        prompt = float(r.get("prompt_tokens") or 0) if (ok or ab or failed) else 0.0
        o = o if (ok or ab or failed) else 0.0
        c = r.get("cached_tokens")
        cached = min(prompt, float(c)) if c is not None else prompt * hit_rate
        out.append(_Req(r.get("session_id"), ok, ab, failed, prompt, cached, o,
                        float(r.get("retried_prompt_tokens") or 0),
                        float(r.get("retried_output_tokens") or 0), float(r.get("prompt_tokens") or 0),
                        float(r.get("scheduled_s") or 0.0), float(r.get("start_s") or 0.0), r.get("first_token_s"),
                        float(r.get("end_s") or 0.0), float(r.get("think_time_s") or 0.0), r.get("system_tokens")))
    return out


def _share(x: float, whole: float) -> float | None:
    return x / whole if whole > 0 else None


def _cache_source(res: dict, m: dict) -> tuple[str, float]:
    """(source, hit rate for records without their own figure): "usage" when some records
    carry ``cached_tokens``, else "server" (Δhits / Δqueries), else "none" (0)."""
    q, h = m.get("prefix_cache_queries"), m.get("prefix_cache_hits")
    server = h / q if (m.get("available") and q and h is not None and q > 0) else None
    rep = [(r.get("prompt_tokens") or 0, r["cached_tokens"]) for r in res.get("requests") or []
           if r.get("cached_tokens") is not None]
    if rep:
        p = sum(x for x, _ in rep)
        return "usage", server if server is not None else (sum(c for _, c in rep) / p if p else 0.0)
    if server is not None:
        return "server", server
    return "none", 0.0


def _split(m: dict, reqs: list[_Req], p_comp: float, o_gen: float) -> tuple[str, float | None]:
    """(model, prefill share of busy engine time)."""
    sp, sd = m.get("prefill_sum_s"), m.get("decode_sum_s")
    if m.get("available") and sp is not None and sd is not None and sp >= 0 and sd >= 0 and sp + sd > 0:
        model = "server"
    else:
        timed = [r for r in reqs if r.first is not None]
        sp = sum(r.first - r.start for r in timed)
        sd = sum(r.end - r.first for r in timed)
        model = "client" if sp + sd > 0 else "tokens"
        if model == "tokens":
            sp, sd = p_comp, o_gen
    if p_comp <= 0 and o_gen <= 0:
        return model, None
    if p_comp <= 0:
        return model, 0.0
    if o_gen <= 0:
        return model, 1.0
    return model, sp / (sp + sd) if sp + sd > 0 else p_comp / (p_comp + o_gen)


_MODEL_NOTES = {
    "server": "busy time split by the server's request prefill / decode time histograms (sums, request-seconds)",
    "client": "busy time split by the client's TTFT sum (queueing included) and its E2E - TTFT sum "
              "(the server exports no prefill / decode time)",
    "tokens": "busy time split in proportion to prompt tokens computed and output tokens (no timings)",
}


def _group(reqs: Sequence[_Req], key: Callable[[_Req], Any], labels: Sequence[tuple[Any, str]], total_m: float,
           rate: float | None) -> list[dict]:
    rows = []
    for k, label in labels:
        g = [r for r in reqs if key(r) == k]
        if not g:
            continue
        ms = sum(r.machine_s for r in g)
        out = sum(r.out for r in g if r.ok)
        usd = ms * rate if rate is not None else None
        rows.append({"bucket": label, "requests": len(g), "prompt_tokens": sum(r.prompt_len for r in g),
                     "cached_tokens": sum(r.cached for r in g), "output_tokens": out, "machine_s": ms,
                     "share": _share(ms, total_m), "usd": usd,
                     "usd_per_1m_output_tokens": (usd / out * 1e6) if (usd is not None and out) else None})
    return rows


def _bucket_labels(edges: Sequence[int]) -> list[tuple[int, str]]:
    def k(n: int) -> str:
        return f"{n // 1024}k" if n % 1024 == 0 else str(n)

    out = [(0, f"<{k(edges[0])}")]
    out += [(i + 1, f"{k(a)}-{k(b)}") for i, (a, b) in enumerate(zip(edges, edges[1:]))]
    return out + [(len(edges), f">={k(edges[-1])}")]


def _bucket(n: float, edges: Sequence[int]) -> int:
    return int(np.searchsorted(np.asarray(edges), n, side="right"))


def analyze(res: dict, cost_per_hour: float | None = None, api_price: ApiPrice | None = None,
            what_if_system_len: int | None = None, capacity_tok_s: float | None = None,
            capacity_source: str | None = None) -> dict:
    """The cost analysis of one result dict (module doc; keys and formulas in
    docs/notes/benchmarks.md). ``cost_per_hour`` USD (None: seconds and shares, no USD);
    ``capacity_tok_s`` output tok/s for the break-even (default: the run's own
    ``output_token_throughput``). Never raises on missing optional fields."""
    s, m = res["summary"], res.get("server_metrics") or {}
    T = float(s.get("duration_s") or 0.0)
    cache_src, h = _cache_source(res, m)
    reqs = _records(res, h)
    P_d = sum(r.prompt for r in reqs if r.ok)
    C_d = sum(r.cached for r in reqs if r.ok)
    O_d = sum(r.out for r in reqs if r.ok)
    P_a = sum(r.prompt for r in reqs if r.aborted)
    C_a = sum(r.cached for r in reqs if r.aborted)
    O_a = sum(r.out for r in reqs if r.aborted)
    P_f = sum(r.prompt for r in reqs if r.failed)
    C_f = sum(r.cached for r in reqs if r.failed)
    O_f = sum(r.out for r in reqs if r.failed)
    P_r = sum(r.r_prompt for r in reqs)
    O_r = sum(r.r_out for r in reqs)
    C = C_d + C_a + C_f
    gen = m.get("generation_tokens") if m.get("available") else None
    U = max(0.0, gen - (O_d + O_a + O_f + O_r)) if gen is not None else 0.0
    p_comp = (P_d - C_d) + (P_a - C_a) + (P_f - C_f) + P_r
    o_gen = O_d + O_a + O_f + O_r + U

    busy_spans = [(r.start, r.end) for r in reqs]
    busy = union_length(busy_spans, 0.0, T)
    think = [(r.sched - r.think, r.sched) for r in reqs if r.think > 0]
    idle_tools = max(0.0, union_length(busy_spans + think, 0.0, T) - busy) if think else 0.0
    idle = max(0.0, T - busy - idle_tools)
    model, f_p = _split(m, reqs, p_comp, o_gen)
    prefill_s = busy * f_p if f_p is not None else 0.0
    decode_s = busy - prefill_s if f_p is not None else 0.0
    c_p = prefill_s / p_comp if p_comp > 0 else None
    c_d = decode_s / o_gen if o_gen > 0 else None
    cp, cd = c_p or 0.0, c_d or 0.0
    for r in reqs:
        r.engine_s = cp * (r.prompt - r.cached + r.r_prompt) + cd * (r.out + r.r_out)
    e_rec = sum(r.engine_s for r in reqs)
    loaded = T / e_rec if e_rec > 0 else None    # machine s per engine s of the records' own tokens
    for r in reqs:
        r.machine_s = r.engine_s * loaded if loaded else 0.0
    rate = cost_per_hour / 3600.0 if cost_per_hour else None

    def usd(sec: float | None) -> float | None:
        return None if (rate is None or sec is None) else sec * rate

    n_tok = P_d + O_d + P_r + O_r + P_a + O_a + P_f + O_f + U
    rows = []
    for key, label, tok, sec in (
            ("prompt_computed", "Prompt tokens computed", P_d - C_d, cp * (P_d - C_d)),
            ("prompt_cached", "Prompt tokens from prefix cache", C_d, 0.0),
            ("output_delivered", "Output tokens delivered", O_d, cd * O_d),
            ("retried", "Retried attempts (prompt + output)", P_r + O_r, cp * P_r + cd * O_r),
            ("aborted", "Abandoned streams (prompt + output)", P_a + O_a, cp * (P_a - C_a) + cd * O_a),
            ("failed", "Failed streams (prompt + output)", P_f + O_f, cp * (P_f - C_f) + cd * O_f),
            ("never_received", "Generated, never received", U, cd * U),
            ("idle_tool_wait", "Idle: agent tool / retrieval waits", None, idle_tools),
            ("idle", "Idle: nothing in flight", None, idle),
            ("unattributed", "Busy, no tokens counted", None, busy if f_p is None else 0.0)):
        if key in ("unattributed", "failed") and not sec and not tok:
            continue
        rows.append({"key": key, "label": label, "tokens": tok,
                     "token_share": None if tok is None else _share(tok, n_tok),
                     "seconds": sec, "time_share": _share(sec, T), "usd": usd(sec)})
    saved_s = cp * C
    cache = {"source": cache_src, "hit_rate_fallback": h, "cached_tokens": C,
             "share_of_prompt_tokens": _share(C, P_d + P_a + P_f),
             "saved_engine_s": saved_s, "saved_machine_s": saved_s * loaded if loaded else None,
             "saved_usd": usd(saved_s * loaded) if loaded else None,
             "share_of_prompt_compute_saved": _share(saved_s, prefill_s + saved_s)}

    completed = sum(1 for r in reqs if r.ok)
    sessions = {r.sid for r in reqs}
    run_usd = usd(T)
    money = {"cost_per_hour_usd": cost_per_hour, "run_usd": run_usd,
             "usd_per_1m_output_tokens": (run_usd / O_d * 1e6) if (run_usd is not None and O_d) else None,
             "usd_per_request": (run_usd / completed) if (run_usd is not None and completed) else None,
             "usd_per_session": (run_usd / len(sessions)) if (run_usd is not None and sessions) else None,
             "usd_per_1m_computed_prompt_tokens": usd(c_p * loaded * 1e6) if (c_p and loaded) else None,
             "usd_per_1m_generated_output_tokens": usd(c_d * loaded * 1e6) if (c_d and loaded) else None}

    drivers = _drivers(reqs, T, rate)
    what_if = _what_ifs(reqs, c_p, c_d, loaded, rate, T, O_d, P_r, O_r, C, P_d + P_a + P_f, what_if_system_len)
    api = None
    if api_price is not None:
        cap = capacity_tok_s if capacity_tok_s is not None else s.get("output_token_throughput")
        api = _api(api_price, cost_per_hour, p_comp, C, O_d + O_a + O_f + O_r, O_d, run_usd, cap,
                   capacity_source or "this run's own output throughput, a lower bound unless the run saturated "
                                       "the server")
    fr = m.get("finished_reasons") or {}
    return {
        "engine_time_model": model, "engine_time_model_note": _MODEL_NOTES[model],
        "duration_s": T, "busy_s": busy, "busy_share": _share(busy, T),
        "prefill_share_of_busy": f_p, "prefill_s": prefill_s, "decode_s": decode_s,
        "s_per_computed_prompt_token": c_p, "s_per_output_token": c_d,
        "machine_s_per_engine_s": loaded,
        "tokens": {"prompt_delivered": P_d, "prompt_cached_delivered": C_d, "output_delivered": O_d,
                   "prompt_aborted": P_a, "prompt_cached_aborted": C_a, "output_aborted": O_a,
                   "prompt_failed": P_f, "prompt_cached_failed": C_f, "output_failed": O_f,
                   "prompt_retried": P_r, "output_retried": O_r, "never_received": U,
                   "prompt_computed": p_comp, "output_generated": o_gen, "total": n_tok},
        "rows": rows, "prefix_cache": cache,
        "session_time": _session_time(reqs, m),
        "money": money, "drivers": drivers, "what_if": what_if, "api": api,
        "server": {"preemptions": m.get("num_preemptions"),
                   "spec_decode_acceptance_rate": m.get("spec_decode_acceptance_rate"),
                   "aborts_counted_by_server": fr.get("abort"),
                   "aborted_streams_client": sum(1 for r in reqs if r.aborted),
                   "generation_tokens": gen},
        "counts": {"requests": len(reqs), "completed": completed, "sessions": len(sessions),
                   "aborted": sum(1 for r in reqs if r.aborted)},
    }


def _session_time(reqs: Sequence[_Req], m: dict) -> dict:
    """Wall time of all sessions, by phase; the rows add up to ``total_s``."""
    ttft = sum(r.first - r.start for r in reqs if r.first is not None)
    q = m.get("queue_sum_s") if m.get("available") else None
    queue = min(max(q, 0.0), ttft) if q is not None else None
    parts = [
        ("tool_wait", "Tool / retrieval round-trips (think time)", sum(r.think for r in reqs)),
        ("client_wait", "Client wait (concurrency limit)", sum(max(0.0, r.start - r.sched) for r in reqs)),
        ("server_queue", "Server queue", queue),
        ("prefill", "To first token, after the queue" if queue is not None else
         "To first token (server queue not exported: inside)", ttft - (queue or 0.0)),
        ("decode", "Streaming the reply", sum(r.end - r.first for r in reqs if r.ok and r.first is not None)),
        ("aborted", "Abandoned streams after the first token",
         sum(r.end - r.first for r in reqs if r.aborted and r.first is not None)),
        ("failed", "Failed, or no token before the end",
         sum((r.end - r.first) if r.first is not None else (r.end - r.start)
             for r in reqs if not r.ok and not (r.aborted and r.first is not None))),
    ]
    total = sum(v for _, _, v in parts if v is not None)
    return {"total_s": total, "queueing_s": (queue or 0.0) + parts[1][2],
            "queue_source": "server" if queue is not None else "client wait only",
            "rows": [{"key": k, "label": lab, "seconds": v, "share": None if v is None else _share(v, total)}
                     for k, lab, v in parts]}


def _drivers(reqs: Sequence[_Req], T: float, rate: float | None) -> dict:
    pl = _group(reqs, lambda r: _bucket(r.prompt_len, PROMPT_BUCKETS), _bucket_labels(PROMPT_BUCKETS), T, rate)
    per: dict[Any, dict] = {}
    for r in reqs:
        d = per.setdefault(r.sid, {"requests": 0, "output_tokens": 0.0, "machine_s": 0.0})
        d["requests"] += 1
        d["output_tokens"] += r.out if r.ok else 0.0
        d["machine_s"] += r.machine_s
    for d in per.values():
        d["usd"] = d["machine_s"] * rate if rate is not None else None
        d["share"] = _share(d["machine_s"], T)
    ms = np.asarray([d["machine_s"] for d in per.values()] or [0.0])
    top = sorted(per.items(), key=lambda kv: -kv[1]["machine_s"])[:5]
    sess = {"count": len(per), "machine_s_mean": float(ms.mean()), "machine_s_p50": float(np.percentile(ms, 50)),
            "machine_s_p90": float(np.percentile(ms, 90)), "machine_s_max": float(ms.max()),
            "top": [{"session_id": k, **v} for k, v in top],
            "top_share": _share(sum(v["machine_s"] for _, v in top), T),
            "per_session": {str(k): v for k, v in per.items()}}
    for k in ("mean", "p50", "p90", "max"):
        sess[f"usd_{k}"] = sess[f"machine_s_{k}"] * rate if rate is not None else None
    with_sys = [r for r in reqs if r.system is not None]
    system = None
    if with_sys:
        values = sorted({int(r.system) for r in with_sys})
        if len(values) <= 6:
            system = _group(with_sys, lambda r: int(r.system), [(v, f"{v} tokens") for v in values], T, rate)
        else:
            system = _group(with_sys, lambda r: _bucket(r.system, SYSTEM_BUCKETS), _bucket_labels(SYSTEM_BUCKETS),
                            T, rate)
    return {"prompt_length": pl, "sessions": sess, "system_prompt": system,
            "system_prompt_note": None if with_sys else
            "no system-prompt length in this dataset (multi-turn: --multi-turn-system-len; a trace: system_tokens)"}


def _price(saved_engine_s: float, loaded: float | None, rate: float | None, T: float, O_d: float) -> dict:
    mach = saved_engine_s * loaded if loaded else None
    u = mach * rate if (mach is not None and rate is not None) else None
    return {"engine_s": saved_engine_s, "machine_s": mach, "share_of_run": _share(mach or 0.0, T),
            "usd": u, "usd_per_1m_output_tokens": (u / O_d * 1e6) if (u is not None and O_d) else None}


def _money_text(p: dict, loaded: float | None, rate: float | None, O_d: float) -> str:
    t = f"{p['engine_s']:.4f} engine s"
    if loaded:
        t += (f" x {loaded:.4f} machine s per engine s (this run's utilisation) = {p['machine_s']:.4f} machine s "
              f"({p['share_of_run']:.2%} of the run)")
    if p["usd"] is not None:
        t += (f" x ${rate * 3600:g}/h / 3600 = ${p['usd']:.6f}; / {O_d:,.0f} output tokens x 1e6 = "
              f"${p['usd_per_1m_output_tokens']:.4f} per 1M output tokens")
    return t


_LINEAR = "prefill cost is linear in computed prompt tokens, at the run's mean (attention's growth with context " \
          "is not modelled)"
_LOADED = "machine time scales with engine time at this run's utilisation (idle time shrinks in proportion)"


def _what_ifs(reqs: Sequence[_Req], c_p: float | None, c_d: float | None, loaded: float | None, rate: float | None,
              T: float, O_d: float, P_r: float, O_r: float, cached: float, prompt: float,
              system_len: int | None) -> list[dict]:
    out = []
    cp, cd = c_p or 0.0, c_d or 0.0
    hit = cached / prompt if prompt else 0.0
    # 1. a shorter system prompt
    sys_reqs = [r for r in reqs if r.system is not None and r.prompt > 0]
    if sys_reqs and c_p:
        x = sum(r.system for r in sys_reqs) / len(sys_reqs)
        y = system_len if system_len is not None else int(round(x / 3))
        cut = sum(max(0, r.system - y) for r in sys_reqs)
        p_unc = _price(cut * cp, loaded, rate, T, O_d)
        p_hit = _price(cut * (1 - hit) * cp, loaded, rate, T, O_d)
        out.append({
            "key": "system_prompt", "from_tokens": x, "to_tokens": y, "prompt_tokens_cut": cut,
            "saving_uncached": p_unc, "saving_cached_at_run_hit_rate": p_hit, "run_hit_rate": hit,
            "statement": (f"cutting the system prompt from {x:,.0f} to {y:,} tokens saves "
                          + _headline(p_unc) + " if the system prompt is not cached; " + _headline(p_hit)
                          + f" if it is cached at the run's hit rate ({hit:.1%})"),
            "arithmetic": [f"{len(sys_reqs)} requests x ({x:,.1f} - {y:,}) tokens = {cut:,.0f} prompt tokens "
                           f"x {cp * 1e3:.5f} ms/token = " + _money_text(p_unc, loaded, rate, O_d),
                           f"cached: {cut:,.0f} x (1 - {hit:.4f}) x {cp * 1e3:.5f} ms/token = "
                           + _money_text(p_hit, loaded, rate, O_d)],
            "assumptions": [_LINEAR, _LOADED, "the outputs do not change with the shorter system prompt",
                            "cached variant: the system prompt hits the cache at the run's overall rate; a shared "
                            "system prompt usually hits more often, so the real saving is nearer that figure or below"]})
    # 2. fewer retries
    e_retry = cp * P_r + cd * O_r
    p = _price(RETRY_CUT * e_retry, loaded, rate, T, O_d)
    out.append({
        "key": "fewer_retries", "fraction": RETRY_CUT, "saving": p,
        "statement": (f"{RETRY_CUT:.0%} fewer retried attempts saves " + _headline(p)) if e_retry > 0 else
        "no retried attempt carried tokens in this run (none retried, or each failed before the server took "
        "it): fewer retries save no engine time",
        "arithmetic": [f"{RETRY_CUT:g} x ({P_r:,.0f} prompt tokens x {cp * 1e3:.5f} ms + {O_r:,.0f} output tokens "
                       f"x {cd * 1e3:.5f} ms) = " + _money_text(p, loaded, rate, O_d)] if e_retry > 0 else [],
        "assumptions": ["an avoided attempt costs the mean of this run's retried attempts",
                        "back-off waits are latency, not engine time", _LOADED]})
    # 3. prefix caching off
    p = _price(cached * cp, loaded, rate, T, O_d)
    out.append({
        "key": "prefix_cache_off", "cached_tokens": cached, "extra": p,
        "statement": ("prefix caching off would cost " + _headline(p).replace(" per 1M", " more per 1M", 1)
                      if cached > 0 else
                      "no prompt token came from the prefix cache: turning it off changes nothing here"),
        "arithmetic": [f"{cached:,.0f} cached prompt tokens x {cp * 1e3:.5f} ms/token = "
                       + _money_text(p, loaded, rate, O_d)] if cached > 0 else [],
        "assumptions": [_LINEAR + "; cached tokens are mostly long shared prefixes, so this is a lower bound",
                        "TTFT and queueing would grow too: not priced", _LOADED]})
    return out


def _headline(p: dict) -> str:
    if p["usd_per_1m_output_tokens"] is not None:
        return f"${p['usd_per_1m_output_tokens']:.4f} per 1M output tokens ({p['share_of_run']:.2%} of the run's cost)"
    return f"{p['machine_s'] or 0.0:.2f} machine s ({p['share_of_run']:.2%} of the run)"


def _api(price: ApiPrice, cost_per_hour: float | None, uncached: float, cached: float, output: float, O_d: float,
         run_usd: float | None, capacity: float | None, capacity_source: str) -> dict:
    bill = api_cost_usd(price, uncached, cached, output)
    per_tok = bill / O_d if O_d else None
    self_cap = cost_per_hour / (3600.0 * capacity) if (cost_per_hour and capacity) else None
    u = break_even_utilisation(cost_per_hour, capacity, per_tok) if (cost_per_hour and per_tok) else None
    return {"price": {"input_per_1m": price.input_per_1m, "output_per_1m": price.output_per_1m,
                      "cached_input_per_1m": price.cached_rate},
            "billed_tokens": {"input_uncached": uncached, "input_cached": cached, "output": output},
            "input_per_output_token": (uncached + cached) / O_d if O_d else None,
            "api_usd": bill, "api_usd_per_1m_output_tokens": per_tok * 1e6 if per_tok is not None else None,
            "self_host_usd_per_1m_output_tokens": (run_usd / O_d * 1e6) if (run_usd is not None and O_d) else None,
            "capacity_output_tok_s": capacity, "capacity_source": capacity_source,
            "self_host_usd_per_1m_output_tokens_at_capacity": self_cap * 1e6 if self_cap is not None else None,
            "break_even_utilisation": u}


# ---------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------


def _f(v: Any, spec: str = ".2f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return format(v, spec)


def format_cost(c: dict, title: str = "Cost attribution") -> str:
    """The text block of an :func:`analyze` result (``n/a`` where a figure is missing)."""
    w = 78
    L = [f"{'-' * 8} {title} ".ljust(w, "-"), f"Engine time: {c['engine_time_model_note']}",
         f"Prefix-cache figures: " + {"usage": "each request's usage (cached_tokens)",
                                      "server": "the server's hit rate (prefix_cache_hits / queries)",
                                      "none": "none reported (no usage detail, no prefix-cache lookups in "
                                              "/metrics): all prompt tokens counted as computed"}
         [c["prefix_cache"]["source"]]]
    L.append(f"{'':36}{'tokens':>10}{'tok %':>7}{'seconds':>10}{'time %':>7}{'$':>8}")
    for r in c["rows"]:
        tok = "" if r["tokens"] is None else f"{r['tokens']:,.0f}"
        ts = "" if r["token_share"] is None else f"{r['token_share']:.1%}"
        L.append(f"{r['label'][:36]:36}{tok:>10}{ts:>7}{_f(r['seconds'], '.2f'):>10}"
                 f"{_f(r['time_share'], '.1%'):>7}{_f(r['usd'], '.4f'):>8}")
    money, pc = c["money"], c["prefix_cache"]
    L.append(f"{'Total (run duration)':36}{c['tokens']['total']:>10,.0f}{'':7}{c['duration_s']:>10.2f}{'':7}"
             f"{_f(money['run_usd'], '.4f'):>8}")
    if pc["cached_tokens"]:
        L.append(f"Prefix cache: {pc['cached_tokens']:,.0f} prompt tokens ({_f(pc['share_of_prompt_tokens'], '.1%')})"
                 f" saved {pc['saved_engine_s']:.2f} engine s ({_f(pc['share_of_prompt_compute_saved'], '.1%')} of "
                 f"prompt compute), ${_f(pc['saved_usd'], '.4f')}")
    L.append(f"Busy (a request in flight): {_f(c['busy_share'], '.1%')} of {c['duration_s']:.2f} s; prefill "
             f"{_f(c['prefill_share_of_busy'], '.1%')} of busy; "
             f"{_f(c['s_per_computed_prompt_token'] and c['s_per_computed_prompt_token'] * 1e3, '.4f')} ms per "
             f"computed prompt token, {_f(c['s_per_output_token'] and c['s_per_output_token'] * 1e3, '.3f')} ms "
             f"per output token")
    if money["cost_per_hour_usd"] is not None:
        L.append(f"At ${money['cost_per_hour_usd']:g}/h: ${_f(money['usd_per_1m_output_tokens'], '.4f')} per 1M "
                 f"delivered output tokens, ${_f(money['usd_per_request'], '.6f')} per request, "
                 f"${_f(money['usd_per_session'], '.6f')} per session")
        L.append(f"  loaded per-token cost: ${_f(money['usd_per_1m_computed_prompt_tokens'], '.4f')} per 1M computed "
                 f"prompt tokens, ${_f(money['usd_per_1m_generated_output_tokens'], '.4f')} per 1M generated output")
    sv = c["server"]
    L.append(f"Server: preemptions {_f(sv['preemptions'], '.0f')}; spec-decode acceptance "
             f"{_f(sv['spec_decode_acceptance_rate'], '.1%')}; aborts counted by the server "
             f"{_f(sv['aborts_counted_by_server'], '.0f')} (abandoned by the client: {sv['aborted_streams_client']})")
    st = c["session_time"]
    L.append(f"{'-' * 4} Where the sessions' time went ({st['total_s']:.2f} s summed; queueing "
             f"{st['queueing_s']:.2f} s, {st['queue_source']})")
    for r in st["rows"]:
        L.append(f"  {r['label'][:50]:50}{_f(r['seconds'], '.2f'):>12}{_f(r['share'], '.1%'):>8}")
    d = c["drivers"]
    L.append(f"{'-' * 4} Cost by prompt length")
    L += _group_lines(d["prompt_length"])
    L.append(f"{'-' * 4} Cost by system-prompt length")
    L += _group_lines(d["system_prompt"]) if d["system_prompt"] else [f"  {d['system_prompt_note']}"]
    ss = d["sessions"]
    L.append(f"{'-' * 4} Cost by session: {ss['count']} sessions; machine s per session mean "
             f"{ss['machine_s_mean']:.3f}, p50 {ss['machine_s_p50']:.3f}, p90 {ss['machine_s_p90']:.3f}, max "
             f"{ss['machine_s_max']:.3f}" + (f" (${_f(ss['usd_mean'], '.6f')} mean)" if ss["usd_mean"] is not None
                                              else ""))
    L.append(f"  the {len(ss['top'])} costliest carry {_f(ss['top_share'], '.1%')}: "
             + ", ".join(f"{t['session_id']} {_f(t['share'], '.1%')}" for t in ss["top"]))
    L.append(f"{'-' * 4} What if (priced from this run's measured per-token costs)")
    for wi in c["what_if"]:
        L.append(f"* {wi['statement']}")
        L += [f"    = {a}" for a in wi["arithmetic"]]
        if wi["arithmetic"]:
            L.append("    assumes: " + "; ".join(wi["assumptions"]))
    a = c.get("api")
    if a:
        p = a["price"]
        L.append(f"{'-' * 4} Managed API at ${p['input_per_1m']:g} in / ${p['output_per_1m']:g} out / "
                 f"${p['cached_input_per_1m']:g} cached in, per 1M tokens")
        L.append(f"  API for the same tokens: ${a['api_usd']:.6f} = ${_f(a['api_usd_per_1m_output_tokens'], '.4f')} "
                 f"per 1M output tokens ({_f(a['input_per_output_token'], '.2f')} input tokens per output token)")
        L.append(f"  self-hosted: ${_f(a['self_host_usd_per_1m_output_tokens'], '.4f')} per 1M output tokens in "
                 f"this run; ${_f(a['self_host_usd_per_1m_output_tokens_at_capacity'], '.4f')} when busy at "
                 f"{_f(a['capacity_output_tok_s'], '.1f')} output tok/s")
        L.append(f"    (capacity: {a['capacity_source']})")
        u = a["break_even_utilisation"]
        if u is None:
            L.append("  break-even utilisation: n/a (needs --cost-per-hour and delivered output tokens)")
        elif u <= 1:
            L.append(f"  break-even: self-hosting is cheaper above {u:.1%} utilisation of that capacity")
        else:
            L.append(f"  break-even: never at this capacity: even fully busy, self-hosting costs {u:.2f}x the API")
    return "\n".join(L)


def _group_lines(rows: list[dict]) -> list[str]:
    out = [f"  {'bucket':14}{'requests':>9}{'prompt tok':>12}{'cached %':>9}{'output tok':>11}{'cost %':>8}"
           f"{'$ / 1M out':>12}"]
    for g in rows:
        out.append(f"  {g['bucket'][:14]:14}{g['requests']:>9}{g['prompt_tokens']:>12,.0f}"
                   f"{_f(_share(g['cached_tokens'], g['prompt_tokens']), '.1%'):>9}{g['output_tokens']:>11,.0f}"
                   f"{_f(g['share'], '.1%'):>8}{_f(g['usd_per_1m_output_tokens'], '.4f'):>12}")
    return out


# ---------------------------------------------------------------------------
# Two runs side by side (bench serve --compare)
# ---------------------------------------------------------------------------


def compare_cost_rows(a: dict, b: dict) -> list[tuple]:
    """The cost rows of ``bench serve --compare`` for two result dicts A and B, each a tuple
    ``(name, value_a, value_b, spec, better)`` as :class:`~pagedllm.benchmarks.compare.
    CompareRow` takes it: USD per 1M delivered output tokens; the share of prompt compute
    the prefix cache saved; the cost of abandoned streams and of retried attempts, in USD
    when both runs have ``--cost-per-hour``, else as their share of the run's machine time;
    the break-even utilisation against ``--api-price``. [] unless both carry a ``cost``
    section (:func:`analyze`); a row whose values are both missing is left out."""
    ca, cb = a.get("cost"), b.get("cost")
    if not ca or not cb:
        return []

    def money(c: dict) -> dict:
        return c.get("money") or {}

    def row(c: dict, key: str) -> dict:
        return next((r for r in c.get("rows") or [] if r.get("key") == key), {})

    in_usd = money(ca).get("run_usd") is not None and money(cb).get("run_usd") is not None

    def waste(c: dict, key: str) -> float | None:
        r = row(c, key)
        return r.get("usd") if in_usd else r.get("time_share")

    unit, spec = ("($)", ".4f") if in_usd else ("(share of run)", ".2%")
    rows = [
        ("$ per 1M output tokens", money(ca).get("usd_per_1m_output_tokens"),
         money(cb).get("usd_per_1m_output_tokens"), ".4f", "lower"),
        ("Prompt compute saved by prefix cache", (ca.get("prefix_cache") or {}).get("share_of_prompt_compute_saved"),
         (cb.get("prefix_cache") or {}).get("share_of_prompt_compute_saved"), ".2%", "higher"),
        (f"Cost of abandoned streams {unit}", waste(ca, "aborted"), waste(cb, "aborted"), spec, "lower"),
        (f"Cost of retries {unit}", waste(ca, "retried"), waste(cb, "retried"), spec, "lower"),
        ("Break-even utilisation vs API", (ca.get("api") or {}).get("break_even_utilisation"),
         (cb.get("api") or {}).get("break_even_utilisation"), ".1%", "lower"),
    ]
    return [r for r in rows if r[1] is not None or r[2] is not None]
