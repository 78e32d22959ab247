"""``bench sweep`` finds the knee of a fake server whose latency is a known function of load.

The fake server has ``capacity`` slots; each request holds one for
S = prefill + (output_len - 1) * itl seconds. Closed loop with concurrency
c <= capacity: TTFT ~= prefill (50 ms). Above capacity requests queue for about
one service time, so TTFT ~= prefill + S (~= 170 ms here). The SLO (p99 TTFT
<= 110 ms) sits ~60 ms from both sides, so the knee is exactly the capacity.
"""

import json

import pytest
from bench_helpers import check_png, run_cli

from pagedllm.benchmarks.sweep import best_load, cost_at, evaluate_point, parse_loads

# timing-sensitive: run alone, after the parallel part of `make test`
pytestmark = pytest.mark.serial

LAT = dict(prefill_s=0.05, itl_s=0.03)  # S = 0.05 + 4 * 0.03 = 0.17 s with --output-len 5
COMMON = ["--input-len", "8", "--output-len", "5", "--slo", "ttft:110", "--quiet"]


def test_concurrency_sweep_finds_knee_and_cost(fake_server, tmp_path, capsys):
    srv = fake_server(capacity=4, **LAT)
    out = tmp_path / "sweep.json"
    rc = run_cli(["bench", "sweep", "--base-url", srv.url, "--concurrencies", "1,2,4,8", "--num-prompts", "8",
                  "--refine", "1", "--cost-per-hour", "3.6", "--save-result", str(out),
                  "--plot", str(tmp_path / "plots"), *COMMON])
    assert rc == 0
    text = capsys.readouterr().out
    assert "highest load meeting the SLO = 4 concurrent sessions" in text
    sw = json.loads(out.read_text())["sweeps"][0]
    loads = [p["load"] for p in sw["points"]]
    assert loads == [1, 2, 4, 6, 8]  # 6 is the refinement between 4 (pass) and 8 (fail)
    assert [p["meets_slo"] for p in sw["points"]] == [True, True, True, False, False]
    assert sw["best_load"] == 4 and sw["best_point"]["load"] == 4
    p8 = sw["points"][-1]
    assert p8["latency_ms"]["ttft"]["p99"] > 140 and "ttft p99" in p8["violations"][0]
    assert sw["points"][2]["latency_ms"]["ttft"]["p99"] < 100
    # throughput grows with concurrency up to capacity
    tp = [p["request_throughput"] for p in sw["points"]]
    assert tp[0] < tp[1] < tp[2]
    # cost: $3.6/h = $0.001/s -> $/1M tok = 0.001 / tok_per_s * 1e6
    bp = sw["best_point"]
    assert sw["cost_per_1m_output_tokens_usd"] == pytest.approx(1000.0 / bp["output_token_throughput"])
    assert sw["cost_per_1k_requests_usd"] == pytest.approx(1.0 / bp["request_throughput"])
    for name in ("sweep_throughput.png", "sweep_latency.png"):
        check_png(tmp_path / "plots" / name)


def test_rate_sweep_finds_knee(fake_server, tmp_path):
    # capacity 4 / S 0.17 s -> ~23.5 req/s; near-regular arrivals (burstiness 50).
    srv = fake_server(capacity=4, **LAT)
    out = tmp_path / "sweep.json"
    rc = run_cli(["bench", "sweep", "--base-url", srv.url, "--request-rates", "4,10,80", "--num-prompts", "10",
                  "--burstiness", "50", "--save-result", str(out), *COMMON])
    assert rc == 0
    sw = json.loads(out.read_text())["sweeps"][0]
    assert [p["meets_slo"] for p in sw["points"]] == [True, True, False]
    assert sw["best_load"] == 10 and sw["mode"] == "rate"
    assert sw["points"][2]["request_throughput"] < 80


def test_compare_two_servers(fake_server, tmp_path, capsys):
    a, b = fake_server(capacity=2, **LAT), fake_server(capacity=1, **LAT)
    out = tmp_path / "cmp.json"
    rc = run_cli(["bench", "sweep", "--base-url", a.url, "--compare", b.url, "--labels", "cache-on,cache-off",
                  "--concurrencies", "1,2,3", "--num-prompts", "4", "--save-result", str(out),
                  "--plot", str(tmp_path / "p"), *COMMON])
    assert rc == 0
    text = capsys.readouterr().out
    assert "[cache-on]" in text and "[cache-off]" in text
    sweeps = json.loads(out.read_text())["sweeps"]
    assert [s["label"] for s in sweeps] == ["cache-on", "cache-off"]
    assert sweeps[0]["best_load"] == 2 and sweeps[1]["best_load"] == 1
    assert [p["load"] for p in sweeps[1]["points"]] == [1, 2]  # early stop after the first failure
    check_png(tmp_path / "p" / "sweep_latency.png")


def test_sweep_helpers():
    assert parse_loads("1,2.5,4", "--request-rates", integer=False) == [1.0, 2.5, 4.0]
    assert parse_loads("1,2,8", "--concurrencies", integer=True) == [1, 2, 8]
    for bad in ("2,1", "0,1", "a", "", "1,inf"):
        with pytest.raises(ValueError, match="--request-rates"):
            parse_loads(bad, "--request-rates", integer=False)
    with pytest.raises(ValueError, match="integers"):
        parse_loads("1.5", "--concurrencies", integer=True)
    pts = [{"load": 1, "meets_slo": True}, {"load": 2, "meets_slo": False}, {"load": 4, "meets_slo": True}]
    assert best_load(pts) == 1  # a pass after a failure is not trusted
    assert best_load([{"load": 1, "meets_slo": False}]) is None
    assert cost_at({"output_token_throughput": 1000.0, "request_throughput": 2.0}, 36.0) == {
        "cost_per_hour_usd": 36.0, "cost_per_1m_output_tokens_usd": pytest.approx(10.0),
        "cost_per_1k_requests_usd": pytest.approx(5.0)}
    summ = {"completed": 10, "error_rate": 0.1, "ttft_ms": {"p99": 90.0, "p90": 50.0}, "tpot_ms": {"p99": None}}
    assert evaluate_point(summ, {"ttft": 100, "tpot": 10}, 99, 0.2) == (True, [])
    ok, why = evaluate_point(summ, {"ttft": 80}, 99, 0.0)
    assert not ok and len(why) == 2
    assert evaluate_point(summ, {"ttft": 80}, 90, 0.5)[0]
