"""How tensor parallelism splits a model's dimensions over ranks (after vLLM's
``distributed/utils.py``): heads, KV heads (replicated when there are fewer than ranks),
feature and vocabulary ranges."""
from __future__ import annotations

import os

from pagedllm.errors import InvalidParameterError


def divide(numerator: int, tp_size: int, what: str) -> int:
    """``numerator / tp_size`` (the per-rank share of ``what``).

    Raises:
        InvalidParameterError("tensor_parallel_size"): it does not divide evenly."""
    if numerator % tp_size:
        raise InvalidParameterError("tensor_parallel_size",
                                    f"tensor_parallel_size {tp_size} does not divide the model's {what} "
                                    f"({numerator})")
    return numerator // tp_size


def kv_head_shard(num_kv_heads: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """(first KV head, number of KV heads) held by ``tp_rank``: an even split when
    ``tp_size <= num_kv_heads``, else one head each, rank r holding head
    ``r * num_kv_heads // tp_size`` (replicated on ``tp_size / num_kv_heads`` ranks).

    Raises:
        InvalidParameterError("tensor_parallel_size"): neither divides the other."""
    if tp_size <= num_kv_heads:
        n = divide(num_kv_heads, tp_size, "key/value heads")
        return tp_rank * n, n
    if tp_size % num_kv_heads:
        raise InvalidParameterError("tensor_parallel_size",
                                    f"tensor_parallel_size {tp_size} is above the model's {num_kv_heads} "
                                    f"key/value heads and not a multiple of them")
    return tp_rank * num_kv_heads // tp_size, 1


def vocab_shard(vocab_size: int, tp_rank: int, tp_size: int) -> tuple[int, int, int]:
    """(first token id, rows held, rows of it that are real tokens) of ``tp_rank``'s
    vocabulary shard: ``ceil(vocab_size / tp_size)`` rows each, the last shard padded."""
    per = -(-vocab_size // tp_size)
    start = tp_rank * per
    return start, per, max(0, min(per, vocab_size - start))


def parse_cpu_bind(spec: str, rank: int, world_size: int) -> set[int]:
    """Rank ``rank``'s cores from a ``PAGEDLLM_CPU_OMP_THREADS_BIND`` value such as
    ``0-3,8|4-7`` (one ``|``-separated list per rank).

    Raises:
        ValueError: not one list per rank, a part that is not ``N`` or ``N-M``, or a core
            this process may not run on (each naming the variable)."""
    lists = spec.split("|")
    if len(lists) != world_size:
        raise ValueError(f"PAGEDLLM_CPU_OMP_THREADS_BIND has {len(lists)} core lists for {world_size} ranks: {spec!r}")
    cores: set[int] = set()
    for part in lists[rank].split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            cores.update(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise ValueError(f"PAGEDLLM_CPU_OMP_THREADS_BIND: {part!r} is not N or N-M") from None
    if not cores:
        raise ValueError(f"PAGEDLLM_CPU_OMP_THREADS_BIND: no cores for rank {rank}")
    missing = sorted(cores - os.sched_getaffinity(0))
    if missing:
        raise ValueError(f"PAGEDLLM_CPU_OMP_THREADS_BIND: rank {rank}'s cores {missing} are not among this "
                         f"process's cores {sorted(os.sched_getaffinity(0))}")
    return cores
