"""CUDA-graph bookkeeping without a GPU (``worker/cuda_graph.py``): the capture sizes, padding
a decode batch to the next size, the persistent buffers reused at one address, padding rows
rewritten when a request leaves, and which steps replay. A fake graph implementation re-runs
the captured function on replay and writes into the captured output, as a real replay
writes into its static output; the "model" reports what it read from the buffers."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pagedllm.attention.backend import build_common_metadata
from pagedllm.config import EngineArgs
from pagedllm.forward_context import get_forward_context
from pagedllm.worker.cuda_graph import CudaGraphStep, capture_sizes, padded_size
from pagedllm.worker.input_buffers import InputBuffers

BS = 16


class RerunGraphs:
    """Capture runs the function once; replay runs it again into the captured output."""

    def __init__(self):
        self.captured, self.replayed = [], []

    def capture(self, fn):
        out = fn()
        self.captured.append(out.shape[0])
        return (fn, out), out

    def replay(self, graph):
        fn, out = graph
        out.copy_(fn())
        self.replayed.append(out.shape[0])


def reads(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Per row what a decode step reads: token, position, seq_len, slot, query start, block 0."""
    md = get_forward_context().attn_metadata
    return torch.stack([ids.double(), pos.double(), md.seq_lens.double(), md.slot_mapping.double(),
                        md.query_start_loc[:-1].double(), md.block_table[:, 0].double()], 1)


def _step(buffers, ctx, q_lens, tables, ids):
    """Stage one step as the runner does: (ids, positions, common) over the buffers."""
    ctx, q_lens = np.asarray(ctx, dtype=np.int64), np.asarray(q_lens, dtype=np.int64)
    bt = np.asarray(tables, dtype=np.int32)
    common, pos, _ = build_common_metadata(ctx, q_lens, bt, BS, torch.device("cpu"), buffers)
    return buffers.stage("input_ids", np.asarray(ids, dtype=np.int64)), buffers.stage("positions", pos), common


@pytest.fixture
def graphs():
    buffers = InputBuffers(64, 20, 8, torch.device("cpu"))
    fake = RerunGraphs()
    step = CudaGraphStep(reads, buffers, lambda common: common, BS, capture_sizes(20), fake)
    step.capture()
    return step, buffers, fake


def test_capture_sizes_and_padding():
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert capture_sizes(50) == [1, 2, 4, 8, 16, 32, 48, 50]
    assert capture_sizes(256)[-3:] == [224, 240, 256] and len(capture_sizes(256)) == 4 + 16
    sizes = capture_sizes(50)
    assert [padded_size(sizes, n) for n in (1, 3, 5, 9, 17, 33, 49, 50, 51)] == [1, 4, 8, 16, 32, 48, 50, 50, None]


def test_captures_every_size_largest_first(graphs):
    step, _, fake = graphs
    assert fake.captured == [20, 16, 8, 4, 2, 1]
    assert sorted(step.captured) == [1, 2, 4, 8, 16, 20]
    assert "6 sizes up to 20" in step.compute_path()[1]


def test_replay_pads_to_the_next_size_and_matches_eager(graphs):
    step, buffers, fake = graphs
    ids, pos, common = _step(buffers, [4, 20, 35], [1, 1, 1], [[7, 0, 0], [3, 0, 0], [5, 9, 2]], [11, 12, 13])
    eager_md = common
    from pagedllm.forward_context import set_forward_context
    with set_forward_context(eager_md):
        want = reads(ids, pos)
    got = step.run(ids, pos, common, None)
    assert fake.replayed == [4]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert got.tolist() == [[11, 4, 5, 7 * BS + 4, 0, 7], [12, 20, 21, 0 * BS + 4, 1, 3], [13, 35, 36, 2 * BS + 3, 2, 5]]
    padding = step.captured[4][1][3].tolist()    # the static output's padding row
    assert padding == [0, 0, 1, -1, 3, 0]


def test_buffers_keep_their_address_and_padding_replaces_a_departed_request(graphs):
    step, buffers, fake = graphs
    ptr = {name: t.data_ptr() for name, t in buffers.buffers.items()}
    ids, pos, common = _step(buffers, [9, 9, 9, 40], [1] * 4, [[1, 0, 0], [2, 0, 0], [3, 0, 0], [4, 5, 6]], [1, 2, 3, 4])
    assert step.run(ids, pos, common, None).shape[0] == 4
    assert common.slot_mapping.data_ptr() == ptr["slot_mapping"] and ids.data_ptr() == ptr["input_ids"]
    # the fourth request leaves: three decodes pad to 4, and row 3 is padding, not its leftovers
    ids, pos, common = _step(buffers, [10, 10, 10], [1] * 3, [[1, 0, 0], [2, 0, 0], [3, 0, 0]], [5, 6, 7])
    got = step.run(ids, pos, common, None)
    assert fake.replayed == [4, 4]
    assert got[:, 0].tolist() == [5, 6, 7]
    assert buffers["slot_mapping"][3].item() == -1 and buffers["seq_lens"][3].item() == 1
    assert buffers["block_table"][3, 0].item() == 0 and buffers["input_ids"][3].item() == 0
    assert step.captured[4][1][3].tolist() == [0, 0, 1, -1, 3, 0]
    assert {name: t.data_ptr() for name, t in buffers.buffers.items()} == ptr


def test_steps_that_run_eagerly(graphs):
    step, buffers, fake = graphs
    # a prompt chunk beside a decode
    ids, pos, common = _step(buffers, [5, 0], [1, 6], [[1], [2]], list(range(7)))
    assert step.run(ids, pos, common, None) is None
    # inputs not in the persistent buffers (a step too large for them)
    common = _step(buffers, [5], [1], [[1]], [3])[2]
    assert step.run(torch.tensor([3]), torch.tensor([5]), common, None) is None
    assert fake.replayed == []


def test_a_batch_larger_than_every_size_runs_eagerly():
    buffers = InputBuffers(64, 40, 4, torch.device("cpu"))
    step = CudaGraphStep(reads, buffers, lambda c: c, BS, capture_sizes(20), RerunGraphs())
    step.capture()
    ids, pos, common = _step(buffers, [3] * 21, [1] * 21, [[1]] * 21, list(range(21)))
    assert step.run(ids, pos, common, None) is None


def _runner(**args):
    attn = SimpleNamespace(cudagraph_support=True, name="triton")
    return SimpleNamespace(config=SimpleNamespace(args=EngineArgs(**args), arch=SimpleNamespace(num_experts=0)),
                           attn=attn, attn_groups=[(0, None)],
                           proposer=None, model=None, input_buffers=InputBuffers(8, 4, 2, torch.device("cpu")),
                           metadata_for_graph=lambda c: c, block_size=BS)


@pytest.mark.parametrize("change,reason", [
    (lambda r: None, None),
    (lambda r: setattr(r.config.args, "enforce_eager", True), "--enforce-eager"),
    (lambda r: setattr(r.attn, "cudagraph_support", False), "attention backend cannot be captured"),
    (lambda r: setattr(r, "attn_groups", [(0, None), (1, 512)]), "several KV-cache groups"),
    (lambda r: setattr(r, "proposer", SimpleNamespace(is_model=True)), "a draft model"),
    (lambda r: setattr(r.config.arch, "num_experts", 8), "mixture-of-experts"),
])
def test_why_a_runner_runs_eagerly(monkeypatch, change, reason):
    import pagedllm.worker.cuda_graph as cg

    monkeypatch.setattr(cg, "TorchCudaGraphs", RerunGraphs)     # no CUDA here
    r = _runner(max_num_seqs=4)
    change(r)
    step = CudaGraphStep.for_runner(r)
    if reason is None:
        assert step.reason is None and step.sizes == [1, 2, 4]
    else:
        assert reason in step.reason and reason in step.compute_path()[1]


def test_input_buffers_stage_views_at_fixed_addresses():
    b = InputBuffers(8, 3, 4, torch.device("cpu"))
    v = b.stage("block_table", np.array([[1, 2], [3, 4]], dtype=np.int32))
    assert v.tolist() == [[1, 2], [3, 4]] and v.data_ptr() == b["block_table"].data_ptr()
    assert b.fits(8, 3, 4) and not b.fits(9, 3, 4) and not b.fits(8, 4, 4) and not b.fits(8, 3, 5)
    with pytest.raises(ValueError, match="slot_mapping"):
        b.stage("slot_mapping", np.zeros(9, dtype=np.int64))
    assert b["slot_mapping"].tolist() == [-1] * 8     # nothing written is a slot to skip
