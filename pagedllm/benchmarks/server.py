"""``pagedllm bench server``: what serving over HTTP costs against the offline engine,
with the engine core in its own process and in the server's (``--no-engine-process``), in
one run: per mode and ``--concurrency``, output tokens/s and its ratio to offline, TTFT
and TPOT medians, and /health p50/p99 (ms) under load. Method: docs/notes/benchmarks.md.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import socket
import statistics
import subprocess
import sys
import time

from pagedllm.utils import stop_process
from pagedllm.entrypoints.cli import HelpFormatter

from .report import output_file, save_json
from .serve_options import positive_int

MODES = ("process", "inprocess")


def register(subparsers: "argparse._SubParsersAction") -> None:
    from pagedllm.config import EngineArgs

    p = subparsers.add_parser(
        "server", help="the HTTP server vs the offline engine, engine core in its own process or not",
        formatter_class=HelpFormatter)
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                   help="process: the engine core in its own process; inprocess: --no-engine-process")
    p.add_argument("--concurrency", nargs="+", type=positive_int, default=[1, 8, 32, 64])
    p.add_argument("--num-prompts", type=positive_int, default=64)
    p.add_argument("--input-len", type=positive_int, default=200)
    p.add_argument("--output-len", type=positive_int, default=128)
    p.add_argument("--health-interval", type=float, default=0.05, help="seconds between /health probes")
    p.add_argument("--no-offline", action="store_true", help="skip the offline LLM run")
    p.add_argument("--output-json", default=None, type=output_file)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=server_main)


def engine_cli_args(ea) -> list[str]:
    """The ``pagedllm serve`` flags that reproduce EngineArgs ``ea`` (those off their default)."""
    from pagedllm.config import EngineArgs

    default = EngineArgs()
    out: list[str] = []
    for f in dataclasses.fields(EngineArgs):
        v, d = getattr(ea, f.name), getattr(default, f.name)
        if v == d or f.name == "engine_process":
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(v, bool):
            out.append(flag if v else "--no-" + f.name.replace("_", "-"))
        elif v is not None:
            out += [flag, json.dumps(v) if isinstance(v, dict) else str(v)]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(engine_flags: list[str], engine_process: bool | None = None) -> tuple[subprocess.Popen, str]:
    """Start ``pagedllm serve`` with ``engine_flags`` on a free local port and wait (up to
    600 s) until /health answers; returns (process, root URL). ``engine_process`` None
    leaves ``--[no-]engine-process`` to the flags. The caller stops it (``stop_process``).

    Raises:
        RuntimeError: the server exited while starting, or did not start in time.
    """
    import httpx

    port = _free_port()
    mode = [] if engine_process is None else ["--engine-process" if engine_process else "--no-engine-process"]
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "--log-level", "WARNING", "serve", "--port",
           str(port), *engine_flags, *mode]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited while starting (status {proc.returncode})")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_process(proc, 10)
    raise RuntimeError("the server did not start in 600 s")


async def _probe_health(url: str, interval: float, stop: asyncio.Event) -> list[float]:
    """Latencies (s) of GET /health, one every ``interval`` s until ``stop`` is set."""
    import httpx

    lat = []
    async with httpx.AsyncClient(timeout=30) as c:
        while not stop.is_set():
            t = time.perf_counter()
            await c.get(f"{url}/health")
            lat.append(time.perf_counter() - t)
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except asyncio.TimeoutError:
                pass
    return lat


def _serve_args(url: str, args, n: int, c: int):
    from .serve_options import add_serve_arguments

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return p.parse_args(["--base-url", url, "--dataset", "random", "--input-len", str(args.input_len),
                         "--output-len", str(args.output_len), "--num-prompts", str(n),
                         "--max-concurrency", str(c), "--ignore-eos", "--quiet", "--seed", "0",
                         "--endpoint-type", "completions"])


async def _one_load(url: str, args, n: int, c: int, tok) -> dict:
    from .runner import run_benchmark
    from .serve_options import prepare

    cfg, dataset, tokens = prepare(_serve_args(url, args, n, c), tok)
    stop = asyncio.Event()
    probe = asyncio.ensure_future(_probe_health(url, args.health_interval, stop))
    try:
        res = await run_benchmark(cfg, dataset, tokens)
    finally:
        stop.set()
        health = await probe
    s = res["summary"]
    hs = sorted(health)
    return {"concurrency": c, "num_prompts": n, "output_tok_s": s["output_token_throughput"],
            "ttft_p50_ms": s["ttft_ms"]["median"], "tpot_p50_ms": s["tpot_ms"]["median"],
            "failed": s["failed"], "health_n": len(hs),
            "health_p50_ms": 1000 * statistics.median(hs) if hs else None,
            "health_p99_ms": 1000 * hs[min(len(hs) - 1, int(0.99 * len(hs)))] if hs else None}


def _prompts(args, n: int, tok) -> list[list[int]]:
    """The token ids ``bench serve``'s random dataset sends for ``n`` requests (same seed)."""
    import itertools

    from .serve_options import prepare

    cfg, dataset, _ = prepare(_serve_args("http://unused", args, n, n), tok, validate=False)
    return [s.turns[0].prompt for s in itertools.islice(dataset.sessions(cfg.seed), n)]


def server_main(args) -> int:
    """Entry point of ``pagedllm bench server``; returns 0.

    Raises:
        MissingBenchPackageError (a ValueError): aiohttp is not installed.
    """
    from pagedllm.benchmarks.machine import machine_info
    from pagedllm.config import EngineArgs

    from .extras import require_bench_packages

    require_bench_packages("aiohttp", purpose="bench server")
    ea = EngineArgs.from_cli_args(args)
    flags = engine_cli_args(ea)
    from .serve_options import load_tokenizer

    tok = load_tokenizer(None)
    sizes = {c: min(args.num_prompts, max(8, 2 * c)) for c in args.concurrency}
    result = {"machine": machine_info(), "engine_flags": flags, "runs": {}, "offline": None}
    print(f"machine: {result['machine']['cpu']}; engine flags: {' '.join(flags) or '(defaults)'}", flush=True)
    for mode in args.modes:
        proc, url = start_server(flags, engine_process=(mode == "process"))
        try:
            rows = []
            for c in args.concurrency:
                row = asyncio.run(_one_load(url, args, sizes[c], c, tok))
                rows.append(row)
                print(f"{mode:9s} c={c:3d} n={row['num_prompts']:3d}: {row['output_tok_s']:.1f} out tok/s, "
                      f"TTFT p50 {row['ttft_p50_ms']:.0f} ms, TPOT p50 {row['tpot_p50_ms']:.1f} ms, /health p50 "
                      f"{row['health_p50_ms']:.1f} / p99 {row['health_p99_ms']:.1f} ms ({row['health_n']} probes), "
                      f"failed {row['failed']}", flush=True)
            result["runs"][mode] = rows
        finally:
            stop_process(proc, 60)
    if not args.no_offline:
        from pagedllm import LLM, SamplingParams

        n = sizes[max(args.concurrency)]
        prompts = _prompts(args, n, tok)
        llm = LLM(**{k: v for k, v in vars(ea).items() if k != "model"}, model=ea.model)
        try:
            sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
            llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], sp, use_tqdm=False)   # warm-up
            t = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
            wall = time.perf_counter() - t
        finally:
            llm.shutdown()
        out_tok = sum(len(o.outputs[0].token_ids) for o in outs)
        result["offline"] = {"num_prompts": n, "output_tok_s": out_tok / wall, "wall_s": wall}
        print(f"offline LLM, {n} prompts at once: {out_tok / wall:.1f} out tok/s", flush=True)
    _print_table(result)
    if args.output_json:
        save_json(result, args.output_json)
    return 0


def _print_table(result: dict) -> None:
    off = (result["offline"] or {}).get("output_tok_s")
    print("\n| mode | concurrency | requests | out tok/s | vs offline | TTFT p50 ms | TPOT p50 ms | /health p50 / p99 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, rows in result["runs"].items():
        for r in rows:
            ratio = f"{r['output_tok_s'] / off:.2f}x" if off else "-"
            print(f"| {mode} | {r['concurrency']} | {r['num_prompts']} | {r['output_tok_s']:.1f} | {ratio} | "
                  f"{r['ttft_p50_ms']:.0f} | {r['tpot_p50_ms']:.1f} | {r['health_p50_ms']:.1f} / "
                  f"{r['health_p99_ms']:.1f} |")
    if off:
        print(f"| offline LLM | all at once | {result['offline']['num_prompts']} | {off:.1f} | 1.00x | | | |")
    print(os.linesep.join(["", f"machine: {result['machine']['cpu']}, {result['machine']['cores']} cores"]))
