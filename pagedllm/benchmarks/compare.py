"""``bench serve --compare``: one workload against two servers, A and B: ``--base-url``
and ``--compare URL`` (running servers), or two ``pagedllm serve`` started here from
``--compare-args='FLAGS_A' --compare-args='FLAGS_B'`` (both up the whole run).

The same dataset, seed and abandoned-stream draws on both sides. ``--compare-rounds N``
alternates, A then B in odd rounds and B then A in even ones, so that drift falls on both;
a side's requests are pooled over its rounds (throughputs over the sum of its own run
times; server metrics from before its first round to after its last). One table
(:func:`compare_rows`): throughput, TTFT p50/p99, TPOT p50, E2E p50, error / retry /
abandoned rates, prefix-cache hit rate, the cost module's rows (:func:`cost_rows`); B/A
and the better side per row. ``--plot`` adds ``compare.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import importlib
import shlex
import sys
from typing import Any, NamedTuple, Sequence

from .datasets import Dataset, TokenSource
from .report import build_result, fmt_value, save_json
from .runner import LoadRun, run_load
from .serve_options import BenchConfig, BenchError, positive_int

__all__ = ["CompareRow", "add_compare_arguments", "check_compare_args", "latency_rows", "cost_rows",
           "compare_rows", "format_compare", "pool_runs", "run_compare", "compare_main"]

#: ``pagedllm serve`` flags that ``--compare-args`` may not set (the bench chooses them).
_RESERVED = {"--port", "--host", "--api-key", "--headless"}


class CompareRow(NamedTuple):
    """One row of the comparison: ``name`` (with its unit), the values of A and B (None:
    n/a), ``spec`` their format, ``better`` "higher", "lower" or None (not a merit)."""

    name: str
    a: float | int | None
    b: float | int | None
    spec: str = ".2f"
    better: str | None = None

    def ratio(self) -> float | None:
        """B / A, or None when either is missing or A is 0."""
        if self.a is None or self.b is None or not self.a:
            return None
        return self.b / self.a

    def winner(self) -> str | None:
        """"A", "B", "same", or None (no merit or a value missing)."""
        if self.better is None or self.a is None or self.b is None:
            return None
        if self.a == self.b:
            return "same"
        return "A" if (self.a > self.b) == (self.better == "higher") else "B"


def add_compare_arguments(p: Any) -> None:
    """Register ``--compare``, ``--compare-model``, ``--compare-args``, ``--compare-rounds``
    and ``--labels`` on ``bench serve``'s parser ``p``."""
    g = p.add_argument_group("compare (two servers, one table)")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--compare", default=None, metavar="URL_B",
                   help="also run the workload against this server (B; A is --base-url)")
    x.add_argument("--compare-args", action="append", default=None, metavar="FLAGS",
                   help="twice, --compare-args='FLAGS_A' --compare-args='FLAGS_B' (the = form: the value "
                        "starts with --): start 'pagedllm serve FLAGS_A' and 'pagedllm serve FLAGS_B' here and "
                        "compare them (e.g. --compare-args='' --compare-args='--no-enable-prefix-caching'), each "
                        "on 127.0.0.1 at a free port the system picks; --base-url is not used")
    g.add_argument("--compare-model", default=None, help="model name on the --compare server (default --model)")
    g.add_argument("--compare-rounds", type=positive_int, default=1,
                   help="rounds of A and B in turns (A,B then B,A ...); each side pools its rounds")
    g.add_argument("--labels", default=None, metavar="A,B", help="names of the two sides in the table")


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message):  # argparse exits; a bad --compare-args is a ValueError
        raise ValueError(message)


def check_compare_args(flags: str) -> list[str]:
    """``flags`` (one ``--compare-args`` value) split as a shell would and checked against
    ``pagedllm serve``'s parser. Raises ``ValueError`` naming ``--compare-args``: bad
    quoting, an unknown flag or value, or a flag the bench sets (``_RESERVED``)."""
    from pagedllm.entrypoints.cli import register

    try:
        words = shlex.split(flags)
    except ValueError as e:
        raise ValueError(f"--compare-args {flags!r}: {e}") from None
    for w in words:
        if w.split("=", 1)[0] in _RESERVED:
            raise ValueError(f"--compare-args {flags!r}: {w.split('=', 1)[0]} is set by the bench")
    root = _RaisingParser(prog="pagedllm", add_help=False)
    register(root.add_subparsers(dest="command", parser_class=_RaisingParser))
    try:
        root.parse_args(["serve", *words])
    except ValueError as e:
        raise ValueError(f"--compare-args {flags!r}: {e}") from None
    return words


# ---------------------------------------------------------------------------
# Rows and table
# ---------------------------------------------------------------------------


def latency_rows(a: dict, b: dict) -> list[CompareRow]:
    """Rows from two ``bench serve`` result dicts (``build_result``): the throughput,
    latency and rate figures of their ``summary`` and ``server_metrics``."""
    sa, sb = a["summary"], b["summary"]

    def both(f) -> tuple:
        return f(sa), f(sb)

    rows = [
        CompareRow("Requests completed", *both(lambda s: s["completed"]), "d"),
        CompareRow("Request throughput (req/s)", *both(lambda s: s["request_throughput"]), ".2f", "higher"),
        CompareRow("Output token throughput (tok/s)", *both(lambda s: s["output_token_throughput"]), ".1f",
                   "higher"),
        CompareRow("TTFT p50 (ms)", *both(lambda s: s["ttft_ms"]["median"]), ".1f", "lower"),
        CompareRow("TTFT p99 (ms)", *both(lambda s: s["ttft_ms"]["p99"]), ".1f", "lower"),
        CompareRow("TPOT p50 (ms)", *both(lambda s: s["tpot_ms"]["median"]), ".2f", "lower"),
        CompareRow("E2E p50 (ms)", *both(lambda s: s["e2e_ms"]["median"]), ".1f", "lower"),
        CompareRow("Error rate", *both(lambda s: s["error_rate"]), ".2%", "lower"),
        CompareRow("Retry rate", *both(lambda s: s["retry_rate"]), ".2%", "lower"),
        CompareRow("Abandoned-stream rate", *both(lambda s: s.get("abort_rate")), ".2%"),
        CompareRow("Prefix cache hit rate (server)", a["server_metrics"].get("prefix_cache_hit_rate"),
                   b["server_metrics"].get("prefix_cache_hit_rate"), ".2%"),
    ]
    if sa.get("goodput") is not None or sb.get("goodput") is not None:
        rows.insert(3, CompareRow("Goodput (req/s)", *both(lambda s: s.get("goodput")), ".2f", "higher"))
    return rows


def cost_rows(a: dict, b: dict) -> list[CompareRow]:
    """The cost module's rows for two result dicts: ``pagedllm.benchmarks.cost.
    compare_cost_rows(a, b)``, each a :class:`CompareRow` or a tuple of its fields; [] while
    that module or function does not exist (an error inside it propagates)."""
    name = f"{__package__}.cost"
    try:
        cost = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
        return []
    fn = getattr(cost, "compare_cost_rows", None)
    return [] if fn is None else [r if isinstance(r, CompareRow) else CompareRow(*r) for r in fn(a, b)]


def compare_rows(a: dict, b: dict) -> list[CompareRow]:
    """All rows of the table: :func:`latency_rows` then :func:`cost_rows`."""
    return latency_rows(a, b) + cost_rows(a, b)


def format_compare(rows: Sequence[CompareRow], labels: Sequence[str], rounds: int = 1) -> str:
    """Text table under a line naming A and B (``labels``): metric, A, B, B/A, better
    ("A", "B", "same" or blank)."""
    la, lb = labels
    w = max(len(r.name) for r in rows)
    vw = 12
    head = f"{'':<{w}}  {'A':>{vw}}  {'B':>{vw}}  {'B/A':>7}  better"
    lines = [f"A = {la}; B = {lb}" + (f"; {rounds} rounds, A and B in turns" if rounds > 1 else ""), head,
             "-" * len(head)]
    for r in rows:
        ratio = r.ratio()
        lines.append(f"{r.name:<{w}}  {fmt_value(r.a, r.spec):>{vw}}  {fmt_value(r.b, r.spec):>{vw}}  "
                     f"{fmt_value(ratio, '.2f') + 'x' if ratio is not None else 'n/a':>7}  {r.winner() or ''}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------


def pool_runs(runs: Sequence[LoadRun]) -> LoadRun:
    """One side's rounds as one run: requests renumbered in order; each later round's times
    moved back by the gap since the previous round's end (the other side's turn), so that
    the rounds sit end to end from the first round's start and ``t_end - t0`` equals
    ``measured_s``, the sum of the rounds' own durations (what the cost attribution and the
    timeline read); server metrics from before the first to after the last. Raises
    ``ValueError`` on no runs."""
    if not runs:
        raise ValueError("no runs to pool")
    results = []
    end = runs[0].t0
    for run in runs:
        off = len(results)
        gap = run.t0 - end
        for r in run.results:
            r.request_id += off
            if gap:
                r.scheduled_time -= gap
                r.start_time -= gap
                r.end_time -= gap
                if r.first_token_time is not None:
                    r.first_token_time -= gap
        results += run.results
        end = run.t_end - gap
    first, last = runs[0], runs[-1]
    return LoadRun(results, first.num_warmups, first.t0, end, first.wall0, first.metrics_before,
                   last.metrics_after, first.endpoint_kind, first.num_prompts,
                   measured_s=sum(r.t_end - r.t0 for r in runs))


async def run_compare(cfgs: Sequence[BenchConfig], dataset: Dataset, tokens: TokenSource | None,
                      rounds: int = 1) -> list[dict]:
    """Run ``dataset`` with each of the two configs (their ``base_url``, ``model``,
    ``label``) ``rounds`` times in turns (module doc); warm-ups in each side's first round
    only. Returns the two pooled result dicts (``build_result``). Raises as ``run_load``."""
    tokens = tokens or TokenSource(None)
    cfgs = [dataclasses.replace(c) for c in cfgs]
    runs: list[list[LoadRun]] = [[], []]
    for r in range(rounds):
        for j in ((0, 1) if r % 2 == 0 else (1, 0)):
            c = dataclasses.replace(cfgs[j], num_warmups=cfgs[j].num_warmups if r == 0 else 0,
                                    progress_desc=f"[{cfgs[j].label}]" + (f" round {r + 1}/{rounds}" if rounds > 1
                                                                          else ""))
            gc.collect()
            gc.freeze()  # as run_benchmark does
            try:
                runs[j].append(await run_load(c, dataset, tokens))
            finally:
                gc.unfreeze()
            cfgs[j].model = c.model
    return [build_result(cfgs[j], dataset, tokens, pool_runs(runs[j])) for j in (0, 1)]


def compare_main(args: Any, cfg: BenchConfig, dataset: Dataset, tokens: TokenSource) -> int:
    """``bench serve`` with ``--compare`` or ``--compare-args``: 0 ok, 2 bad options, 1 a
    server would not start or a run could not be set up."""
    try:
        if args.compare is not None and not args.compare.startswith(("http://", "https://")):
            raise ValueError(f"--compare must be a URL starting with http:// or https://, got {args.compare!r}")
        if args.compare_model and not args.compare:
            raise ValueError("--compare-model goes with --compare (the second server's model name)")
        if not args.compare and not args.compare_args:
            raise ValueError("--labels and --compare-rounds go with --compare or --compare-args")
        if args.compare_args is not None and len(args.compare_args) != 2:
            raise ValueError(f"--compare-args: give it twice, once per server (A, then B); got "
                             f"{len(args.compare_args)}")
        flags = [check_compare_args(f) for f in args.compare_args] if args.compare_args else None
        labels = [x.strip() for x in args.labels.split(",")] if args.labels else None
        if labels is not None and (len(labels) != 2 or not all(labels)):
            raise ValueError(f"--labels: give two names, A,B; got {args.labels!r}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from pagedllm.utils import stop_process

    from .server import start_server

    procs = []
    try:
        if flags is not None:
            urls, models = [], [cfg.model, cfg.model]
            for words in flags:
                if not cfg.quiet:
                    print(f"starting: pagedllm serve {shlex.join(words)}", file=sys.stderr, flush=True)
                proc, url = start_server(words)
                procs.append(proc)
                urls.append(url)
            labels = labels or [f"pagedllm serve {shlex.join(f)}".strip() for f in flags]
        else:
            urls, models = [cfg.base_url, args.compare], [cfg.model, args.compare_model or cfg.model]
            labels = labels or [cfg.base_url, args.compare]
        cfgs = [dataclasses.replace(cfg, base_url=u, model=m, label=lab) for u, m, lab in zip(urls, models, labels)]
        res = asyncio.run(run_compare(cfgs, dataset, tokens, args.compare_rounds))
    except (BenchError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        for p in procs:
            stop_process(p, 60)
    rows = compare_rows(res[0], res[1])
    print(format_compare(rows, labels, args.compare_rounds))
    if args.save_result:
        save_json({"tool": "pagedllm bench serve --compare", "labels": labels, "rounds": args.compare_rounds,
                   "server_flags": flags, "rows": [r._asdict() | {"ratio": r.ratio(), "winner": r.winner()}
                                                   for r in rows],
                   "results": res}, args.save_result)
        if not cfg.quiet:
            print(f"saved {args.save_result}", file=sys.stderr)
    if args.plot:
        from .plots import plot_compare

        path = plot_compare(rows, labels, args.plot)
        if not cfg.quiet:
            print(f"wrote {path}", file=sys.stderr)
    return 0
