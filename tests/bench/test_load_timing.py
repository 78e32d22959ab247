"""Arrival process and replay timing.

Stated tolerance: each request is sent within 30 ms of its scheduled time and the median
lateness is under 10 ms (the suite runs on 2 shared CPU cores), except that one or two
neighbouring requests may start late on their own: a full serial run once had one
request 0.31 s late and every other one on time, a stall of that request's own start
(its task or connection), not of the limiter, since a stalled limiter would have made
every request due during those 0.31 s (about 12 at 40 req/s) late. Up to four
neighbours may be late when the requests after them are on time again (a short stall of
the whole VM). A limiter that lets lateness accumulate makes all later requests late,
and still fails.
"""

import asyncio
import itertools
import json
import math

import numpy as np
import pytest

from pagedllm.benchmarks.datasets import RandomDataset, TokenSource
from pagedllm.benchmarks.traces import TraceDataset
from pagedllm.benchmarks.runner import arrival_intervals, iter_arrival_offsets, run_benchmark
from pagedllm.benchmarks.serve_options import BenchConfig

# timing-sensitive: run alone, after the parallel part of `make test`
pytestmark = pytest.mark.serial

MAX_LATE_S = 0.030
MEDIAN_LATE_S = 0.010


def test_gamma_intervals_statistics():
    rng = np.random.default_rng(0)
    gaps = arrival_intervals(20000, rate=10.0, burstiness=1.0, rng=rng)
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # Poisson: CV 1
    gaps = arrival_intervals(20000, rate=10.0, burstiness=4.0, rng=rng)
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(0.5, rel=0.05)  # CV 1/sqrt(4)
    gaps = arrival_intervals(20000, rate=10.0, burstiness=0.25, rng=rng)
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.08)
    assert not arrival_intervals(5, math.inf, 1.0, rng).any()
    with pytest.raises(ValueError):
        arrival_intervals(5, 0.0, 1.0, rng)
    offs = list(itertools.islice(iter_arrival_offsets(5.0, 1.0, seed=3), 600))
    assert offs[0] == 0.0 and all(b >= a for a, b in zip(offs, offs[1:]))
    assert offs[-1] / 599 == pytest.approx(0.2, rel=0.1)


def lateness(res):
    return [r["start_s"] - r["scheduled_s"] for r in res["requests"]]


def test_rate_limiter_keeps_schedule(fake_server):
    srv = fake_server(prefill_s=0.001, itl_s=0.001)
    cfg = BenchConfig(base_url=srv.url, request_rate=40.0, num_prompts=20, seed=7, quiet=True)
    ds = RandomDataset(TokenSource(None), input_len=8, output_len=1)
    # one request first, so that first-use costs (lazy imports, the first connection)
    # are paid before the timed schedule: on a busy 2-core machine they once held the
    # event loop for 0.23 s and made the first requests late
    asyncio.run(run_benchmark(BenchConfig(base_url=srv.url, request_rate=40.0, num_prompts=1, seed=7,
                                          quiet=True), ds))
    srv.stats.requests.clear()
    res = asyncio.run(run_benchmark(cfg, ds))
    expected = list(itertools.islice(iter_arrival_offsets(40.0, 1.0, seed=7), 20))
    got = [r["scheduled_s"] for r in res["requests"]]
    assert got == pytest.approx(expected, abs=1e-5)
    late = np.array(lateness(res))
    assert late.min() >= 0 and np.median(late) < MEDIAN_LATE_S
    _at_most_one_stall(late > MAX_LATE_S)
    assert res["summary"]["completed"] == 20 and len(srv.stats.requests) == 20
    # The server saw them with the same gaps (within the tolerance).
    # (against the median offset, so that a late first request does not shift them all)
    dev = np.array([r["arrival"] for r in srv.stats.requests]) - np.array(expected)
    _at_most_one_stall(np.abs(dev - np.median(dev)) > MAX_LATE_S)


def _at_most_one_stall(late: np.ndarray) -> None:
    """``late`` (bool per request, in schedule order) is True for one run of neighbours at
    most: one stall, the schedule kept around it (lateness that accumulates makes every
    later request late). The run is at most 2 requests, or up to 4 when requests after it
    are on time again: a clean CI run once had requests 3-5 late at 40 req/s, a stall of
    the whole VM for ~0.06 s that the limiter recovered from at once."""
    idx = np.flatnonzero(late)
    if len(idx) == 0:
        return
    one_run = idx[-1] - idx[0] + 1 == len(idx)
    recovered = len(idx) <= 2 or (len(idx) <= 4 and idx[-1] < len(late) - 1)
    assert one_run and recovered, f"late requests: {idx.tolist()} of {len(late)}"


def test_trace_replay_timing(fake_server, tmp_path):
    srv = fake_server(prefill_s=0.001, itl_s=0.001)
    ts = [0.0, 0.05, 0.10, 0.30, 0.32, 0.60]
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(json.dumps({"timestamp": 1000 + t, "prompt_len": 4, "output_len": 2}) for t in ts))
    ds = TraceDataset(TokenSource(None), str(p), speedup=2.0)
    cfg = BenchConfig(base_url=srv.url, quiet=True, request_rate=3.0)  # rate is ignored for traces
    res = asyncio.run(run_benchmark(cfg, ds))
    assert res["summary"]["num_requests"] == len(ts) == len(srv.stats.requests)
    starts = [r["start_s"] for r in res["requests"]]
    want = [t / 2.0 for t in ts]
    assert [r["scheduled_s"] for r in res["requests"]] == pytest.approx(want, abs=1e-6)
    assert max(abs(s - w) for s, w in zip(starts, want)) < MAX_LATE_S
    assert res["summary"]["duration_s"] >= want[-1]


def test_max_concurrency_bounds_in_flight(fake_server):
    srv = fake_server(prefill_s=0.02, itl_s=0.005)
    cfg = BenchConfig(base_url=srv.url, num_prompts=10, max_concurrency=3, quiet=True)
    res = asyncio.run(run_benchmark(cfg, RandomDataset(TokenSource(None), 8, 3)))
    assert srv.stats.max_in_flight == 3
    assert res["summary"]["peak_in_flight"] == 3
    assert res["summary"]["client_wait_ms"]["max"] > 20  # later requests waited on the client


def test_duration_mode_stops_issuing(fake_server):
    srv = fake_server(prefill_s=0.001, itl_s=0.001)
    cfg = BenchConfig(base_url=srv.url, request_rate=30.0, duration_s=0.5, quiet=True, seed=1)
    res = asyncio.run(run_benchmark(cfg, RandomDataset(TokenSource(None), 8, 2)))
    expected = [o for o in itertools.islice(iter_arrival_offsets(30.0, 1.0, 1), 200) if o < 0.5]
    assert res["summary"]["num_requests"] == len(expected)
    assert all(r["scheduled_s"] < 0.5 for r in res["requests"])
