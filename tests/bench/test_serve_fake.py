"""``bench serve`` end to end against the fake OpenAI-compatible server."""

import json

import pytest
from bench_helpers import REQUEST_KEYS, SERVER_KEYS, STAT_KEYS, SUMMARY_KEYS, TOP_KEYS, check_png, run_cli

def base(srv, *extra):
    return ["bench", "serve", "--base-url", srv.url, "--quiet", *extra]


def test_random_run_full_result(fake_server, tmp_path, capsys):
    srv = fake_server(capacity=4, prefill_s=0.01, itl_s=0.004)
    out = tmp_path / "res.json"
    rc = run_cli(base(srv, "--num-prompts", "12", "--input-len", "16", "--output-len", "5",
                      "--max-concurrency", "4", "--num-warmups", "2", "--goodput", "ttft:5000", "tpot:5000",
                      "--percentiles", "50,90,99,99.9", "--save-result", str(out), "--plot",
                      str(tmp_path / "plots"), "--label", "fake"))
    assert rc == 0
    table = capsys.readouterr().out
    assert "Serving Benchmark Result" in table and "Goodput" in table and "P99 TTFT (ms)" in table
    res = json.loads(out.read_text())
    assert TOP_KEYS <= set(res)
    assert SUMMARY_KEYS <= set(res["summary"])
    for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert STAT_KEYS | {"p99_9"} <= set(res["summary"][k])
    assert SERVER_KEYS <= set(res["server_metrics"])
    s, m = res["summary"], res["server_metrics"]
    # counts: warm-ups excluded; the server saw warm-ups + measured requests
    assert s["num_requests"] == s["completed"] == 12 and s["failed"] == 0 and s["num_warmups"] == 2
    assert len(srv.stats.requests) == 14
    assert len(res["requests"]) == 12 and all(REQUEST_KEYS <= set(r) for r in res["requests"])
    assert s["total_input_tokens"] == 12 * 16 and s["total_output_tokens"] == 12 * 5
    assert all(r["output_tokens_source"] == "usage" for r in res["requests"])
    assert s["ttft_ms"]["count"] == 12 and s["tpot_ms"]["count"] == 12 and s["itl_ms"]["count"] == 12 * 4
    assert s["good_requests"] == 12 and s["goodput"] == pytest.approx(s["request_throughput"])
    assert s["peak_in_flight"] == 4 and srv.stats.max_in_flight <= 4
    assert s["ttft_ms"]["min"] >= 10.0  # the fake prefill is 10 ms
    # server-side deltas cover exactly the measured run (scraped after warm-up)
    assert m["available"] and m["queue_count"] == 12 and m["generation_tokens"] == 60
    assert m["prompt_tokens"] == 12 * 16 and m["requests_succeeded"] == 12
    assert m["queue_time_share"] + m["prefill_time_share"] + m["decode_time_share"] == pytest.approx(1.0)
    assert m["prefill_mean_ms"] >= 10.0 and m["finished_reasons"] == {"length": 12}
    assert res["config"]["max_concurrency"] == 4 and res["config"]["model"] == "fake-model"
    assert res["label"] == "fake"
    for name in ("latency_cdf.png", "timeline.png"):
        check_png(tmp_path / "plots" / name)


def test_retries_counted(fake_server, tmp_path):
    srv = fake_server(fail_first_n=2, prefill_s=0.001, itl_s=0.001)
    out = tmp_path / "r.json"
    rc = run_cli(base(srv, "--model", "fake-model", "--num-prompts", "4", "--input-len", "4", "--output-len", "2",
                      "--max-concurrency", "1", "--max-retries", "2", "--retry-backoff", "0.01",
                      "--save-result", str(out)))
    assert rc == 0
    s = json.loads(out.read_text())["summary"]
    assert s["failed"] == 0 and s["total_retries"] == 2 and s["requests_retried"] == 1
    assert s["retry_rate"] == pytest.approx(0.25)
    assert srv.stats.failed_posts == 2

    srv = fake_server(fail_first_n=2, prefill_s=0.001, itl_s=0.001)
    rc = run_cli(base(srv, "--model", "fake-model", "--num-prompts", "4", "--input-len", "4", "--output-len", "2",
                      "--max-concurrency", "1", "--save-result", str(out)))
    res = json.loads(out.read_text())
    s = res["summary"]
    assert rc == 0 and s["failed"] == 2 and s["completed"] == 2 and s["error_rate"] == pytest.approx(0.5)
    assert s["total_retries"] == 0
    assert [r["http_status"] for r in res["requests"][:2]] == [503, 503]
    assert all("HTTP 503" in r["error"] for r in res["requests"][:2])


def test_unreachable_server_counts_failures(tmp_path, capsys):
    from fake_server import free_port

    url = f"http://127.0.0.1:{free_port()}"
    out = tmp_path / "r.json"
    rc = run_cli(["bench", "serve", "--base-url", url, "--model", "m", "--num-prompts", "3", "--input-len", "4",
                  "--output-len", "2", "--max-retries", "1", "--retry-backoff", "0", "--save-result", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    s = res["summary"]
    assert s["num_requests"] == 3 and s["failed"] == 3 and s["error_rate"] == 1.0 and s["total_retries"] == 3
    assert s["request_throughput"] == 0 and s["ttft_ms"]["mean"] is None
    assert res["server_metrics"]["available"] is False
    assert "n/a" in capsys.readouterr().out
    # without --model the model list is needed: a clear error, exit code 1
    rc = run_cli(["bench", "serve", "--base-url", url, "--num-prompts", "1"])
    assert rc == 1 and "--model" in capsys.readouterr().err


def test_no_metrics_endpoint_gives_na(fake_server, tmp_path, capsys):
    srv = fake_server(expose_metrics=False, prefill_s=0.001, itl_s=0.001)
    out = tmp_path / "r.json"
    assert run_cli(base(srv, "--num-prompts", "2", "--input-len", "4", "--output-len", "2",
                        "--save-result", str(out))) == 0
    m = json.loads(out.read_text())["server_metrics"]
    assert m["available"] is False and m["queue_time_share"] is None and m["prefix_cache_hit_rate"] is None
    table = capsys.readouterr().out
    assert "Prefix cache hit rate" in table and table.count("n/a") >= 8


def test_shared_prefix_hits_prefix_cache(fake_server, tmp_path):
    srv = fake_server(prefill_s=0.001, itl_s=0.001)
    out = tmp_path / "r.json"
    assert run_cli(base(srv, "--dataset", "shared-prefix", "--num-prefixes", "2", "--prefix-len", "16",
                        "--suffix-len", "4", "--output-len", "2", "--num-prompts", "10", "--max-concurrency", "1",
                        "--save-result", str(out))) == 0
    res = json.loads(out.read_text())
    m = res["server_metrics"]
    assert m["prefix_cache_queries"] == 10 * 20
    # each prefix is missed once (16 tokens), later requests hit all 16 prefix tokens
    used = {s["session_id"].split("-")[0] for s in res["requests"]}
    assert m["prefix_cache_hits"] == 16 * (10 - len(used))
    assert 0.5 < m["prefix_cache_hit_rate"] < 0.8


def test_multi_turn_sessions(fake_server, tmp_path, word_tokenizer):
    srv = fake_server(prefill_s=0.002, itl_s=0.002)
    out = tmp_path / "r.json"
    rc = run_cli(base(srv, "--dataset", "multi-turn", "--num-prompts", "2", "--multi-turn-turns", "3",
                      "--multi-turn-system-len", "10", "--input-len", "5", "--multi-turn-tool-len", "3",
                      "--output-len", "3", "--multi-turn-think-time", "0.1", "--save-result", str(out)),
                 tokenizer=word_tokenizer)
    assert rc == 0
    res = json.loads(out.read_text())
    s = res["summary"]
    assert s["num_requests"] == 6 and s["num_sessions"] == 2 and s["completed"] == 6
    assert res["config"]["endpoint_kind"] == "chat"
    by_session = {}
    for r in res["requests"]:
        by_session.setdefault(r["session_id"], []).append(r)
    for reqs in by_session.values():
        assert [r["turn"] for r in reqs] == [0, 1, 2]
        for prev, nxt in zip(reqs, reqs[1:]):  # think time respected
            assert nxt["start_s"] - prev["end_s"] >= 0.1 - 0.002
    bodies = [r["body"] for r in srv.stats.requests]
    assert all(b["stream"] and "messages" in b for b in bodies)
    lens = sorted(len(b["messages"]) for b in bodies)
    assert lens == [2, 2, 4, 4, 6, 6]  # system + user, then + assistant + tool result per turn
    last = max(bodies, key=lambda b: len(b["messages"]))["messages"]
    assert [m["role"] for m in last] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert last[2]["content"] == " tok0 tok1 tok2" and last[3]["content"].startswith("Tool result:")
    # prompt tokens grow turn by turn (reported by the server's usage)
    p = [r["prompt_tokens"] for r in by_session["m0"]]
    assert p[0] < p[1] < p[2]


def test_sharegpt_and_trace_cli(fake_server, tmp_path):
    srv = fake_server(prefill_s=0.001, itl_s=0.001)
    sg = tmp_path / "sg.json"
    sg.write_text(json.dumps([{"conversations": [{"from": "human", "value": f"question number {i} is here"},
                                                 {"from": "gpt", "value": "a b c d e f"}]} for i in range(3)]))
    out = tmp_path / "r.json"
    assert run_cli(base(srv, "--dataset", "sharegpt", "--dataset-path", str(sg), "--num-prompts", "5",
                        "--save-result", str(out))) == 0
    s = json.loads(out.read_text())["summary"]
    assert s["completed"] == 5 and s["total_output_tokens"] == 5 * 6
    assert all("messages" in r["body"] and r["body"]["max_tokens"] == 6 for r in srv.stats.requests)

    tr = tmp_path / "t.jsonl"
    tr.write_text("\n".join(json.dumps({"timestamp": i * 0.01, "prompt_len": 6, "output_len": 2,
                                        "session_id": "s" + str(i % 2)}) for i in range(4)))
    n0 = len(srv.stats.requests)
    assert run_cli(base(srv, "--dataset", "trace", "--dataset-path", str(tr), "--save-result", str(out))) == 0
    res = json.loads(out.read_text())
    assert res["summary"]["completed"] == 4 and len(srv.stats.requests) - n0 == 4
    assert res["dataset"]["num_rows"] == 4


def test_count_tokens_without_usage(fake_server, tmp_path, word_tokenizer):
    srv = fake_server(prefill_s=0.001, itl_s=0.001)
    out = tmp_path / "r.json"
    assert run_cli(base(srv, "--num-prompts", "2", "--input-len", "4", "--output-len", "3",
                        "--no-stream-usage", "--ignore-eos", "--extra-body", '{"top_k": 1}',
                        "--save-result", str(out))) == 0
    res = json.loads(out.read_text())
    assert [r["output_tokens_source"] for r in res["requests"]] == ["chunks", "chunks"]
    assert res["summary"]["total_output_tokens"] == 6
    b = srv.stats.requests[0]["body"]
    assert "stream_options" not in b and b["ignore_eos"] is True and b["top_k"] == 1
    assert isinstance(b["prompt"], list) and len(b["prompt"]) == 4


def test_non_streaming_answer_and_stream_error(fake_server, tmp_path):
    srv = fake_server(no_stream=True, prefill_s=0.001, itl_s=0.001)
    out = tmp_path / "r.json"
    assert run_cli(base(srv, "--num-prompts", "2", "--input-len", "4", "--output-len", "3",
                        "--save-result", str(out))) == 0
    res = json.loads(out.read_text())
    assert res["summary"]["completed"] == 2 and res["summary"]["total_output_tokens"] == 6
    assert all(r["ttft_ms"] == r["e2e_ms"] for r in res["requests"])

    srv = fake_server(error_after_tokens=2, prefill_s=0.001, itl_s=0.001)
    assert run_cli(base(srv, "--num-prompts", "2", "--input-len", "4", "--output-len", "5", "--max-retries", "3",
                        "--retry-backoff", "0", "--save-result", str(out))) == 0
    res = json.loads(out.read_text())
    s = res["summary"]
    # a server error (code 500) after tokens arrived is retried; every attempt fails the same way
    assert s["failed"] == 2 and s["total_retries"] == 6 and len(srv.stats.requests) == 8
    assert s["total_retried_output_tokens"] == 2 * 3 * 2 and s["total_retried_prompt_tokens"] == 2 * 3 * 4
    assert all("engine died" in r["error"] and r["output_tokens"] == 2 for r in res["requests"])

    srv = fake_server(error_after_tokens=2, error_code=400, prefill_s=0.001, itl_s=0.001)
    assert run_cli(base(srv, "--num-prompts", "2", "--input-len", "4", "--output-len", "5", "--max-retries", "3",
                        "--save-result", str(out))) == 0
    s = json.loads(out.read_text())["summary"]
    # a client error (4xx code) is not retried
    assert s["failed"] == 2 and s["total_retries"] == 0 and len(srv.stats.requests) == 2


def test_text_prompts_and_chat_from_ids(fake_server, tmp_path, word_tokenizer):
    srv = fake_server(prefill_s=0.001, itl_s=0.001)
    out = tmp_path / "r.json"
    assert run_cli(base(srv, "--num-prompts", "2", "--input-len", "6", "--output-len", "2", "--prompt-format",
                        "text", "--save-result", str(out)), tokenizer=word_tokenizer) == 0
    b = srv.stats.requests[0]["body"]
    assert isinstance(b["prompt"], str) and len(b["prompt"].split()) == 6
    assert run_cli(base(srv, "--num-prompts", "1", "--input-len", "5", "--output-len", "2", "--endpoint-type",
                        "chat", "--save-result", str(out)), tokenizer=word_tokenizer) == 0
    b = srv.stats.requests[-1]["body"]
    assert b["messages"][0]["role"] == "user" and len(b["messages"][0]["content"].split()) == 5
    res = json.loads(out.read_text())
    assert res["config"]["request_rate"] == "inf" and res["config"]["endpoint_kind"] == "chat"
    json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
