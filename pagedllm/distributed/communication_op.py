"""The collectives of tensor parallelism over this engine's TP group (identity at size 1)."""
from __future__ import annotations

import torch

from pagedllm.distributed.parallel_state import get_tp_group


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` over the TP ranks, in place (returned); row-parallel layers' output."""
    return get_tp_group().all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The TP ranks' ``x`` concatenated along ``dim`` (vocab-parallel logits)."""
    return get_tp_group().all_gather(x, dim)


def tensor_model_parallel_broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """TP rank ``src``'s ``x`` on every rank, in place (returned)."""
    return get_tp_group().broadcast(x, src)
