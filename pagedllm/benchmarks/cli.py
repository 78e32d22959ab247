"""Argparse wiring of the benchmark and profiling commands.

``pagedllm/entrypoints/cli.py`` calls :func:`register_bench_subcommands` on
its ``bench`` sub-parsers and :func:`register_profile_subcommands` on its
``profile`` sub-parsers. Each registered parser sets ``func``: a callable
taking the parsed ``argparse.Namespace`` and returning an exit code.

Standalone use (same parsers)::

    python -m pagedllm.benchmarks.cli bench serve --base-url http://127.0.0.1:8000 ...
    python -m pagedllm.benchmarks.cli bench sweep --concurrencies 1,2,4,8 --slo ttft:500 ...
    python -m pagedllm.benchmarks.cli profile summarize DIR
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

__all__ = ["register_bench_subcommands", "register_profile_subcommands", "build_parser", "main"]


def _summarize(args: argparse.Namespace) -> int:
    from .profile_summary import summarize_main

    return summarize_main(args)


def register_bench_subcommands(bench_subparsers: "argparse._SubParsersAction") -> None:
    """Add ``serve`` and ``sweep`` to the ``bench`` sub-parsers."""
    from . import serve, sweep

    serve.register(bench_subparsers)
    sweep.register(bench_subparsers)


def register_profile_subcommands(profile_subparsers: "argparse._SubParsersAction") -> None:
    """Add ``summarize`` to the ``profile`` sub-parsers."""
    from .profile_summary import add_summarize_arguments

    p = profile_subparsers.add_parser(
        "summarize", help="summarize an engine profile directory (steps.jsonl, trace.json)",
        description="Print where the engine's time went, from a --profile-dir directory.")
    add_summarize_arguments(p)
    p.set_defaults(func=_summarize)


def build_parser() -> argparse.ArgumentParser:
    """Standalone parser with ``bench {serve,sweep}`` and ``profile summarize``."""
    parser = argparse.ArgumentParser(prog="pagedllm")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="benchmarks")
    register_bench_subcommands(bench.add_subparsers(dest="bench_command", required=True))
    prof = sub.add_parser("profile", help="profiling tools")
    register_profile_subcommands(prof.add_subparsers(dest="profile_command", required=True))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen command; returns its exit code."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
