"""The step's inputs at fixed device addresses (vLLM V1's persistent ``input_ids``,
``positions``, ``slot_mapping``... of ``GPUModelRunner``): each step is copied into the head
of these buffers instead of into fresh tensors, so a captured CUDA graph that reads them
replays on new data (``worker/cuda_graph.py``). On CUDA the copies go through pinned host
twins, asynchronously."""
from __future__ import annotations

import numpy as np
import torch

# name -> (dtype, size key): "tokens" = max_num_tokens, "reqs" = max_num_reqs, "reqs+1"
_BUFFERS = {
    "input_ids": (torch.int64, "tokens"),
    "positions": (torch.int64, "tokens"),
    "slot_mapping": (torch.int64, "tokens"),
    "query_start_loc": (torch.int32, "reqs+1"),
    "seq_lens": (torch.int32, "reqs"),
    "context_lens": (torch.int32, "reqs"),
    "block_table": (torch.int32, "reqs"),
}


class InputBuffers:
    """Device buffers for at most ``max_num_tokens`` tokens of ``max_num_reqs`` requests with
    ``max_blocks`` blocks each: int64 ``input_ids``, ``positions``, ``slot_mapping`` [tokens];
    int32 ``query_start_loc`` [reqs + 1], ``seq_lens``, ``context_lens`` [reqs],
    ``block_table`` [reqs, max_blocks]."""

    def __init__(self, max_num_tokens: int, max_num_reqs: int, max_blocks: int, device: torch.device):
        self.max_num_tokens, self.max_num_reqs, self.max_blocks = max_num_tokens, max_num_reqs, max_blocks
        self.device = device
        size = {"tokens": (max_num_tokens,), "reqs": (max_num_reqs,), "reqs+1": (max_num_reqs + 1,)}
        self.buffers: dict[str, torch.Tensor] = {}
        self._host: dict[str, torch.Tensor] = {}
        self._copied: dict[str, torch.cuda.Event] = {}   # each pinned twin's last copy
        pin = device.type == "cuda"
        for name, (dtype, key) in _BUFFERS.items():
            shape = size[key] + ((max_blocks,) if name == "block_table" else ())
            self.buffers[name] = torch.zeros(shape, dtype=dtype, device=device)
            if pin:
                self._host[name] = torch.zeros(shape, dtype=dtype, pin_memory=True)
        self.buffers["slot_mapping"].fill_(-1)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.buffers[name]

    def fits(self, num_tokens: int, num_reqs: int, num_blocks: int) -> bool:
        """Whether a step of this size fits the buffers (else the runner uses fresh tensors)."""
        return num_tokens <= self.max_num_tokens and num_reqs <= self.max_num_reqs and num_blocks <= self.max_blocks

    def stage(self, name: str, array: np.ndarray) -> torch.Tensor:
        """Copy ``array`` (1-D, or 2-D for ``block_table``) into the head of buffer ``name``
        and return that view (``[:n]``, or ``[:rows, :cols]``, a strided view). Raises
        ValueError when it does not fit (check with ``fits``)."""
        dst = self.buffers[name]
        index = tuple(slice(0, n) for n in array.shape)
        if any(n > m for n, m in zip(array.shape, dst.shape)):
            raise ValueError(f"{name}: {array.shape} does not fit the persistent buffer {tuple(dst.shape)}")
        src = torch.from_numpy(np.ascontiguousarray(array)).to(dst.dtype)
        if self._host:
            # the previous step's copy from this pinned twin may still be queued behind its
            # forward (a step that samples nothing never synchronises): wait before overwriting
            event = self._copied.get(name)
            if event is not None:
                event.synchronize()
            host = self._host[name][index]
            host.copy_(src)
            dst[index].copy_(host, non_blocking=True)
            event = self._copied.setdefault(name, torch.cuda.Event())
            event.record()
        else:
            dst[index].copy_(src)
        return dst[index]
