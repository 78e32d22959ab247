"""pagedllm.distributed's collectives: the identity at one rank (no torch.distributed),
and on 2 processes over loopback gloo the same values as torch.distributed's own
collectives computed by hand, in float32 and bfloat16."""
from __future__ import annotations

import platform

import pytest
import torch
import torch.multiprocessing as mp

from pagedllm import distributed as pd
from pagedllm.executor.multiproc_executor import free_port


def test_one_rank_is_the_identity_without_torch_distributed():
    import torch.distributed as dist

    assert not dist.is_initialized()
    assert (pd.get_tp_rank(), pd.get_tp_size(), pd.get_dp_rank(), pd.get_dp_size()) == (0, 1, 0, 1)
    x = torch.randn(3, 5)
    assert pd.tensor_model_parallel_all_reduce(x) is x
    assert pd.tensor_model_parallel_all_gather(x) is x
    assert pd.tensor_model_parallel_broadcast(x) is x
    assert not pd.model_parallel_initialized()


def _worker(rank: int, world: int, port: int, results) -> None:
    import torch.distributed as dist

    pd.init_distributed_environment(world, rank, f"tcp://127.0.0.1:{port}", backend="gloo", timeout_s=60)
    pd.initialize_model_parallel(world, data_parallel_rank=1, data_parallel_size=3)
    try:
        out = {"rank": pd.get_tp_rank(), "size": pd.get_tp_size(), "dp": (pd.get_dp_rank(), pd.get_dp_size())}
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator().manual_seed(rank)
            x = torch.randn(4, 6, generator=g).to(dtype)
            # torch's own: every rank's tensor, summed in rank order by hand
            mine = [torch.randn(4, 6, generator=torch.Generator().manual_seed(r)).to(dtype) for r in range(world)]
            reduced = pd.tensor_model_parallel_all_reduce(x.clone())
            expect = torch.zeros_like(mine[0])
            ref = x.clone()
            dist.all_reduce(ref)
            for m in mine:
                expect = expect + m
            out[f"reduce_{dtype}"] = (torch.equal(reduced, ref), (reduced.float() - expect.float()).abs().max().item())
            gathered = pd.tensor_model_parallel_all_gather(x, dim=1)
            out[f"gather_{dtype}"] = torch.equal(gathered, torch.cat(mine, dim=1))
            b = pd.tensor_model_parallel_broadcast(x.clone(), src=1)
            out[f"bcast_{dtype}"] = torch.equal(b, mine[1])
            # many calls through the shared-memory buffers (both parities, several shapes),
            # and one too big for them (gloo), each bit for bit gloo's
            same = []
            for i, rows in enumerate([1, 7, 32, 1, 300, 5] + [3] * 20 + [3 * (1 << 20) // 4]):
                y = torch.randn(rows, 4, generator=torch.Generator().manual_seed(100 * rank + i)).to(dtype)
                ref = y.clone()
                dist.all_reduce(ref)
                same.append(torch.equal(pd.tensor_model_parallel_all_reduce(y), ref))
            out[f"many_{dtype}"] = all(same)
        out["shm"] = pd.get_tp_group().shm is not None
        results[rank] = out
    finally:
        pd.destroy_model_parallel()


def test_collectives_on_two_processes_match_torch_distributed():
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = free_port()
        procs = [ctx.Process(target=_worker, args=(r, 2, port, results)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
        assert not alive and all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        results = dict(results)
    for rank in range(2):
        r = results[rank]
        assert (r["rank"], r["size"], r["dp"]) == (rank, 2, (1, 3))
        for dtype in (torch.float32, torch.bfloat16):
            same, err = r[f"reduce_{dtype}"]
            assert same and err <= (0 if dtype == torch.float32 else 0.02)
            assert r[f"gather_{dtype}"] and r[f"bcast_{dtype}"] and r[f"many_{dtype}"]
        assert r["shm"] == (platform.machine() == "x86_64")


def test_bad_rank_and_size_are_errors():
    with pytest.raises(ValueError, match="rank 2 is outside"):
        pd.init_distributed_environment(2, 2, "tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="tensor_parallel_size 2 but the torch.distributed world has 1"):
        pd.initialize_model_parallel(2)


def test_cpu_bind_lists(monkeypatch):
    import os

    from pagedllm.distributed.utils import parse_cpu_bind

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6)))

    assert parse_cpu_bind("0-1,4|2-3", 0, 2) == {0, 1, 4}
    assert parse_cpu_bind("0-1,4|2-3", 1, 2) == {2, 3}
    with pytest.raises(ValueError, match="2 core lists for 3 ranks"):
        parse_cpu_bind("0|1", 0, 3)
    with pytest.raises(ValueError, match="'x' is not N or N-M"):
        parse_cpu_bind("x|1", 0, 2)
    with pytest.raises(ValueError, match=r"PAGEDLLM_CPU_OMP_THREADS_BIND: rank 1's cores \[99\] are not among"):
        parse_cpu_bind("0|99", 1, 2)
