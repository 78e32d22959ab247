"""Decode steps as replayed CUDA graphs (vLLM's and nano-vllm's ``capture_cudagraph``): at
start-up the model's forward over a decode batch of each size in ``capture_sizes`` is
captured once, reading the runner's persistent ``InputBuffers``; a decode-only step of B
requests is padded to the next captured size P (padding: token 0 at position 0, slot -1 so
nothing is written, one cached token, block 0) and replayed. Padding rows are rewritten every
step, so nothing a departed request left in the buffers is read. Steps with a prompt chunk or
draft tokens, or larger than the largest size, run eagerly."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from pagedllm.attention.backend import CommonAttentionMetadata
from pagedllm.forward_context import set_forward_context
from pagedllm.worker.compiled_step import CompiledStep
from pagedllm.worker.input_buffers import InputBuffers

logger = logging.getLogger("pagedllm")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes to capture: 1, 2, 4, 8, then every 16, up to ``max_num_seqs``
    (itself included, so every batch it admits has a size to pad to). Ascending."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs] + list(range(16, max_num_seqs + 1, 16))
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def padded_size(sizes: list[int], num_reqs: int) -> int | None:
    """The smallest of ``sizes`` (ascending) >= ``num_reqs``; None when there is none."""
    return next((s for s in sizes if s >= num_reqs), None)


class TorchCudaGraphs:
    """Captures into ``torch.cuda.CUDAGraph``s that share one memory pool."""

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        """(graph, its static output) for ``fn`` (run once eagerly first by the caller)."""
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            out = fn()
        return g, out

    @staticmethod
    def replay(graph: Any) -> None:
        graph.replay()


class CudaGraphStep(CompiledStep):
    """Captured decode steps of ``forward(input_ids, positions)`` over ``buffers`` for the
    attention metadata ``build_metadata(common)`` gives (the backend's, one per attention
    group); ``graphs``: the capture/replay implementation (``TorchCudaGraphs``; a test passes
    one that re-runs the function). ``reason``: why steps run eagerly (None when captured)."""

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], buffers: InputBuffers,
                 build_metadata: Callable[[CommonAttentionMetadata], Any], block_size: int,
                 sizes: list[int], graphs: Any = None, reason: str | None = None):
        self.forward, self.buffers, self.build_metadata = forward, buffers, build_metadata
        self.block_size, self.sizes = block_size, [s for s in sizes if s <= buffers.max_num_reqs]
        self.graphs = graphs
        self.reason = reason
        self.captured: dict[int, tuple[Any, torch.Tensor]] = {}
        self.capture_seconds = 0.0
        self.capture_bytes = 0

    @classmethod
    def for_runner(cls, runner) -> CudaGraphStep:
        """The graphs for a ``ModelRunner`` (not yet captured: ``capture``), or an instance that
        only says why not (``--enforce-eager``, a backend that cannot be captured...)."""
        args = runner.config.args
        reason = None
        if args.enforce_eager:
            reason = "--enforce-eager"
        elif not runner.attn.cudagraph_support:
            reason = f"the {runner.attn.name} attention backend cannot be captured"
        elif any(g != 0 for g, _ in runner.attn_groups):
            reason = "several KV-cache groups"
        elif runner.config.arch.num_experts:
            reason = "mixture-of-experts routing reads the device on the host"
        elif runner.proposer is not None and runner.proposer.is_model:
            reason = "a draft model"
        elif args.tensor_parallel_size > 1:
            reason = "tensor parallel (capturing collectives is not checked yet)"
        return cls(runner.model, runner.input_buffers, runner.metadata_for_graph, runner.block_size,
                   capture_sizes(args.max_num_seqs), None if reason else TorchCudaGraphs(), reason)

    def _load_padding(self, num_reqs: int, size: int) -> None:
        """Fill rows num_reqs..size-1 of the buffers with padding decodes (and the whole batch
        when num_reqs == 0, as at capture)."""
        b = self.buffers
        b["input_ids"][num_reqs:size].zero_()
        b["positions"][num_reqs:size].zero_()
        b["slot_mapping"][num_reqs:size].fill_(-1)
        b["seq_lens"][num_reqs:size].fill_(1)
        b["context_lens"][num_reqs:size].zero_()
        b["block_table"][num_reqs:size, 0].zero_()
        qsl = b["query_start_loc"]
        qsl[num_reqs:size + 1] = torch.arange(num_reqs, size + 1, dtype=qsl.dtype, device=qsl.device)

    def _common(self, size: int) -> CommonAttentionMetadata:
        """Metadata over the buffers' heads for a decode batch of ``size`` (host copies: padding)."""
        import numpy as np

        b = self.buffers
        qsl = np.arange(size + 1, dtype=np.int64)
        ones = np.ones(size, dtype=np.int64)
        return CommonAttentionMetadata(
            num_reqs=size, num_tokens=size, num_decodes=size, query_start_loc=b["query_start_loc"][:size + 1],
            seq_lens=b["seq_lens"][:size], context_lens=b["context_lens"][:size],
            block_table=b["block_table"][:size], slot_mapping=b["slot_mapping"][:size],
            block_size=self.block_size, query_start_loc_np=qsl, seq_lens_np=ones,
            context_lens_np=ones - 1, block_table_np=np.zeros((size, b.max_blocks), dtype=np.int32))

    def capture(self) -> None:
        """Capture every size, largest first (the pool's first allocation is its largest);
        records ``capture_seconds`` and ``capture_bytes`` (device memory the graphs hold)."""
        if self.reason is not None:
            return
        t0 = time.perf_counter()
        mem0 = torch.cuda.memory_reserved() if torch.cuda.is_available() else 0
        b = self.buffers
        for size in sorted(self.sizes, reverse=True):
            self._load_padding(0, size)
            md = self.build_metadata(self._common(size))

            def fn(size=size, md=md):
                with set_forward_context(md):
                    return self.forward(b["input_ids"][:size], b["positions"][:size])
            fn()     # warm-up: kernels compiled and autotuned outside the capture
            self.captured[size] = self.graphs.capture(fn)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self.capture_bytes = torch.cuda.memory_reserved() - mem0
        self.capture_seconds = time.perf_counter() - t0

    def run(self, input_ids, positions, common, attn_metadata) -> torch.Tensor | None:
        """Replay the graph for a decode-only step whose inputs are in the buffers' heads;
        None (run eagerly) otherwise."""
        B = common.num_reqs
        if not self.captured or common.num_decodes != B or input_ids.data_ptr() != self.buffers["input_ids"].data_ptr():
            return None
        size = padded_size(self.sizes, B)
        if size is None:
            return None
        self._load_padding(B, size)
        graph, out = self.captured[size]
        self.graphs.replay(graph)
        return out[:B]

    def compute_path(self) -> tuple[str, str]:
        if self.reason is not None:
            return ("decoder", f"eager ({self.reason})")
        if not self.captured:
            return ("decoder", "eager (CUDA graphs not captured yet)")
        return ("decoder", f"CUDA graphs for decode batches of {len(self.sizes)} sizes up to {max(self.sizes)} "
                           f"(captured in {self.capture_seconds:.1f} s, {self.capture_bytes / 2**20:.0f} MiB)")
