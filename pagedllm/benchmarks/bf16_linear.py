"""Throughput of the bfloat16 linear kernels beside oneDNN's packed bf16 inner product, in
one run:

    python -m pagedllm.benchmarks.bf16_linear [--rows 1 4 64 512] [--threads 2] [--hot]

Per (K, N) of SmolLM2-135M (the last its LM head) and row count M: GFLOP/s of oneDNN and
of each tiled kernel this CPU runs (AVX512-BF16, AMX; bf16 and float32 output), with the
speed-up over oneDNN. Weights rotate through copies so each call reads from memory, unless
``--hot``.
"""
from __future__ import annotations

import torch

from pagedllm.benchmarks.block_quant import SHAPES, _best_times, timing_parser


def main(argv: list[str] | None = None) -> None:
    args = timing_parser(__doc__).parse_args(argv)

    from pagedllm.benchmarks.machine import machine_info
    from pagedllm.layers.linear import amx_bf16_available, avx512_bf16_available, pack_amx_tiles
    from pagedllm.layers.utils import cpu_kernels_for

    torch.set_num_threads(args.threads)
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    ops = cpu_kernels_for(cpu, bf16)
    kernels = [name for name, ok in (("avx512_bf16_linear", avx512_bf16_available(cpu, bf16)),
                                     ("amx_bf16_linear", amx_bf16_available(cpu, bf16))) if ok]
    m = machine_info()
    print(f"{m['cpu']} ({' '.join(m['isa'])}); threads {torch.get_num_threads()}; "
          f"{'hot' if args.hot else 'cold'} weights; GFLOP/s = 2*M*N*K/t")
    hdr = f"{'K':>5} {'N':>6} {'M':>4} | {'oneDNN bf16':>11}"
    for k in kernels:
        hdr += f" | {k.split('_')[0] + ' bf16':>11} {'x':>5} | {k.split('_')[0] + ' f32 out':>12} {'x':>5}"
    print(hdr)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for k, n in SHAPES:
            w = (torch.randn(n, k, generator=g) * 0.05).to(bf16)
            copies = 1 if args.hot else max(1, int(args.cold_bytes // (w.numel() * 2)) + 1)
            dense = [torch.ops.mkldnn._reorder_linear_weight(w.clone(), None) for _ in range(copies)]
            # each timed function its own copies: none reads a weight another just pulled into cache
            tiled = {(kn, f32): [pack_amx_tiles(w, bf16) for _ in range(copies)]
                     for kn in kernels for f32 in (False, True)}
            for rows in args.rows:
                x = torch.randn(rows, k, generator=g).to(bf16)
                flop = 2.0 * rows * n * k

                def dense_call(i):
                    return torch.ops.mkldnn._linear_pointwise(x, dense[i], None, "none", [], "")

                def tiled_call(name, out_float32):
                    fn = getattr(ops, name)
                    return lambda i: fn(x, tiled[name, out_float32][i], None, out_float32)

                fns = [dense_call] + [tiled_call(kn, f32) for kn in kernels for f32 in (False, True)]
                times = _best_times(fns, [copies] * len(fns), args.min_s)
                line = f"{k:>5} {n:>6} {rows:>4} | {flop / times[0] / 1e9:>11.1f}"
                for i, t in enumerate(times[1:]):
                    line += f" | {flop / t / 1e9:>{11 if i % 2 == 0 else 12}.1f} {times[0] / t:>4.2f}x"
                print(line, flush=True)
            del dense, tiled


if __name__ == "__main__":
    main()
