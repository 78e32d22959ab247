"""Time of one tensor-parallel all-reduce on this machine, as the row-parallel layers call it:

    python -m pagedllm.benchmarks.allreduce [--world 2] [--hidden 576 640] [--rows 1 32 256]

Two (``--world``) loopback processes in a gloo world (``pagedllm.distributed``, one thread
each) sum [rows, hidden] tensors in float32 and bfloat16, through the shared-memory
all-reduce (``--no-shm``: gloo's, as ``PAGEDLLM_SHM_ALLREDUCE=0``); prints the median microseconds
per call over ``--iters`` calls after a warm-up, and the per-step cost of a Llama-family
model with ``--layers`` layers (two all-reduces a layer, one for the embedding; the
logits' all-gather is not counted).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def _rank(rank: int, world: int, port: int, args, results) -> None:
    from pagedllm import distributed as pd

    torch.set_num_threads(1)
    pd.init_distributed_environment(world, rank, f"tcp://127.0.0.1:{port}", backend="gloo", timeout_s=120)
    pd.initialize_model_parallel(world)
    try:
        out = {}
        for dtype in (torch.float32, torch.bfloat16):
            for hidden in args.hidden:
                for rows in args.rows:
                    x = torch.randn(rows, hidden).to(dtype)
                    for _ in range(10):
                        pd.tensor_model_parallel_all_reduce(x)
                    times = []
                    for _ in range(args.iters):
                        pd.get_tp_group().barrier()
                        t = time.perf_counter()
                        pd.tensor_model_parallel_all_reduce(x)
                        times.append(time.perf_counter() - t)
                    out[str(dtype).replace("torch.", ""), hidden, rows] = statistics.median(times) * 1e6
        results[rank] = out
    finally:
        pd.destroy_model_parallel()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--hidden", type=int, nargs="+", default=[576, 640])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32, 256])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--layers", type=int, default=30, help="decoder layers of the model priced per step")
    p.add_argument("--no-shm", action="store_true", help="gloo's all-reduce instead of the shared-memory one")
    args = p.parse_args(argv)
    import os

    os.environ["PAGEDLLM_SHM_ALLREDUCE"] = "0" if args.no_shm else "1"   # read by the spawned ranks

    import torch.multiprocessing as mp

    from pagedllm.benchmarks.machine import machine_info
    from pagedllm.executor.multiproc_executor import free_port

    m = machine_info()
    how = "gloo" if args.no_shm else "shared memory (gloo world)"
    print(f"{m['cpu']} ({' '.join(m['isa'])}); {m['cores']} cores; {how}, {args.world} processes x 1 thread")
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, args.world, port, args, results)) for r in range(args.world)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(600)
        if any(proc.exitcode != 0 for proc in procs):
            raise SystemExit(f"a rank failed: exit codes {[proc.exitcode for proc in procs]}")
        res = results[0]
    calls = 2 * args.layers + 1
    print(f"{'dtype':>8} {'hidden':>6} {'rows':>5} | {'us/call':>8} | {'ms/step':>7} ({calls} calls)")
    for (dtype, hidden, rows), us in sorted(res.items()):
        print(f"{dtype:>8} {hidden:>6} {rows:>5} | {us:>8.1f} | {us * calls / 1000:>7.2f}")


if __name__ == "__main__":
    main()
