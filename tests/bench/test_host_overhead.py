"""``pagedllm bench host-overhead``: it runs (its engine in process, so that it can time the
model module) and its medians add up: step = forward + logits + host."""
from __future__ import annotations


def test_host_overhead_runs_and_splits_the_step():
    from pagedllm.benchmarks.host_overhead import measure

    r = measure(num_requests=4, input_len=8, output_len=6)
    assert r["num_requests"] == 4 and r["decode_steps"] >= 3
    assert r["step_ms"] > 0 and r["forward_ms"] > 0 and r["logits_ms"] > 0 and r["host_ms"] > 0
    # medians of per-step sums: within rounding and the spread of the three medians
    assert r["forward_ms"] + r["logits_ms"] < r["step_ms"] * 1.5
