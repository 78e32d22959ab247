"""``pagedllm bench roofline``: decode step time against the memory roofline. It measures
the device's copy bandwidth (a device-to-device copy; bytes read + written over time,
best of a few), then for each batch size runs the engine in this process on random-token
prompts of ``--input-len`` and times the steady decode steps (``LLMEngine.step`` with a
device synchronize; every request of the batch decoding, no prefill in the step, the
first ``--warmup-steps`` dropped). Per batch: step ms, bytes read a step (weights +
each request's K/V over its context: ``decode_bytes``), roofline ms = bytes /
bandwidth, efficiency = roofline / step, tokens/s. ``--compare-eager`` runs CUDA graphs
on and off (``--enforce-eager``) in the same run. Dense models. Method: docs/notes/benchmarks.md.
"""
from __future__ import annotations

import argparse
import gc
import time

import numpy as np
import torch

from pagedllm.entrypoints.cli import HelpFormatter

from .report import output_file, save_json
from .serve_options import positive_int


def batch_list(text: str) -> list[int]:
    """Argparse type: comma-separated positive batch sizes ("1,16,64"), each once, in order.
    Raises ``ArgumentTypeError``."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive ints, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive ints, got {text!r}")
    return list(dict.fromkeys(sizes))


def register(subparsers: "argparse._SubParsersAction") -> None:
    from pagedllm.config import EngineArgs

    p = subparsers.add_parser("roofline", help="decode step time against weight + KV bytes / copy bandwidth",
                              description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--batch-sizes", type=batch_list, default=[1, 16, 64], metavar="B1,B2,...",
                   help="requests decoded together (default: 1,16,64)")
    p.add_argument("--input-len", type=positive_int, default=512, help="prompt tokens per request")
    p.add_argument("--output-len", type=positive_int, default=32, help="tokens decoded per request")
    p.add_argument("--warmup-steps", type=int, default=2,
                   help="steady decode steps of each batch left out of the mean (graph capture, caches)")
    p.add_argument("--copy-mib", type=positive_int, default=None,
                   help="bytes copied to measure bandwidth (default: 1024 MiB on CUDA, 256 on the CPU)")
    p.add_argument("--compare-eager", action="store_true",
                   help="run each batch with CUDA graphs (enforce_eager False) and without (True)")
    p.add_argument("--output-json", default=None, type=output_file)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=roofline_main)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 5) -> float:
    """Best-of-``repeats`` bytes/s of ``dst.copy_(src)`` for ``nbytes``-byte buffers on
    ``device``, counting bytes read plus written (2 x ``nbytes``)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def weight_bytes(arch, dtype_bytes: int, batch: int) -> int:
    """Weight bytes a decode step of ``batch`` requests reads: every layer's q|k|v, o,
    gate|up and down matrices, biases and norms, the final norm, the LM head whole, and
    ``batch`` rows of the embedding table (a step does not read the rest of it).

    Raises:
        ValueError: a mixture-of-experts model (the experts read depend on the routing)."""
    a = arch
    if a.num_experts:
        raise ValueError("bench roofline counts dense models only; this one is mixture-of-experts")
    q, kv = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
    per_layer = (a.hidden_size * (q + 2 * kv) + q * a.hidden_size + 3 * a.hidden_size * a.intermediate_size
                 + 2 * a.hidden_size + (q + 2 * kv) * a.attention_bias + 2 * a.head_dim * a.qk_norm)
    elems = a.num_hidden_layers * per_layer + a.hidden_size + a.vocab_size * a.hidden_size + batch * a.hidden_size
    return elems * dtype_bytes


def kv_bytes(arch, kv_dtype_bytes: int, contexts: list[int]) -> int:
    """K and V bytes a decode step reads over all layers, for requests attending
    ``contexts`` tokens each (a sliding-window layer reads at most its window)."""
    per_token_layer = 2 * arch.num_key_value_heads * arch.head_dim * kv_dtype_bytes
    ctx = np.asarray(contexts, dtype=np.int64)
    tokens = sum(int(np.minimum(ctx, w).sum()) if w else int(ctx.sum()) for w in arch.layer_windows())
    return tokens * per_token_layer


def decode_bytes(arch, dtype_bytes: int, kv_dtype_bytes: int, contexts: list[int]) -> int:
    """``weight_bytes`` + ``kv_bytes`` of one decode step of ``len(contexts)`` requests."""
    return weight_bytes(arch, dtype_bytes, len(contexts)) + kv_bytes(arch, kv_dtype_bytes, contexts)


class _LastStats:
    """A stat logger keeping the scheduler stats of the last step."""

    stats = None

    def record(self, stats, it) -> None:
        self.stats = stats


def time_decode(llm, batch: int, input_len: int, output_len: int, seed: int) -> list[tuple[float, list[int]]]:
    """(seconds, context of each request) of every steady decode step of ``batch`` random
    prompts (all ``batch`` requests decoding, no prefill tokens in the step)."""
    from pagedllm import SamplingParams

    eng = llm.llm_engine
    device = eng.config.device
    last = _LastStats()
    eng.stat_loggers.append(last)
    rng = np.random.default_rng(seed)
    vocab = eng.config.arch.vocab_size
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"roofline-{seed}-{i}", {"prompt_token_ids": rng.integers(100, vocab, input_len).tolist()}, sp)
    steps = []
    try:
        while eng.has_unfinished_requests():
            _sync(device)
            t = time.perf_counter()
            outs = eng.step()
            _sync(device)
            dt = time.perf_counter() - t
            s = last.stats
            if s is not None and s.step_num_prefill_tokens == 0 and len(outs) == batch:
                steps.append((dt, [input_len + len(o.outputs[0].token_ids) - 1 for o in outs]))
    finally:
        eng.stat_loggers.remove(last)
    return steps


def _engine_kwargs(args) -> dict:
    """The command's engine settings for an in-process engine sized to the workload."""
    from pagedllm.config import EngineArgs

    kw = {k: v for k, v in vars(EngineArgs.from_cli_args(args)).items() if k != "model"}
    top = max(args.batch_sizes)
    need = args.input_len + args.output_len
    kw.update(engine_process=False, enable_prefix_caching=False, max_num_seqs=max(top, kw["max_num_seqs"]),
              max_model_len=kw["max_model_len"] or need + kw["block_size"])
    if kw["num_gpu_blocks_override"] is None:   # the workload's blocks, not 90 % of the GPU
        kw["num_gpu_blocks_override"] = top * (-(-kw["max_model_len"] // kw["block_size"]) + 1) + 16
    return kw


def run_rows(args, eager: bool) -> tuple[list[dict], dict]:
    """One engine (``enforce_eager=eager``): a row per batch size, and the engine's facts."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(model=args.model, **{**_engine_kwargs(args), "enforce_eager": eager})
    try:
        cfg = llm.llm_engine.config
        llm.generate([[1] * 8], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        facts = {"compute_path": llm.llm_engine.engine_core.info.compute_path,
                 "dtype": str(cfg.dtype).removeprefix("torch."),
                 "kv_cache_dtype": str(cfg.kv_cache_dtype).removeprefix("torch."), "arch": cfg.arch, "device": cfg.device,
                 "dtype_bytes": cfg.dtype.itemsize, "kv_dtype_bytes": cfg.kv_cache_dtype.itemsize}
        rows = []
        for b in args.batch_sizes:
            steps = time_decode(llm, b, args.input_len, args.output_len, seed=args.seed + b)[args.warmup_steps:]
            if not steps:
                rows.append({"enforce_eager": eager, "batch": b, "decode_steps": 0})
                continue
            secs = np.array([s for s, _ in steps])
            nbytes = np.mean([decode_bytes(cfg.arch, facts["dtype_bytes"], facts["kv_dtype_bytes"], c)
                              for _, c in steps])
            rows.append({"enforce_eager": eager, "batch": b, "decode_steps": len(steps),
                         "step_ms": 1e3 * float(secs.mean()), "step_ms_median": 1e3 * float(np.median(secs)),
                         "weight_bytes": weight_bytes(cfg.arch, facts["dtype_bytes"], b),
                         "bytes_per_step": float(nbytes), "tokens_per_s": b / float(secs.mean())})
        return rows, facts
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def roofline_main(args) -> int:
    """Entry point of ``pagedllm bench roofline``; returns 0."""
    from pagedllm.benchmarks.machine import device_info, machine_info
    from pagedllm.kernels import cpu as cpu_kernels
    from pagedllm.utils import resolve_device

    if args.warmup_steps < 0:
        raise ValueError(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    if getattr(args, "quantization", None):
        raise ValueError("--quantization: bench roofline counts weights at the model dtype's width; "
                         "quantized weights are not counted (run it unquantized)")
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    device = resolve_device(args.device)
    mib = args.copy_mib or (1024 if device.type == "cuda" else 256)
    bw = copy_bandwidth(device, mib * 2**20)
    rows, facts = [], {}
    for eager in ([False, True] if args.compare_eager else [args.enforce_eager]):
        r, facts = run_rows(args, eager)
        rows += r
    for r in rows:
        if r["decode_steps"]:
            r["roofline_ms"] = 1e3 * r["bytes_per_step"] / bw
            r["efficiency"] = r["roofline_ms"] / r["step_ms"]
    a = facts["arch"]
    report = {"machine": machine_info(), "device": device_info(device), "copy_bandwidth_gb_s": bw / 1e9,
              "copy_mib": mib, "model": args.model, "load_format": args.load_format,
              "architecture": a.architecture, "num_hidden_layers": a.num_hidden_layers, "hidden_size": a.hidden_size,
              "dtype": facts["dtype"], "kv_cache_dtype": facts["kv_cache_dtype"], "compute_path": facts["compute_path"],
              "kv_bytes_per_token": kv_bytes(a, facts["kv_dtype_bytes"], [1]),
              "input_len": args.input_len, "output_len": args.output_len, "warmup_steps": args.warmup_steps,
              # whether anything asked for the C++ CPU kernels (a build, unless PAGEDLLM_CPU_KERNELS=0)
              # although the engine ran on another device
              "cpu_kernels_requested": cpu_kernels._tried if device.type != "cpu" else None,
              "rows": rows}
    print(f"\n{report['device']['name']} ({device}); copy bandwidth {bw / 1e9:.1f} GB/s (read + write, "
          f"{mib} MiB); {a.architecture}, {a.num_hidden_layers} layers, hidden {a.hidden_size}, {facts['dtype']}, "
          f"KV {report['kv_bytes_per_token']} B/token; {args.input_len} in, {args.output_len} out")
    print(f"{'eager':>5} {'batch':>5} {'steps':>5} {'step ms':>9} {'GB/step':>8} {'roofline ms':>11} "
          f"{'efficiency':>10} {'tok/s':>9}")
    for r in rows:
        if not r["decode_steps"]:
            print(f"{str(r['enforce_eager']):>5} {r['batch']:>5}     0  (no steady decode step: raise --output-len)")
            continue
        print(f"{str(r['enforce_eager']):>5} {r['batch']:>5} {r['decode_steps']:>5} {r['step_ms']:>9.3f} "
              f"{r['bytes_per_step'] / 1e9:>8.3f} {r['roofline_ms']:>11.3f} {r['efficiency']:>10.3f} "
              f"{r['tokens_per_s']:>9.1f}")
    if args.output_json:
        save_json(report, args.output_json)
    return 0
