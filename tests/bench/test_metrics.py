import pytest

from pagedllm.benchmarks.metrics import (
    RequestResult,
    compute_tpot,
    latency_stats,
    meets_slos,
    parse_prometheus_text,
    parse_slos,
    percentile,
    server_metrics_delta,
    summarize_results,
)


def req(i, ttft, e2e, out, prompt=10, success=True, itl=(), retries=0, error=None):
    r = RequestResult(request_id=i, success=success, ttft=ttft if success else None,
                      e2e=e2e if success else None, output_tokens=out if success else 0,
                      prompt_tokens=prompt, itl=list(itl), retries=retries, error=error)
    r.start_time = r.scheduled_time = 0.0
    r.end_time = e2e or 0.0
    return r


def test_percentile_linear_interpolation():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(1, 11)), 90) == pytest.approx(9.1)
    assert percentile(list(range(1, 11)), 99) == pytest.approx(9.91)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_latency_stats_in_ms():
    st = latency_stats([0.001, 0.002, 0.003, 0.004])
    assert st["count"] == 4
    assert st["mean"] == pytest.approx(2.5)
    assert st["median"] == pytest.approx(2.5)
    assert st["min"] == pytest.approx(1.0)
    assert st["max"] == pytest.approx(4.0)
    assert st["p90"] == pytest.approx(3.7)
    assert st["p99"] == pytest.approx(3.97)
    assert st["p50"] == pytest.approx(2.5)
    st = latency_stats([0.001], percentiles=(99.9,))
    assert st["p99_9"] == pytest.approx(1.0) and "p90" in st
    empty = latency_stats([])
    assert empty["count"] == 0 and empty["mean"] is None and empty["p99"] is None


def test_tpot_definition():
    assert compute_tpot(1.0, 0.1, 10) == pytest.approx(0.1)  # (1.0 - 0.1) / 9
    assert compute_tpot(0.5, 0.5, 2) == 0.0
    assert compute_tpot(1.0, 0.1, 1) is None
    assert compute_tpot(1.0, 0.1, 0) is None
    with pytest.raises(ValueError):
        compute_tpot(-1.0, 0.1, 5)
    r = req(0, ttft=0.2, e2e=1.2, out=11)
    assert r.tpot == pytest.approx(0.1)
    assert req(1, 0.2, 1.2, 11, success=False).tpot is None


def test_parse_slos():
    assert parse_slos(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    assert parse_slos(["e2el:1000,itl:20"]) == {"e2e": 1000.0, "itl": 20.0}
    assert parse_slos(None) == {}
    for bad, msg in (("ttft=500", "METRIC:MILLISECONDS"), ("foo:1", "unknown metric"),
                     ("ttft:abc", "not a number"), ("ttft:-5", "positive"), ("ttft:inf", "positive")):
        with pytest.raises(ValueError, match="--goodput") as ei:
            parse_slos([bad])
        assert msg in str(ei.value)
    with pytest.raises(ValueError, match="--slo"):
        parse_slos(["x:1"], flag="--slo")


def test_meets_slos_and_goodput():
    slos = {"ttft": 100.0, "tpot": 20.0}
    rs = [
        req(0, ttft=0.050, e2e=0.050 + 9 * 0.010, out=10),   # ttft 50, tpot 10 -> good
        req(1, ttft=0.150, e2e=0.150 + 9 * 0.010, out=10),   # ttft too high
        req(2, ttft=0.050, e2e=0.050 + 9 * 0.030, out=10),   # tpot 30 too high
        req(3, ttft=0.090, e2e=0.090, out=1),                # no TPOT -> counts as meeting
        req(4, ttft=0.010, e2e=0.5, out=10, success=False, error="HTTP 500: boom"),
    ]
    assert [meets_slos(r, slos) for r in rs] == [True, False, False, True, False]
    assert meets_slos(rs[0], {"e2e": 140.0}) and not meets_slos(rs[0], {"e2e": 139.0})
    r = req(5, 0.01, 0.1, 3, itl=[0.005, 0.025])
    assert not meets_slos(r, {"itl": 20.0}) and meets_slos(r, {"itl": 25.0})

    s = summarize_results(rs, duration_s=2.0, slos_ms=slos)
    assert s["good_requests"] == 2
    assert s["goodput"] == pytest.approx(1.0)  # 2 good / 2 s
    assert s["goodput_fraction"] == pytest.approx(2 / 5)


def test_summarize_counts_throughput_errors_retries():
    rs = [
        req(0, 0.1, 1.0, 10, prompt=100, itl=[0.1] * 9),
        req(1, 0.2, 2.0, 10, prompt=100, itl=[0.2] * 9, retries=2),
        req(2, 0.3, 3.0, 20, prompt=50),
        req(3, 0, 0, 0, success=False, error="timeout after 5 s", retries=1),
    ]
    s = summarize_results(rs, duration_s=4.0)
    assert s["num_requests"] == 4 and s["completed"] == 3 and s["failed"] == 1
    assert s["error_rate"] == pytest.approx(0.25)
    assert s["total_retries"] == 3 and s["requests_retried"] == 2
    assert s["retry_rate"] == pytest.approx(0.5)
    assert s["total_input_tokens"] == 250 and s["total_output_tokens"] == 40
    assert s["request_throughput"] == pytest.approx(0.75)
    assert s["input_token_throughput"] == pytest.approx(62.5)
    assert s["output_token_throughput"] == pytest.approx(10.0)
    assert s["total_token_throughput"] == pytest.approx(72.5)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["ttft_ms"]["max"] == pytest.approx(300.0)
    assert s["e2e_ms"]["median"] == pytest.approx(2000.0)
    # TPOT: 0.1, 0.2 and (3.0-0.3)/19
    assert s["tpot_ms"]["mean"] == pytest.approx((100 + 200 + 2700 / 19) / 3)
    assert s["itl_ms"]["count"] == 18 and s["itl_ms"]["mean"] == pytest.approx(150.0)
    assert s["client_prefill_share"] == pytest.approx(0.6 / 6.0)
    assert s["errors"] == {"timeout after 5 s": 1}
    assert s["goodput"] is None
    with pytest.raises(ValueError):
        summarize_results(rs, 0.0)


PROM_BEFORE = """# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{le="+Inf",model_name="m"} 2
vllm:request_queue_time_seconds_count{model_name="m"} 2
vllm:request_queue_time_seconds_sum{model_name="m"} 1.0
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_count{model_name="m"} 2
vllm:request_prefill_time_seconds_sum{model_name="m"} 1.0
# TYPE vllm:request_decode_time_seconds histogram
vllm:request_decode_time_seconds_count{model_name="m"} 2
vllm:request_decode_time_seconds_sum{model_name="m"} 2.0
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{model_name="m"} 1
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{model_name="m"} 100
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{model_name="m"} 10
# TYPE vllm:request_success_total counter
vllm:request_success_total{finished_reason="length",model_name="m"} 2
"""

PROM_AFTER = """# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{le="+Inf",model_name="m"} 6
vllm:request_queue_time_seconds_count{model_name="m"} 6
vllm:request_queue_time_seconds_sum{model_name="m"} 2.0
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_count{model_name="m"} 6
vllm:request_prefill_time_seconds_sum{model_name="m"} 3.0
# TYPE vllm:request_decode_time_seconds histogram
vllm:request_decode_time_seconds_count{model_name="m"} 6
vllm:request_decode_time_seconds_sum{model_name="m"} 9.0
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{model_name="m"} 4
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{model_name="m"} 300
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{model_name="m"} 60
# TYPE vllm:request_success_total counter
vllm:request_success_total{finished_reason="length",model_name="m"} 5
vllm:request_success_total{finished_reason="stop",model_name="m"} 1
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 0
"""


def test_prometheus_scrape_delta():
    b, a = parse_prometheus_text(PROM_BEFORE), parse_prometheus_text(PROM_AFTER)
    assert a["vllm:request_success_total"] == 6
    assert "vllm:request_queue_time_seconds_bucket" not in a
    d = server_metrics_delta(b, a)
    assert d["available"] is True
    assert d["queue_count"] == 4 and d["queue_sum_s"] == pytest.approx(1.0)
    assert d["queue_mean_ms"] == pytest.approx(250.0)
    assert d["prefill_mean_ms"] == pytest.approx(500.0)
    assert d["decode_mean_ms"] == pytest.approx(1750.0)
    # shares of queue + prefill + decode = 1 + 2 + 7 = 10 s
    assert d["queue_time_share"] == pytest.approx(0.1)
    assert d["prefill_time_share"] == pytest.approx(0.2)
    assert d["decode_time_share"] == pytest.approx(0.7)
    assert d["num_preemptions"] == 3
    assert d["prefix_cache_hit_rate"] == pytest.approx(50 / 200)
    assert d["requests_succeeded"] == 4
    assert d["finished_reasons"] == {"length": 3, "stop": 1}
    assert d["num_requests_running_after"] == 0
    # missing names -> None ("n/a"), never an exception
    assert d["ttft_mean_ms"] is None and d["prompt_tokens"] is None


def test_prometheus_unavailable_yields_none():
    d = server_metrics_delta(None, None)
    assert d["available"] is False
    assert all(v is None for k, v in d.items() if k != "available")
    d = server_metrics_delta({}, {})
    assert d["available"] is True and d["queue_time_share"] is None and d["prefix_cache_hit_rate"] is None


def test_spec_decode_acceptance_from_server_counters():
    before = parse_prometheus_text(
        'vllm:spec_decode_num_drafts_total{model_name="m"} 10\n'
        'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 40\n'
        'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 20\n')
    after = parse_prometheus_text(
        'vllm:spec_decode_num_drafts_total{model_name="m"} 30\n'
        'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 120\n'
        'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 80\n')
    d = server_metrics_delta(before, after)
    assert d["spec_decode_acceptance_rate"] == pytest.approx(60 / 80)
    assert d["spec_decode_mean_accepted_length"] == pytest.approx(1 + 60 / 20)
    assert server_metrics_delta(before, before)["spec_decode_acceptance_rate"] is None
