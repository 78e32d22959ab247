"""``pagedllm bench latency`` on the bundled model: the figures it reports are consistent
with each other and with the workload, and the matmul split is measured, not assumed."""
from __future__ import annotations

import json
import os

import pytest
import torch

from pagedllm.benchmarks.latency import matmul_seconds_per_step
from pagedllm.models.arch_config import ModelArchConfig


@pytest.mark.slow
def test_latency_report(tmp_path, capsys):
    out = tmp_path / "lat.json"
    from pagedllm.entrypoints.cli import build_parser

    args = build_parser().parse_args(["bench", "latency", "--input-len", "20", "--output-len", "5", "--num-iters", "1",
                  "--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "256",
                  "--output-json", str(out)])
    assert args.func(args) == 0
    rep = json.loads(out.read_text())
    assert rep["machine"]["cpu"] and rep["batch_size"] == 1 and rep["output_len"] == 5
    (r,) = rep["results"]
    assert r["backend"] == "pagedllm" and r["dtype"] == "float32" and r["kv_cache_dtype"] == "float32"
    assert r["decode_ms_per_step"] > 0 and r["ttft_s"] > 0
    # 4 decode steps after the first token, one request
    assert abs(r["decode_tokens_per_s"] - 4 / r["decode_s"]) <= 0.1 + 0.01 * r["decode_tokens_per_s"]
    assert abs(r["decode_ms_per_step"] - 1e3 * r["decode_s"] / 4) < 0.2    # decode_s is rounded to 1 ms
    assert 0 < r["matmul_ms_per_step"]
    assert abs(r["matmul_ms_per_step"] + r["other_ms_per_step"] - r["decode_ms_per_step"]) < 0.02
    shown = capsys.readouterr().out
    assert "ms/step = matmuls" in shown and "float32, KV cache float32 | TTFT" in shown


def test_matmul_time_grows_with_the_model():
    """Twice the layers of the same shapes take clearly longer (each layer has its own
    weights), and the LM head counts."""
    def arch(layers, vocab=4096):
        return ModelArchConfig(architecture="LlamaForCausalLM", vocab_size=vocab, hidden_size=512,
                               intermediate_size=2048, num_hidden_layers=layers, num_attention_heads=8,
                               num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e4,
                               max_position_embeddings=512)
    cpu = torch.device("cpu")
    t2 = matmul_seconds_per_step(arch(2), torch.float32, cpu, rows=4)
    t8 = matmul_seconds_per_step(arch(8), torch.float32, cpu, rows=4)
    assert t8 > 2 * t2 > 0


def test_hf_baseline_loads_a_hf_directory(tiny_model_dir):
    """The HF side of ``--backend both`` (shared by bench throughput and bench latency)
    loads a HF directory in the dtype ``--dtype`` resolves to, and generates."""
    import argparse

    from pagedllm.benchmarks.throughput import load_hf_model

    path = tiny_model_dir("llama", std=None, tokenizer=None, vocab_size=512, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=128)
    args = argparse.Namespace(model=path, device="cpu", dtype="auto")
    model, dtype, device = load_hf_model(args)
    assert dtype == torch.float32 or dtype == torch.bfloat16    # auto: what this CPU runs best
    assert next(model.parameters()).dtype == dtype and device.type == "cpu"
    out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, min_new_tokens=2, do_sample=False,
                         pad_token_id=0)
    assert out.shape == (1, 5)


def test_mm_reference_stays_within_its_budget():
    """A slow dtype (bf16 on CPUs without bf16 arithmetic) must not cost minutes: the size
    shrinks and timing stops at the budget."""
    import time

    from pagedllm.benchmarks.throughput import measure_mm_gflops

    t = time.perf_counter()
    rate = measure_mm_gflops(dtype=torch.bfloat16, budget_s=1.0)
    assert rate > 0 and time.perf_counter() - t < 15
    assert measure_mm_gflops(n=256, repeats=2) > 0


def test_llama_cpp_baseline_refuses_clearly(monkeypatch):
    """``--backend llama.cpp`` needs llama-cpp-python, a .gguf model and one sequence; each
    missing piece is a ValueError saying which (never a traceback from deep inside)."""
    import sys

    import pytest

    from pagedllm.benchmarks.latency import run_llama_cpp
    from pagedllm.entrypoints.cli import build_parser

    args = build_parser().parse_args(["bench", "latency", "--backend", "llama.cpp", "--batch-size", "2"])
    monkeypatch.setitem(sys.modules, "llama_cpp", None)     # import fails as if not installed
    with pytest.raises(ValueError, match="llama-cpp-python"):
        run_llama_cpp(args, [[1, 2], [3, 4]])
    monkeypatch.setitem(sys.modules, "llama_cpp", object())
    with pytest.raises(ValueError, match="--batch-size 1"):
        run_llama_cpp(args, [[1, 2], [3, 4]])


def test_rounds_take_the_backends_in_turn_and_keep_each_best():
    """``best_runs``: round by round, each backend runs num_iters times before the next
    (all loaded at once); each backend's best run is its least decode time over all
    rounds; the per-round figures are each round's best; every generator is closed."""
    from pagedllm.benchmarks.latency import best_runs

    calls, closed = [], []

    def fake(name, decode_times):
        try:
            for d in decode_times:
                calls.append(name)
                yield {"backend": name, "decode_s": d, "decode_tokens_per_s": round(10 / d, 1)}
        finally:
            closed.append(name)

    best, per_round = best_runs([fake("a", [2.0, 1.0, 4.0, 5.0]), fake("b", [1.0, 3.0, 0.5, 2.5])], 2, 2)
    assert calls == ["a", "a", "b", "b", "a", "a", "b", "b"]
    assert [b["decode_s"] for b in best] == [1.0, 0.5]
    assert per_round == [[10.0, 10.0], [2.5, 20.0]]
    assert sorted(closed) == ["a", "b"]


@pytest.mark.slow
def test_latency_rounds_report(tmp_path, capsys):
    """--rounds 2 with two pagedllm backends loaded at once: two rounds of figures and a
    ratio per round in the report."""
    out = tmp_path / "lat.json"
    from pagedllm.entrypoints.cli import build_parser

    args = build_parser().parse_args(["bench", "latency", "--backend", "pagedllm", "pagedllm", "--rounds", "2",
                                      "--input-len", "16", "--output-len", "4", "--num-iters", "1",
                                      "--dtype", "float32", "--kv-cache-memory", "32MiB", "--max-model-len", "128",
                                      "--output-json", str(out)])
    assert args.func(args) == 0
    rep = json.loads(out.read_text())
    assert rep["rounds"] == 2 and len(rep["decode_tokens_per_s_by_round"]) == 2
    assert all(len(row) == 2 and min(row) > 0 for row in rep["decode_tokens_per_s_by_round"])
    for i, r in enumerate(rep["results"]):
        assert r["decode_tokens_per_s"] == max(row[i] for row in rep["decode_tokens_per_s_by_round"])
    assert "(by round: " in capsys.readouterr().out


def test_busy_neighbours_are_timed_beside_and_stopped(monkeypatch):
    """``--busy-neighbours``: medians of the quiet runs and of the runs beside the busy
    processes, which are running during the second set and stopped afterwards."""
    from pagedllm.benchmarks import latency

    started, real_start = [], latency.start_busy_neighbours

    def start(n, seconds=900.0):
        started.extend(real_start(n, 30.0))    # a short bound should the test die
        return started

    monkeypatch.setattr(latency, "start_busy_neighbours", start)
    rates = iter([100.0, 90.0, 110.0, 40.0, 60.0, 50.0])
    seen_running = []

    def runner():
        while True:
            if started:
                seen_running.append(all(p.poll() is None for p in started))
            yield {"backend": "pagedllm", "decode_tokens_per_s": next(rates)}

    r = latency.neighbour_runs(runner(), 2, 3)
    assert r["quiet_decode_tokens_per_s"] == 100.0 and r["busy_decode_tokens_per_s"] == 50.0
    assert r["busy_over_quiet"] == 0.5 and r["busy_runs"] == [40.0, 60.0, 50.0]
    assert len(started) == 2 and seen_running == [True, True, True]
    assert all(p.poll() is not None for p in started)


def test_busy_neighbours_stop_when_their_parent_dies():
    """A bench killed by SIGKILL/SIGTERM cannot stop its busy processes: they notice."""
    import subprocess
    import sys
    import time

    code = ("from pagedllm.benchmarks.latency import start_busy_neighbours\n"
            "import time\nprocs = start_busy_neighbours(1, 60.0)\nprint(procs[0].pid, flush=True)\ntime.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(pid, 9)
    raise AssertionError("the busy neighbour outlived its parent")
