"""A shared-memory all-reduce for CPU ranks on one machine (as vLLM's and SGLang's CPU
backends have one): each rank copies its tensor into its slot of a ``/dev/shm`` file,
publishes a sequence number, waits until every rank has published, and sums the slots in
rank order, so every rank gets the same bits (for two ranks, gloo's bits too: one rounded
addition). Slots alternate between two buffers by call parity, so a rank may write call
n + 1's data while a slower one still reads call n's.

Ordering relies on x86's stores being seen in program order (data before flag); the
group only uses it on x86-64 hosts and falls back to gloo for tensors over
``slot_bytes`` or of other dtypes.
"""
from __future__ import annotations

import os
import platform
import time
import uuid

import numpy as np
import torch
import torch.distributed as dist

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FLAG_STRIDE = 8      # int64s per rank's flag: one 64-byte cache line each


class ShmAllReduce:
    """Args:
        group: the torch.distributed group (its ranks on this machine).
        rank, world_size: this rank in it and its size.
        slot_bytes: the largest tensor summed here (bigger ones: ``supports`` is False).

    Raises:
        RuntimeError: not on x86-64 (the ordering above does not hold elsewhere).
    """

    def __init__(self, group, rank: int, world_size: int, slot_bytes: int = 8 << 20):
        if platform.machine() not in ("x86_64", "AMD64"):
            raise RuntimeError("the shared-memory all-reduce needs x86-64's store ordering")
        self.rank, self.world_size, self.slot_bytes = rank, world_size, slot_bytes
        name = [f"/dev/shm/pagedllm-allreduce-{uuid.uuid4().hex}" if rank == 0 else None]
        dist.broadcast_object_list(name, src=0, group=group)
        path = name[0]
        flags_bytes = world_size * _FLAG_STRIDE * 8
        total = flags_bytes + 2 * world_size * slot_bytes
        if rank == 0:
            with open(path, "wb") as f:
                f.truncate(total)
        dist.barrier(group=group)
        self._mm = np.memmap(path, dtype=np.uint8, mode="r+", shape=(total,))
        dist.barrier(group=group)
        if rank == 0:
            os.unlink(path)   # the mappings keep it; nothing is left in /dev/shm
        self._flags = self._mm[:flags_bytes].view(np.int64)
        self._data = self._mm[flags_bytes:].reshape(2, world_size, slot_bytes)
        self._seq = 0
        pids: list = [None] * world_size
        dist.all_gather_object(pids, os.getpid(), group=group)
        self._peers = [p for r, p in enumerate(pids) if r != rank]

    def _check_peers(self) -> None:
        """Raises RuntimeError when another rank's process is gone (it will never publish)."""
        for pid in self._peers:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                raise RuntimeError(f"all-reduce: the rank in process {pid} is gone") from None

    def supports(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype in _DTYPES and x.numel() * x.element_size() <= self.slot_bytes

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks, in rank order, into ``x`` (returned). Every
        rank must call it with the same shape and dtype, in the same order."""
        self._seq += 1
        seq, nbytes = self._seq, x.numel() * x.element_size()
        buf = self._data[seq % 2]
        buf[self.rank, :nbytes] = x.contiguous().view(-1).view(torch.uint8).numpy()
        self._flags[self.rank * _FLAG_STRIDE] = seq
        flags = self._flags[::_FLAG_STRIDE]
        spins = 0
        while flags.min() < seq:
            spins += 1
            if spins > 64:
                time.sleep(0) if spins < 10000 else time.sleep(0.0001)
                if spins % 2048 == 0:
                    self._check_peers()
        parts = [torch.from_numpy(buf[r, :nbytes]).view(x.dtype) for r in range(self.world_size)]
        out = parts[0].clone()
        for p in parts[1:]:
            out += p
        x.copy_(out.view(x.shape))
        return x
