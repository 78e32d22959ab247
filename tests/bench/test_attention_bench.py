"""``pagedllm bench attention``: one run over several KV-cache dtypes reports each one's
per-layer and per-step time, the K/V bytes a layer reads in that dtype, and the backend
that computed it."""
from __future__ import annotations

import json

import pytest


def test_attention_bench_report(tmp_path, capsys):
    from pagedllm.entrypoints.cli import build_parser

    out = tmp_path / "attn.json"
    args = build_parser().parse_args([
        "bench", "attention", "--kv-cache-dtypes", "float32,bfloat16,fp8_e4m3,fp8_e5m2", "--num-requests", "4",
        "--context-len", "40", "--cache-layers", "2", "--iters", "1", "--num-layers", "30",
        "--output-json", str(out)])
    assert args.func(args) == 0
    rep = json.loads(out.read_text())
    assert rep["machine"]["cpu"]
    runs = {r["kv_cache_dtype"]: r for r in rep["runs"]}
    assert list(runs) == ["float32", "bfloat16", "float8_e4m3fn", "float8_e5m2"]
    # K and V of 4 requests x 41 tokens x 3 kv heads x 64 dims, at 4, 2, 1, 1 bytes
    assert [r["kv_bytes_per_layer"] for r in runs.values()] == [2 * 4 * 41 * 3 * 64 * b for b in (4, 2, 1, 1)]
    for r in runs.values():
        assert 0 < r["layer_ms_min"] <= r["layer_ms"]
        assert r["step_ms"] == pytest.approx(30 * r["layer_ms"], abs=0.01)
    assert "C++ paged attention, float32, float8_e4m3fn KV cache" in runs["float8_e4m3fn"]["backend"]
    assert "ms/step x30" in capsys.readouterr().out


def test_contiguous_blocks_follow_one_another():
    from pagedllm.benchmarks.attention import _decode_metadata

    common, n = _decode_metadata(3, 40, 16, seed=0, contiguous=True)
    assert n == 9 and common.block_table_np.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    scattered, _ = _decode_metadata(3, 40, 16, seed=0)
    assert sorted(scattered.block_table_np.ravel().tolist()) == list(range(9))
    assert scattered.block_table_np.tolist() != common.block_table_np.tolist()


def test_attention_bench_rejects_unknown_dtype():
    from pagedllm.entrypoints.cli import build_parser

    args = build_parser().parse_args(["bench", "attention", "--kv-cache-dtypes", "float32,int4"])
    with pytest.raises(ValueError, match="--kv-cache-dtypes"):
        args.func(args)
