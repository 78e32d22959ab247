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


def test_names_of_one_cache_type_run_once(tmp_path, capsys):
    """fp8 is fp8_e4m3, and auto is the model's dtype: each type is timed once, under the
    first name given."""
    from pagedllm.entrypoints.cli import build_parser

    out = tmp_path / "attn.json"
    args = build_parser().parse_args([
        "bench", "attention", "--kv-cache-dtypes", "fp8,float32,fp8_e4m3,auto", "--num-requests", "2",
        "--context-len", "20", "--cache-layers", "1", "--iters", "1", "--output-json", str(out)])
    assert args.func(args) == 0
    assert [r["kv_cache_dtype"] for r in json.loads(out.read_text())["runs"]] == ["float8_e4m3fn", "float32"]
    assert "fp8_e4m3, auto name a cache type already listed" in capsys.readouterr().out


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


@pytest.mark.slow
def test_against_a_revision_builds_that_kernel_and_compares_in_turn(tmp_path, capsys):
    """``--against HEAD``: the kernel at HEAD, built apart, against this tree's on the same
    caches (bitwise equal outputs when the kernel files are unchanged since HEAD)."""
    import subprocess

    from pagedllm.entrypoints.cli import build_parser
    from pagedllm.kernels.cpu import load_cpu_kernels

    if load_cpu_kernels() is None:
        pytest.skip("no C++ kernels here")
    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    if subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    changed = subprocess.run(["git", "-C", str(root), "diff", "--quiet", "HEAD", "--", "pagedllm/kernels/csrc"],
                             capture_output=True).returncode != 0
    out = tmp_path / "ab.json"
    args = build_parser().parse_args([
        "bench", "attention", "--against", "HEAD", "--kv-cache-dtypes", "float32,bfloat16", "--num-requests", "4",
        "--context-len", "40", "--cache-layers", "2", "--iters", "2", "--output-json", str(out)])
    assert args.func(args) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["kv_cache_dtype"] for r in runs] == ["float32", "bfloat16"]
    for r in runs:
        assert r["reference"] == "HEAD" and r["layer_ms"] > 0 and r["reference_layer_ms"] > 0
        # (the ms are rounded to 0.001: at these tiny shapes that moves the ratio a little)
        assert r["speedup"] == pytest.approx(r["reference_layer_ms"] / r["layer_ms"], rel=0.1)
        assert r["bitwise_equal"] or changed
    assert "HEAD" in capsys.readouterr().out


def test_against_compares_a_kernel_with_itself_as_equal():
    from pagedllm.benchmarks.attention import measure_against
    from pagedllm.kernels.cpu import load_cpu_kernels

    k = load_cpu_kernels()
    if k is None:
        pytest.skip("no C++ kernels here")
    (r,) = measure_against(k, "same", ["bfloat16"], num_requests=3, context_len=33, cache_layers=2, iters=2)
    assert r["kv_cache_dtype"] == "bfloat16" and r["bitwise_equal"] and r["speedup"] > 0


def test_against_an_unknown_revision_is_a_clear_error():
    from pagedllm.benchmarks.attention import kernel_at_revision

    with pytest.raises(ValueError, match="--against 'no-such-rev': git cannot read .* at that revision"):
        kernel_at_revision("no-such-rev")


def test_against_a_kernel_with_other_arguments_is_one_clear_line():
    """A revision whose paged_attention takes other arguments: one line, not pybind's dump
    of every tensor."""
    from pagedllm.benchmarks.attention import measure_against

    class Old:
        @staticmethod
        def paged_attention(*args):
            raise TypeError("paged_attention(): incompatible function arguments. The following argument types "
                            "are supported:\n    1. (arg0: at::Tensor, ...) -> None\n\nInvoked with: tensor(...)")

    if __import__("pagedllm.kernels.cpu", fromlist=["x"]).load_cpu_kernels() is None:
        pytest.skip("no C++ kernels here")
    with pytest.raises(ValueError) as e:
        measure_against(Old(), "old", ["float32"], num_requests=2, context_len=17, cache_layers=1, iters=1)
    assert "takes other arguments" in str(e.value) and "\n" not in str(e.value) and "Invoked" not in str(e.value)


@pytest.mark.parametrize("extra, words", [(["--against", " "], "needs a git revision"),
                                          (["--against", "HEAD", "--attention-backend", "torch"], "does not apply")])
def test_against_refuses_what_it_cannot_honour(extra, words):
    """An empty revision ran the plain bench, and another backend was ignored: both are errors."""
    from pagedllm.entrypoints.cli import build_parser

    args = build_parser().parse_args(["bench", "attention", *extra])
    with pytest.raises(ValueError, match=words):
        args.func(args)
