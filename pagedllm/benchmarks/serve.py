"""``pagedllm bench serve``: an asyncio load generator for any OpenAI-compatible
streaming server (pagedllm, vLLM, llama.cpp's server, ...), or one speaking the Responses or
Anthropic's Messages API; TTFT, ITL, TPOT and E2E as defined in
:mod:`~pagedllm.benchmarks.metrics`. Pieces: ``serve_options`` (flags, config),
``endpoints`` (each API's bodies and events), ``client`` (one request), ``runner``
(arrivals, concurrency), ``report``. Several ``--endpoint-type`` s run in turn, compared;
``compare`` (``--compare``: two servers, one table; one endpoint type)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pagedllm.entrypoints.cli import HelpFormatter
from typing import Any

from .compare import add_compare_arguments, compare_main
from .extras import require_bench_packages
from .report import format_comparison, format_report, save_json
from .runner import run_benchmark, run_comparison
from .serve_options import BenchError, add_serve_arguments, endpoint_kinds, prepare

__all__ = ["register", "serve_main"]


def register(subparsers: "argparse._SubParsersAction") -> None:
    p = subparsers.add_parser(
        "serve", help="load-test an OpenAI-compatible server (TTFT, TPOT, ITL, E2E, goodput)",
        description="Benchmark an OpenAI-compatible streaming server with a chosen dataset and load shape.",
        formatter_class=HelpFormatter)
    add_serve_arguments(p)
    add_compare_arguments(p)
    p.set_defaults(func=serve_main)


def serve_main(args: Any, tokenizer: Any = "load") -> int:
    """Entry point of ``pagedllm bench serve``: 0 ok, 2 bad options, 1 could not run.
    ``tokenizer="load"`` loads ``--tokenizer``; tests pass an object (or None). With several
    endpoint types, each run's table (not with ``--quiet``), then the comparison; the saved
    JSON is the comparison document and plots go to ``--plot DIR/<endpoint type>``."""
    try:
        require_bench_packages("aiohttp", *(["matplotlib"] if args.plot else []), purpose="bench serve")
        cfg, dataset, tokens = prepare(args, tokenizer, several_endpoints=True)
    except (BenchError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    kinds = endpoint_kinds(args)
    if any(getattr(args, k, None) not in (None, 1) for k in ("compare", "compare_args", "compare_model", "labels",
                                                              "compare_rounds")):
        if len(kinds) > 1:
            print(f"error: --compare / --compare-args compare two servers on one endpoint type; --endpoint-type "
                  f"lists {len(kinds)} ({','.join(kinds)}): run the comparison once per endpoint type",
                  file=sys.stderr)
            return 2
        return compare_main(args, cfg, dataset, tokens)
    try:
        if len(kinds) > 1:
            doc = asyncio.run(run_comparison(cfg, dataset, kinds, tokens))
            runs = doc["runs"]
        else:
            doc = asyncio.run(run_benchmark(cfg, dataset, tokens))
            runs = [doc]
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if len(kinds) == 1 or not cfg.quiet:
        for res in runs:
            print(format_report(res))
    if len(kinds) > 1:
        print(format_comparison(doc))
    if args.save_result:
        save_json(doc, args.save_result)
        if not cfg.quiet:
            print(f"saved {args.save_result}", file=sys.stderr)
    if args.plot:
        from .plots import plot_serve_result

        for res in runs:
            out_dir = args.plot if len(runs) == 1 else os.path.join(args.plot, res["config"]["endpoint_kind"])
            for path in plot_serve_result(res, out_dir):
                if not cfg.quiet:
                    print(f"wrote {path}", file=sys.stderr)
    return 0
