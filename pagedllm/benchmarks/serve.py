"""``pagedllm bench serve``: an asyncio load generator for any OpenAI-compatible
streaming server (pagedllm, vLLM, llama.cpp's server, ...); TTFT, ITL, TPOT and E2E as
defined in :mod:`~pagedllm.benchmarks.metrics`. Pieces: ``serve_options`` (flags,
config), ``client`` (one request), ``runner`` (arrivals, concurrency), ``report``;
``compare`` (two servers, one table)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pagedllm.entrypoints.cli import HelpFormatter
from typing import Any

from .compare import add_compare_arguments, compare_main
from .extras import require_bench_packages
from .report import format_report, save_json
from .runner import run_benchmark
from .serve_options import BenchError, add_serve_arguments, prepare

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
    ``tokenizer="load"`` loads ``--tokenizer``; tests pass an object (or None)."""
    try:
        require_bench_packages("aiohttp", *(["matplotlib"] if args.plot else []), purpose="bench serve")
        cfg, dataset, tokens = prepare(args, tokenizer)
    except (BenchError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if any(getattr(args, k, None) not in (None, 1) for k in ("compare", "compare_args", "compare_model", "labels",
                                                              "compare_rounds")):
        return compare_main(args, cfg, dataset, tokens)
    try:
        res = asyncio.run(run_benchmark(cfg, dataset, tokens))
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_report(res))
    if args.save_result:
        save_json(res, args.save_result)
        if not cfg.quiet:
            print(f"saved {args.save_result}", file=sys.stderr)
    if args.plot:
        from .plots import plot_serve_result

        for path in plot_serve_result(res, args.plot):
            if not cfg.quiet:
                print(f"wrote {path}", file=sys.stderr)
    return 0
