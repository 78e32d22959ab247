"""``bench serve`` against the real pagedllm server on the bundled model.

Starts ``python -m pagedllm.entrypoints.cli serve`` on a free port, waits for
/health (up to 600 s: the model load, and a tokenizer conversion on a new machine;
conftest has built the C++ kernels before), then runs small benchmarks and checks that the saved JSON has every field and that the request and token
counts match on the client, in usage and in the server's /metrics.
"""

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from bench_helpers import REQUEST_KEYS, SERVER_KEYS, STAT_KEYS, SUMMARY_KEYS, TOP_KEYS, check_png, run_cli
from fake_server import free_port

from pagedllm.entrypoints.cli import main

pytestmark = pytest.mark.slow   # a real server in its own process

HEALTH_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    log = open(log_path, "w")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
         "--max-model-len", "1024", "--kv-cache-memory", "256MiB"],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"

    def tail() -> str:
        log.flush()
        return log_path.read_text()[-3000:]

    try:
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with code {proc.returncode}:\n{tail()}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not healthy after {HEALTH_TIMEOUT_S} s:\n{tail()}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def test_random_run_counts_match(server, tmp_path, capsys):
    out = tmp_path / "res.json"
    rc = main(["bench", "serve", "--base-url", server, "--dataset", "random", "--num-prompts", "8",
               "--input-len", "32", "--output-len", "8", "--max-concurrency", "4", "--ignore-eos",
               "--num-warmups", "1", "--goodput", "ttft:60000", "tpot:60000", "--timeout", "120",
               "--save-result", str(out), "--plot", str(tmp_path / "plots")])
    table = capsys.readouterr().out
    assert rc == 0, table
    res = json.loads(out.read_text())
    assert TOP_KEYS <= set(res)
    assert SUMMARY_KEYS <= set(res["summary"])
    assert SERVER_KEYS <= set(res["server_metrics"])
    for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert STAT_KEYS <= set(res["summary"][k])
    s, m = res["summary"], res["server_metrics"]
    errors = [r["error"] for r in res["requests"] if not r["success"]]
    assert s["num_requests"] == 8 and s["completed"] == 8 and s["failed"] == 0, errors
    assert len(res["requests"]) == 8 and all(REQUEST_KEYS <= set(r) for r in res["requests"])
    assert all(r["output_tokens"] == 8 and r["output_tokens_source"] == "usage" for r in res["requests"])
    assert all(r["prompt_tokens"] == 32 for r in res["requests"])
    assert s["total_output_tokens"] == 64 and s["total_input_tokens"] == 256
    assert s["good_requests"] == 8 and s["peak_in_flight"] <= 4
    assert s["ttft_ms"]["count"] == 8 and s["ttft_ms"]["min"] > 0
    assert s["tpot_ms"]["count"] == 8 and s["itl_ms"]["count"] >= 8
    assert s["e2e_ms"]["min"] >= s["ttft_ms"]["min"]
    # server-side view of the same run (warm-up excluded by scraping after it)
    assert m["available"] is True
    assert m["requests_succeeded"] == 8
    assert m["generation_tokens"] == 64 and m["prompt_tokens"] == 256
    assert m["queue_count"] == 8 and m["prefill_count"] == 8 and m["decode_count"] == 8
    assert m["queue_time_share"] + m["prefill_time_share"] + m["decode_time_share"] == pytest.approx(1.0)
    assert m["prefix_cache_hit_rate"] is not None and m["num_preemptions"] is not None
    for name in ("latency_cdf.png", "timeline.png"):
        check_png(tmp_path / "plots" / name)


def test_multi_turn_chat_run(server, tmp_path):
    out = tmp_path / "mt.json"
    rc = run_cli(["bench", "serve", "--base-url", server, "--dataset", "multi-turn", "--num-prompts", "2",
                  "--multi-turn-turns", "2", "--multi-turn-system-len", "24", "--input-len", "16",
                  "--multi-turn-tool-len", "8", "--output-len", "4", "--multi-turn-think-time", "0.05",
                  "--ignore-eos", "--timeout", "120", "--quiet", "--save-result", str(out)],
                 tokenizer=_bundled_tokenizer())
    assert rc == 0
    res = json.loads(out.read_text())
    s = res["summary"]
    assert s["num_requests"] == 4 and s["completed"] == 4, s["errors"]
    assert res["config"]["endpoint_kind"] == "chat"
    by_session = {}
    for r in res["requests"]:
        by_session.setdefault(r["session_id"], []).append(r)
    for reqs in by_session.values():
        # the second turn resends the first turn, its reply and a tool result
        assert reqs[1]["prompt_tokens"] > reqs[0]["prompt_tokens"] + reqs[0]["output_tokens"]
    # cost attribution: the cached tokens of each request's usage add up to the server's hit counter,
    # the engine split comes from its prefill / decode times, and the rows add up to the run
    c, m = res["cost"], res["server_metrics"]
    assert c["prefix_cache"]["source"] == "usage" and c["engine_time_model"] == "server"
    assert c["prefix_cache"]["cached_tokens"] == m["prefix_cache_hits"] > 0
    assert sum(r["seconds"] for r in c["rows"]) == pytest.approx(s["duration_s"])
    assert c["rows"][-1]["key"] == "idle" and {r["system_tokens"] for r in res["requests"]} == {24}


def test_multi_turn_through_three_apis(server, tmp_path):
    """One multi-turn workload through chat, responses and messages: all succeed, the same
    prompt tokens through each, and each run's cached tokens in usage equal /metrics'
    prefix-cache hits (no preemption in so small a run)."""
    out = tmp_path / "cmp.json"
    rc = run_cli(["bench", "serve", "--base-url", server, "--dataset", "multi-turn", "--num-prompts", "2",
                  "--multi-turn-turns", "2", "--multi-turn-system-len", "40", "--input-len", "16",
                  "--multi-turn-tool-len", "8", "--output-len", "4", "--multi-turn-think-time", "0",
                  "--endpoint-type", "chat,responses,messages", "--timeout", "120", "--quiet",
                  "--save-result", str(out)], tokenizer=_bundled_tokenizer())
    assert rc == 0
    doc = json.loads(out.read_text())
    assert [r["config"]["endpoint_kind"] for r in doc["runs"]] == ["chat", "responses", "messages"]
    prompts = {}
    for res in doc["runs"]:
        s, m, c = res["summary"], res["server_metrics"], res["cached_tokens"]
        kind = res["config"]["endpoint_kind"]
        assert s["num_requests"] == 4 and s["completed"] == 4, (kind, s["errors"])
        assert res["prefix_cache_reset"] is True and m["num_preemptions"] == 0
        assert all(r["output_tokens_source"] == "usage" and r["cached_tokens"] is not None for r in res["requests"])
        assert c["in_usage"] == c["prefix_cache_hits"] > 0 and c["difference"] == 0, (kind, c)
        prompts[kind] = sorted((r["session_id"], r["turn"], r["prompt_tokens"]) for r in res["requests"])
    # the same conversation renders to the same prompt through each API (greedy: the same replies)
    assert prompts["responses"] == prompts["chat"] == prompts["messages"]


def _bundled_tokenizer():
    from pagedllm.benchmarks.serve_options import load_tokenizer

    return load_tokenizer(None)


def test_abandoned_streams_are_aborted_by_the_server(server, tmp_path):
    from pagedllm.benchmarks.metrics import parse_prometheus_text

    def scrape():
        return parse_prometheus_text(httpx.get(server + "/metrics", timeout=10).text)

    abort = "vllm:request_success_total{finished_reason=abort}"
    before = scrape()
    out = tmp_path / "ab.json"
    rc = run_cli(["bench", "serve", "--base-url", server, "--dataset", "random", "--num-prompts", "6",
                  "--input-len", "16", "--output-len", "48", "--max-concurrency", "3", "--ignore-eos",
                  "--abort-fraction", "1", "--abort-after", "tokens:4", "--timeout", "120", "--quiet",
                  "--save-result", str(out)])
    assert rc == 0
    s = json.loads(out.read_text())["summary"]
    assert s["aborted"] == 6 and s["failed"] == 0 and s["total_aborted_output_tokens"] == 24
    # the server noticed each disconnect, aborted the request and freed its blocks
    deadline = time.monotonic() + 30
    while True:
        m = scrape()
        settled = m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0
        if (m[abort] - before.get(abort, 0) >= 6 and settled) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert m[abort] - before.get(abort, 0) == 6
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0
