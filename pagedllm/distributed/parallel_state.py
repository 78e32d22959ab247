"""Process groups of one engine: the tensor-parallel group of its workers (every rank of
the torch.distributed world) and the engine's place among data-parallel engines.

Before ``initialize_model_parallel`` (one process, no torch.distributed) every group has
size 1 and its collectives are the identity, so a model built at tp = 1 never touches
torch.distributed. Backends: gloo on the CPU, NCCL on CUDA (vLLM's ``parallel_state``).
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


class GroupCoordinator:
    """One process group and this process's place in it.

    Attributes:
        rank_in_group, world_size: this rank and the group's size.
        group: the torch.distributed group, or None at size 1.
    """

    def __init__(self, rank_in_group: int = 0, world_size: int = 1, group=None, shm=None):
        self.rank_in_group, self.world_size, self.group = rank_in_group, world_size, group
        self.shm = shm   # a ShmAllReduce for CPU tensors when every rank is on this machine

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of ``x`` over the group, in place (returned)."""
        if self.world_size > 1:
            if self.shm is not None and self.shm.supports(x):
                return self.shm.all_reduce(x)
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' ``x`` (same shape on every rank) concatenated along ``dim`` in rank order."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``x`` on every rank, in place (returned)."""
        if self.world_size > 1:
            dist.broadcast(x, src=src, group=self.group)
        return x

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)


_TP = GroupCoordinator()
_DP = (0, 1)   # (this engine's data-parallel rank, the number of engines)


def init_distributed_environment(world_size: int, rank: int, init_method: str, backend: str | None = None,
                                 timeout_s: float = 600.0) -> None:
    """Join the torch.distributed world (``init_method``: ``tcp://host:port`` or ``env://``).

    Raises:
        ValueError: rank outside [0, world_size)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() and torch.cuda.device_count() else "gloo")
        dist.init_process_group(backend, init_method=init_method, world_size=world_size, rank=rank,
                                timeout=datetime.timedelta(seconds=timeout_s))


def initialize_model_parallel(tensor_parallel_size: int, data_parallel_rank: int = 0,
                              data_parallel_size: int = 1) -> None:
    """Make every rank of the world this engine's tensor-parallel group.

    Raises:
        ValueError: the world's size is not ``tensor_parallel_size`` (one engine's workers
            form one world; data-parallel engines are separate worlds)."""
    global _TP, _DP
    size = dist.get_world_size() if dist.is_initialized() else 1
    if size != tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size} but the torch.distributed world has "
                         f"{size} ranks")
    group = dist.group.WORLD if size > 1 else None
    rank = dist.get_rank() if size > 1 else 0
    _TP = GroupCoordinator(rank, size, group, _shm_allreduce(group, rank, size) if size > 1 else None)
    _DP = (data_parallel_rank, data_parallel_size)


def _shm_allreduce(group, rank: int, size: int):
    """A ``ShmAllReduce`` over ``group`` when its backend is gloo, every rank runs on this
    machine (same boot id and host name) and ``PAGEDLLM_SHM_ALLREDUCE`` is on; else None."""
    import socket

    from pagedllm import envs

    if dist.get_backend(group) != "gloo":
        return None
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            me = (socket.gethostname(), f.read().strip())
    except OSError:
        me = (socket.gethostname(), f"pid-host-{rank}")   # unknown: never shared
    views: list = [None] * size   # each rank's (host, wanted): the choice is made alike on all
    dist.all_gather_object(views, (me, envs.shm_allreduce()), group=group)
    if not all(wanted for _, wanted in views) or len({host for host, _ in views}) != 1:
        return None
    from pagedllm.distributed.shm_allreduce import ShmAllReduce

    try:
        return ShmAllReduce(group, rank, size)
    except RuntimeError:
        return None


def model_parallel_initialized() -> bool:
    return _TP.world_size > 1


def destroy_model_parallel() -> None:
    """Back to one rank; leaves the torch.distributed world if this process joined one."""
    global _TP, _DP
    _TP, _DP = GroupCoordinator(), (0, 1)
    if dist.is_initialized():
        dist.destroy_process_group()


def get_tp_group() -> GroupCoordinator:
    return _TP


def get_tp_rank() -> int:
    return _TP.rank_in_group


def get_tp_size() -> int:
    return _TP.world_size


def get_dp_rank() -> int:
    return _DP[0]


def get_dp_size() -> int:
    return _DP[1]
