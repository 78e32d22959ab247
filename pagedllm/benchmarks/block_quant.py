"""Throughput of the GGUF block-quantized linear kernel (``block_quant_linear``) beside
float32 oneDNN-packed linears, in one run:

    python -m pagedllm.benchmarks.block_quant [--fmt Q4_1 Q8_0] [--threads 2]

Per (K, N) and row count M: GFLOP/s = 2 * M * N * K / best seconds per call (the
implementations in turn), and the speed-up over oneDNN. Weights rotate through copies so
each call reads from memory, unless ``--hot``.
"""
from __future__ import annotations

import argparse
import time

import torch

SHAPES = ((576, 960), (576, 3072), (1536, 576), (576, 49152))
ROWS = (1, 4, 64, 512)


def _best_times(fns: list, copies: list[int], min_s: float, min_calls: int = 5) -> list[float]:
    """Best seconds per call of each ``fns[j](i)`` (i cycling through ``copies[j]``), the
    functions called in turn."""
    for fn in fns:
        fn(0)
    best = [float("inf")] * len(fns)
    calls, t_end = 0, time.perf_counter() + min_s * len(fns)
    while calls < min_calls or time.perf_counter() < t_end:
        for j, fn in enumerate(fns):
            t = time.perf_counter()
            fn(calls % copies[j])
            best[j] = min(best[j], time.perf_counter() - t)
        calls += 1
    return best


def timing_parser(doc: str, rows: tuple[int, ...] = ROWS) -> argparse.ArgumentParser:
    """The options every linear-kernel micro-benchmark takes: --rows, --threads, --hot,
    --cold-bytes, --min-s (``doc``: the module's description)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", type=int, default=list(rows))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--hot", action="store_true", help="reuse one weight (cache-resident where it fits)")
    p.add_argument("--cold-bytes", type=float, default=96e6, help="bytes of weight copies to rotate through")
    p.add_argument("--min-s", type=float, default=0.3, help="timing per measurement (s)")
    return p


def main(argv: list[str] | None = None) -> None:
    p = timing_parser(__doc__)
    p.add_argument("--fmt", nargs="+", default=["Q4_1", "Q8_0"])
    args = p.parse_args(argv)

    from pagedllm.kernels.cpu import load_cpu_kernels
    from pagedllm.layers.quantization.gguf_blocks import block_format, quantize_to_blocks

    torch.set_num_threads(args.threads)
    ops = load_cpu_kernels()
    if ops is None:
        raise SystemExit("the C++ kernels are unavailable")
    print(f"threads {torch.get_num_threads()}, kernel path {ops.block_quant_isa()}, "
          f"{'hot' if args.hot else 'cold'} weights; GFLOP/s = 2*M*N*K/t")
    hdr = f"{'K':>5} {'N':>6} {'M':>4} | {'oneDNN fp32':>11}"
    for f in args.fmt:
        hdr += f" | {f:>7} {'x':>5}"
    print(hdr)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for k, n in SHAPES:
            w = torch.randn(n, k, generator=g) * 0.05

            def n_copies(bytes_each):
                return 1 if args.hot else max(1, int(args.cold_bytes // bytes_each) + 1)

            dense = [torch.ops.mkldnn._reorder_linear_weight(w.clone(), None)
                     for _ in range(n_copies(w.numel() * 4))]
            packed = {}
            for f in args.fmt:
                one = quantize_to_blocks(w, f)
                packed[f] = [one.clone() for _ in range(n_copies(one.numel()))]
            for m in args.rows:
                x = torch.randn(m, k, generator=g)
                flop = 2.0 * m * n * k
                outs = torch.empty(m, n)

                def dense_call(i):
                    return torch.ops.mkldnn._linear_pointwise(x, dense[i], None, "none", [], "")

                def block_call(f):
                    fid = int(block_format(f).ggml_type)
                    return lambda i: ops.block_quant_linear(outs, x, packed[f][i], fid)

                times = _best_times([dense_call] + [block_call(f) for f in args.fmt],
                                    [len(dense)] + [len(packed[f]) for f in args.fmt], args.min_s)
                line = f"{k:>5} {n:>6} {m:>4} | {flop / times[0] / 1e9:>11.1f}"
                for t in times[1:]:
                    line += f" | {flop / t / 1e9:>7.1f} {times[0] / t:>4.1f}x"
                print(line, flush=True)
            del dense, packed


if __name__ == "__main__":
    main()
