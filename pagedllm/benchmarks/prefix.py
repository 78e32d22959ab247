"""``pagedllm bench prefix``: a shared-prefix workload with prefix caching on and off in
one process: mean TTFT (first token − arrival) and total wall time of each, and their
ratio. All requests are submitted at once after a warm-up and a cache reset."""
from __future__ import annotations

import argparse
import time

import numpy as np
from pagedllm.entrypoints.cli import HelpFormatter

from .report import output_file, save_json
from .serve_options import positive_int


def register(subparsers: "argparse._SubParsersAction") -> None:
    from pagedllm.config import EngineArgs

    p = subparsers.add_parser("prefix", help="shared-prefix workload, prefix caching on vs off",
                              formatter_class=HelpFormatter)
    p.add_argument("--num-requests", type=positive_int, default=32)
    p.add_argument("--prefix-len", type=positive_int, default=1000)
    p.add_argument("--suffix-len", type=int, default=20)
    p.add_argument("--output-len", type=positive_int, default=32)
    p.add_argument("--modes", default="on,off", help="which runs, in order: on, off or both")
    p.add_argument("--output-json", default=None, type=output_file)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=prefix_main)


def shared_prefix_prompts(n: int, prefix_len: int, suffix_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``n`` token-id prompts: one shared random ``prefix_len`` prefix, then ``suffix_len``
    random ids each (ids from [100, vocab))."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(100, vocab, size=prefix_len).tolist()
    return [prefix + rng.integers(100, vocab, size=suffix_len).tolist() for _ in range(n)]


def run_once(args, prompts, caching: bool) -> dict:
    from pagedllm import LLM, SamplingParams
    from pagedllm.config import EngineArgs

    ea = EngineArgs.from_cli_args(args)
    ea.enable_prefix_caching = caching
    kwargs = {k: v for k, v in vars(ea).items() if k != "model"}
    llm = LLM(model=ea.model, **kwargs)
    llm.generate([[5, 6, 7, 8] * 8], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    llm.reset_prefix_cache()
    q0, h0 = llm.stats().prefix_cache_queries, llm.stats().prefix_cache_hits
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    total = time.perf_counter() - t
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    st = llm.stats()
    q, h = st.prefix_cache_queries - q0, st.prefix_cache_hits - h0
    llm.shutdown()
    return {"prefix_caching": caching, "mean_ttft_s": float(np.mean(ttfts)),
            "p50_ttft_s": float(np.median(ttfts)), "max_ttft_s": float(np.max(ttfts)),
            "total_s": total, "prefix_cache_hit_rate": h / q if q else 0.0,
            "output_token_ids": [o.outputs[0].token_ids for o in outs]}


def prefix_main(args) -> int:
    """Entry point of ``pagedllm bench prefix``; returns 0. Raises ``ValueError`` naming a bad flag."""
    from pagedllm.models.loader import load_arch_config
    from pagedllm.utils import default_model_path

    if args.suffix_len < 0:
        raise ValueError("--suffix-len must be >= 0")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in ("on", "off") for m in modes):
        raise ValueError("--modes must list 'on' and/or 'off'")
    arch = load_arch_config(args.model or default_model_path())
    prompts = shared_prefix_prompts(args.num_requests, args.prefix_len, args.suffix_len,
                                    arch.vocab_size, args.seed)
    runs = {m: run_once(args, prompts, m == "on") for m in modes}
    print(f"\nshared-prefix workload: {args.num_requests} requests x ({args.prefix_len} shared + "
          f"{args.suffix_len} distinct tokens), {args.output_len} output tokens")
    for m, r in runs.items():
        print(f"prefix caching {m:>3}: mean TTFT {r['mean_ttft_s']:.3f} s (p50 {r['p50_ttft_s']:.3f}, "
              f"max {r['max_ttft_s']:.3f}) | total {r['total_s']:.2f} s | hit rate "
              f"{100 * r['prefix_cache_hit_rate']:.1f}%")
    report = {k: v for k, v in vars(args).items() if k in
              ("num_requests", "prefix_len", "suffix_len", "output_len")}
    report["runs"] = {m: {k: v for k, v in r.items() if k != "output_token_ids"} for m, r in runs.items()}
    if len(runs) == 2:
        on, off = runs["on"], runs["off"]
        report["ttft_speedup"] = off["mean_ttft_s"] / on["mean_ttft_s"]
        report["total_speedup"] = off["total_s"] / on["total_s"]
        same = on["output_token_ids"] == off["output_token_ids"]
        report["identical_greedy_outputs"] = same
        print(f"mean TTFT {report['ttft_speedup']:.1f}x lower, total time {report['total_speedup']:.1f}x "
              f"lower with caching; greedy outputs identical: {same}")
    if args.output_json:
        save_json(report, args.output_json)
    return 0
