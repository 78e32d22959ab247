"""``pagedllm profile summarize DIR``: where the engine's time went, from what
``--profile-dir DIR`` writes: ``steps.jsonl`` (one
:class:`~pagedllm.core.step_profiler.StepRecord` per step; its per-step preemptions are
summed) and optionally ``trace.json`` (a torch.profiler chrome trace: complete events by
name, total = sum of ``dur`` in us, self = total minus nested events on the same track).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from typing import Any, Sequence

import msgspec
import numpy as np

from pagedllm.core.step_profiler import STEP_DECODER, StepRecord

from .metrics import latency_stats
from .report import fmt_value

__all__ = ["load_steps", "split_runs", "summarize_steps", "summarize_trace", "summarize_profile_dir",
           "format_profile_summary", "add_summarize_arguments", "summarize_main", "register", "ProfileError"]


class ProfileError(ValueError):
    """A profile directory or file is missing or malformed (message names the file and line)."""


def load_steps(path: str) -> list[StepRecord]:
    """Decode ``steps.jsonl`` into :class:`StepRecord` s (blank lines skipped). Raises
    ``ProfileError`` naming the file, line and any missing or mistyped field."""
    steps = []
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                steps.append(STEP_DECODER.decode(line))
            except msgspec.ValidationError as e:
                raise ProfileError(f"{path}, line {lineno}: not a step record: {e}") from None
            except msgspec.DecodeError as e:
                raise ProfileError(f"{path}, line {lineno}: invalid JSON: {e}") from None
    return steps


def summarize_steps(steps: Sequence[StepRecord]) -> dict:
    """Aggregate step records: times in ``*_s`` / ``*_ms`` (``step_time_ms`` as
    :func:`~pagedllm.benchmarks.metrics.latency_stats`), shares of total step time. Prefill
    steps have any prefill token; decode-only steps have none."""
    n = len(steps)
    out: dict[str, Any] = {"num_steps": n}
    if n == 0:
        return out

    def col(name: str) -> np.ndarray:
        return np.array([getattr(s, name) for s in steps], dtype=float)

    st = col("step_time_s")
    sched, exe, upd = col("schedule_time_s"), col("execute_time_s"), col("update_time_s")
    pre, dec, reqs = col("num_prefill_tokens"), col("num_decode_tokens"), col("num_reqs")
    total = float(st.sum())
    first, last = min(steps, key=lambda s: s.ts), max(steps, key=lambda s: s.ts)
    out.update({
        "total_step_time_s": total,
        # first step's start to last step's end (the engine stamps ts when a step ends)
        "wall_span_s": last.ts - first.ts + first.step_time_s,
        "step_time_ms": latency_stats(st, (50.0, 90.0, 99.0)),
    })

    def share(x: np.ndarray) -> float | None:
        return float(x.sum() / total) if total > 0 else None

    out["time_share"] = {
        "schedule": share(sched),
        "execute": share(exe),
        "update": share(upd),
        "other": (1.0 - float((sched.sum() + exe.sum() + upd.sum()) / total)) if total > 0 else None,
    }
    tp, td = float(pre.sum()), float(dec.sum())
    out["tokens"] = {
        "prefill": int(tp),
        "decode": int(td),
        "prefill_share": tp / (tp + td) if tp + td > 0 else None,
        "decode_share": td / (tp + td) if tp + td > 0 else None,
        "per_second": (tp + td) / total if total > 0 else None,
    }
    has_pre = pre > 0
    dec_only = (~has_pre) & (dec > 0)
    idle = (~has_pre) & (dec == 0)

    def group(mask: np.ndarray) -> dict:
        k = int(mask.sum())
        t = float(st[mask].sum())
        return {"steps": k, "time_s": t, "time_share": (t / total) if total > 0 else None,
                "mean_step_ms": (t / k * 1e3) if k else None}

    out["split"] = {"prefill_steps": group(has_pre), "decode_only_steps": group(dec_only), "idle_steps": group(idle)}
    busy = reqs > 0
    out["batch"] = {
        "mean_num_reqs": float(reqs[busy].mean()) if busy.any() else 0.0,
        "max_num_reqs": int(reqs.max()),
        "mean_decode_tokens_per_decode_step": float(dec[dec_only].mean()) if dec_only.any() else None,
        "mean_running": float(col("num_running").mean()),
        "max_waiting": int(col("num_waiting").max()),
    }
    used = [s.kv_blocks_used for s in steps]
    tot = [s.kv_blocks_total for s in steps]
    peak_i = int(np.argmax(used))
    out["kv_cache"] = {
        "peak_blocks_used": int(used[peak_i]),
        "blocks_total": int(max(tot)) if tot else None,
        "peak_usage": (used[peak_i] / tot[peak_i]) if tot[peak_i] > 0 else None,
        "mean_usage": float(np.mean([u / t for u, t in zip(used, tot) if t > 0])) if any(t > 0 for t in tot) else None,
    }
    out["preemptions"] = int(sum(s.num_preemptions for s in steps))
    return out


def _self_times(events: list[dict]) -> list[float]:
    """Self time (us) of each event: its ``dur`` minus its direct children's on the same track."""
    self_t = [float(e.get("dur", 0.0)) for e in events]
    tracks: dict[tuple, list[int]] = defaultdict(list)
    for i, e in enumerate(events):
        tracks[(e.get("pid"), e.get("tid"))].append(i)
    for idx in tracks.values():
        # Parents first: by start, then longer first.
        idx.sort(key=lambda i: (float(events[i].get("ts", 0.0)), -float(events[i].get("dur", 0.0))))
        stack: list[tuple[int, float]] = []  # (event index, end time)
        for i in idx:
            t0 = float(events[i].get("ts", 0.0))
            t1 = t0 + float(events[i].get("dur", 0.0))
            while stack and stack[-1][1] <= t0:
                stack.pop()
            if stack and t1 <= stack[-1][1] + 1e-6:
                parent = stack[-1][0]
                self_t[parent] -= float(events[i].get("dur", 0.0))
            stack.append((i, t1))
    return [max(0.0, s) for s in self_t]


_IGNORED_CATEGORIES = {"Trace"}


def summarize_trace(path: str, top: int = 15) -> dict:
    """Top ops of a chrome trace by self time (skipping the profiler's "Trace" span):
    ``{"num_events", "total_self_ms", "by_category", "top_ops"}``, each op with ``name``,
    ``category``, ``count``, ``self_ms``, ``total_ms``, ``self_share`` (of its category).
    Raises ``ProfileError`` for unreadable JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ProfileError(f"{path}: cannot read chrome trace: {e}") from None
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ProfileError(f"{path}: no traceEvents list")
    # The "Trace" category holds torch.profiler's own span over the whole window.
    xs = [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "dur" in e
          and e.get("cat") not in _IGNORED_CATEGORIES]
    selfs = _self_times(xs)
    agg: dict[tuple[str, str], list[float]] = {}
    cat_tot: dict[str, float] = defaultdict(float)
    for e, s in zip(xs, selfs):
        key = (str(e.get("name", "?")), str(e.get("cat", "")))
        a = agg.setdefault(key, [0, 0.0, 0.0])
        a[0] += 1
        a[1] += s
        a[2] += float(e.get("dur", 0.0))
        cat_tot[key[1]] += s
    ops = [
        {"name": n, "category": c, "count": int(v[0]), "self_ms": v[1] / 1e3, "total_ms": v[2] / 1e3,
         "self_share": (v[1] / cat_tot[c]) if cat_tot[c] > 0 else None}
        for (n, c), v in agg.items()
    ]
    ops.sort(key=lambda o: -o["self_ms"])
    return {
        "num_events": len(xs),
        "total_self_ms": sum(cat_tot.values()) / 1e3,
        "by_category": {c: t / 1e3 for c, t in sorted(cat_tot.items(), key=lambda kv: -kv[1])},
        "top_ops": ops[:top],
    }


def split_runs(steps: Sequence[StepRecord]) -> list[list[StepRecord]]:
    """Split an appended step log into runs: a new run starts where ``step`` does not increase."""
    runs: list[list[StepRecord]] = []
    prev = None
    for s in steps:
        if not runs or (prev is not None and s.step <= prev):
            runs.append([])
        runs[-1].append(s)
        prev = s.step
    return runs


def summarize_profile_dir(d: str, top: int = 15, last_run: bool = False) -> dict:
    """``steps`` (or None) and ``trace`` (or None) of a profile directory; ``num_runs`` counts
    the runs appended to ``steps.jsonl``, ``last_run=True`` keeps the last. Raises
    ``ProfileError`` when ``d`` is not a directory or holds neither file."""
    if not os.path.isdir(d):
        raise ProfileError(f"profile directory not found: {d}")
    sp, tp = os.path.join(d, "steps.jsonl"), os.path.join(d, "trace.json")
    if not os.path.exists(sp) and not os.path.exists(tp):
        raise ProfileError(f"{d} holds neither steps.jsonl nor trace.json")
    steps = None
    if os.path.exists(sp):
        all_steps = load_steps(sp)
        runs = split_runs(all_steps)
        steps = summarize_steps(runs[-1] if (last_run and runs) else all_steps)
        steps["num_runs"] = len(runs)
        steps["only_last_run"] = bool(last_run)
    return {
        "dir": d,
        "steps": steps,
        "trace": summarize_trace(tp, top) if os.path.exists(tp) else None,
    }


def format_profile_summary(s: dict) -> str:
    """Text report of ``summarize_profile_dir``."""
    fv = fmt_value
    L: list[str] = [f"Profile: {s['dir']}"]
    st = s.get("steps")
    if st is None:
        L.append("steps.jsonl: absent")
    elif st["num_steps"] == 0:
        L.append("steps.jsonl: no steps")
    else:
        t = st["step_time_ms"]
        runs = st.get("num_runs", 1)
        if runs > 1:
            L.append(f"steps.jsonl holds {runs} runs; "
                     + ("showing the last" if st.get("only_last_run") else "showing all (see --last-run)"))
        L.append(f"Steps: {st['num_steps']}, total step time {st['total_step_time_s']:.3f} s"
                 f" (wall span {fv(st['wall_span_s'], '.3f')} s)")
        L.append(f"Step time ms: mean {t['mean']:.2f}  p50 {t['p50']:.2f}  p90 {t['p90']:.2f}"
                 f"  p99 {t['p99']:.2f}  max {t['max']:.2f}")
        sh = st["time_share"]
        L.append(f"Time share: schedule {fv(sh['schedule'], '.1%')}  execute {fv(sh['execute'], '.1%')}"
                 f"  update {fv(sh['update'], '.1%')}  other {fv(sh['other'], '.1%')}")
        tk = st["tokens"]
        L.append(f"Tokens: prefill {tk['prefill']} ({fv(tk['prefill_share'], '.1%')}), decode {tk['decode']}"
                 f" ({fv(tk['decode_share'], '.1%')}), {fv(tk['per_second'], '.1f')} tok/s of step time")
        for key, name in (("prefill_steps", "Steps with prefill"), ("decode_only_steps", "Decode-only steps"),
                          ("idle_steps", "Steps without tokens")):
            g = st["split"][key]
            L.append(f"{name}: {g['steps']} steps, {g['time_s']:.3f} s ({fv(g['time_share'], '.1%')}),"
                     f" mean {fv(g['mean_step_ms'], '.2f')} ms")
        b = st["batch"]
        L.append(f"Batch: mean {b['mean_num_reqs']:.2f} requests/step (max {b['max_num_reqs']}),"
                 f" mean running {b['mean_running']:.2f}, max waiting {b['max_waiting']}")
        kv = st["kv_cache"]
        L.append(f"KV cache: peak {kv['peak_blocks_used']}/{kv['blocks_total']} blocks"
                 f" ({fv(kv['peak_usage'], '.1%')}), mean use {fv(kv['mean_usage'], '.1%')}")
        L.append(f"Preemptions: {st['preemptions']}")
    tr = s.get("trace")
    if tr is None:
        L.append("trace.json: absent")
    else:
        L.append(f"Trace: {tr['num_events']} events; self time by category: "
                 + ", ".join(f"{c or '-'} {ms:.3f} ms" for c, ms in list(tr["by_category"].items())[:6]))
        L.append(f"{'op':<48} {'category':<14} {'calls':>7} {'self ms':>10} {'share':>7} {'total ms':>10}")
        for o in tr["top_ops"]:
            L.append(f"{o['name'][:48]:<48} {o['category'][:14]:<14} {o['count']:>7} {o['self_ms']:>10.3f}"
                     f" {fv(o['self_share'], '.1%'):>7} {o['total_ms']:>10.3f}")
    return "\n".join(L)


def register(subparsers: "argparse._SubParsersAction") -> None:
    p = subparsers.add_parser(
        "summarize", help="summarize an engine profile directory (steps.jsonl, trace.json)",
        description="Print where the engine's time went, from a --profile-dir directory.")
    add_summarize_arguments(p)
    p.set_defaults(func=summarize_main)


def add_summarize_arguments(p: Any) -> None:
    p.add_argument("dir", metavar="DIR", help="directory written by --profile-dir")
    p.add_argument("--top", type=int, default=15, help="number of ops to list from trace.json")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--last-run", action="store_true",
                   help="only the last run of an appended steps.jsonl (step numbers restart per run)")


def summarize_main(args: Any) -> int:
    """Entry point of ``pagedllm profile summarize``; 0 ok, 1 bad/missing files, 2 bad flags."""
    if args.top < 1:
        print(f"error: --top must be >= 1, got {args.top}", file=sys.stderr)
        return 2
    try:
        s = summarize_profile_dir(args.dir, args.top, args.last_run)
    except ProfileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(s, indent=2) if args.json else format_profile_summary(s))
    return 0
