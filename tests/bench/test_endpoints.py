"""``bench serve --endpoint-type responses|messages`` (and a list of endpoint types) against
the fake server: each API's request body, stream reading (TTFT, tokens, usage, cached
tokens), error shapes, and the side-by-side comparison of one workload through three APIs."""

import argparse
import json

import pytest
from bench_helpers import run_cli

from pagedllm.benchmarks.client import OpenAIStreamClient
from pagedllm.benchmarks.endpoints import endpoint, error_message
from pagedllm.benchmarks.serve_options import BenchConfig, BenchError, endpoint_types

SYSTEM = "You are a terse agent."
# a 2-turn session as the runner builds it before the second request
CONVERSATION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "list the files"},
    {"role": "assistant", "content": " tok0 tok1"},
    {"role": "user", "content": "Tool result:\na.txt b.txt"},
]


def _body(kind, **cfg):
    c = BenchConfig(model="m", **cfg)
    return OpenAIStreamClient(c).body(kind, CONVERSATION, 7)


def test_bodies_of_a_two_turn_session_with_a_system_prompt():
    assert _body("chat") == {
        "model": "m", "max_tokens": 7, "stream": True, "temperature": 0.0, "messages": CONVERSATION,
        "stream_options": {"include_usage": True}}
    assert _body("responses") == {
        "model": "m", "instructions": SYSTEM, "max_output_tokens": 7, "stream": True, "store": False,
        "temperature": 0.0, "input": [
            {"type": "message", "role": "user", "content": "list the files"},
            {"type": "message", "role": "assistant", "content": " tok0 tok1"},
            {"type": "message", "role": "user", "content": "Tool result:\na.txt b.txt"}]}
    assert _body("messages") == {
        "model": "m", "system": SYSTEM, "max_tokens": 7, "stream": True, "temperature": 0.0, "messages": [
            {"role": "user", "content": "list the files"},
            {"role": "assistant", "content": " tok0 tok1"},
            {"role": "user", "content": "Tool result:\na.txt b.txt"}]}
    # --extra-body is merged last; stream_options and ignore_eos belong to chat/completions only
    b = _body("messages", extra_body={"top_k": 1}, stream_usage=True)
    assert b["top_k"] == 1 and "stream_options" not in b
    assert "system" not in OpenAIStreamClient(BenchConfig(model="m")).body("messages", CONVERSATION[1:2], 3)
    with pytest.raises(ValueError, match="role 'tool'"):
        OpenAIStreamClient(BenchConfig(model="m")).body("responses", [{"role": "tool", "content": "x"}], 3)


def test_endpoint_type_option():
    assert endpoint_types("chat,responses, messages") == ("chat", "responses", "messages")
    for bad in ("chat,bogus", "auto,chat", "chat,chat", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            endpoint_types(bad)
    for kind in ("responses", "messages"):
        with pytest.raises(BenchError, match="--ignore-eos"):
            BenchConfig(endpoint_type=kind, ignore_eos=True).validate()
    BenchConfig(endpoint_type="chat", ignore_eos=True).validate()


def test_stream_events_of_each_api():
    r = endpoint("responses")
    assert r.event({"type": "response.output_text.delta", "delta": "hi"}).text == "hi"
    ev = r.event({"type": "response.incomplete", "response": {"usage": {
        "input_tokens": 10, "input_tokens_details": {"cached_tokens": 8}, "output_tokens": 3}}})
    assert ev.done and r.usage(ev.usage).__dict__ == {"prompt_tokens": 10, "output_tokens": 3, "cached_tokens": 8}
    assert r.event({"type": "error", "code": "api_error", "message": "boom", "param": None}).error == "boom"
    assert r.event({"type": "response.failed", "response": {"error": {"code": "x", "message": "bad"}}}).error == "bad"
    m = endpoint("messages")
    start = m.event({"type": "message_start", "message": {"usage": {
        "input_tokens": 2, "cache_read_input_tokens": 8, "cache_creation_input_tokens": 0, "output_tokens": 1}}})
    assert "output_tokens" not in start.usage    # message_start's is a placeholder
    merged = {**start.usage, **m.event({"type": "message_delta", "usage": {"output_tokens": 5}}).usage}
    assert m.usage(merged).__dict__ == {"prompt_tokens": 10, "output_tokens": 5, "cached_tokens": 8}
    assert m.event({"type": "content_block_delta", "delta": {"type": "text_delta", "text": "x"}}).text == "x"
    assert m.event({"type": "message_stop"}).done
    assert m.event({"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}).error == "busy"
    c = endpoint("chat")
    assert c.usage({"prompt_tokens": 4, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 0}}
                   ).__dict__ == {"prompt_tokens": 4, "output_tokens": 2, "cached_tokens": 0}
    assert error_message('{"type": "error", "error": {"type": "invalid_request_error", "message": "m: no"}}') == "m: no"
    assert error_message('{"error": {"message": "x: bad", "param": "x"}}') == "x: bad"
    assert error_message("plain text") == "plain text"


def test_error_status_and_finished_of_each_api():
    """What the client's retry and abandon logic reads: an error's status (retried when
    5xx, 408, 429 or none) and whether the answer is finished."""
    c = endpoint("chat")
    assert c.event({"error": {"message": "x", "code": 503}}).error_code == 503
    assert c.event({"error": {"message": "x", "code": "429"}}).error_code == 429
    assert c.event({"error": {"message": "x", "type": "invalid_request_error", "code": None}}).error_code == 400
    assert c.event({"error": {"message": "x"}}).error_code is None
    assert c.event({"error": "plain"}).error_code is None
    assert not c.event({"choices": [{"delta": {"content": "a"}, "finish_reason": None}]}).finished
    assert c.event({"choices": [{"delta": {"content": "a"}, "finish_reason": "stop"}]}).finished
    assert endpoint("completions").event({"choices": [{"text": "a", "finish_reason": "length"}]}).finished
    r = endpoint("responses")
    assert r.event({"type": "error", "code": "api_error", "message": "boom"}).error_code == 500
    assert r.event({"type": "error", "code": "rate_limit_exceeded", "message": "slow"}).error_code == 429
    assert r.event({"type": "error", "code": "invalid_prompt", "message": "no"}).error_code == 400
    assert r.event({"type": "error", "code": "service_unavailable", "message": "dying"}).error_code == 503
    assert r.event({"type": "response.failed", "response": {"error": {"code": "server_error", "message": "m"}}}
                   ).error_code == 500
    assert r.event({"type": "response.failed", "response": {}}).error_code is None
    assert not r.event({"type": "response.output_text.delta", "delta": "hi"}).finished
    for t in ("response.completed", "response.incomplete"):
        assert r.event({"type": t, "response": {}}).finished
    m = endpoint("messages")
    for kind, status in (("overloaded_error", 529), ("api_error", 500), ("rate_limit_error", 429),
                         ("invalid_request_error", 400)):
        ev = m.event({"type": "error", "error": {"type": kind, "message": "m"}})
        assert ev.error == "m" and ev.error_code == status
    assert not m.event({"type": "message_delta", "delta": {"stop_reason": None}, "usage": {}}).finished
    assert m.event({"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {}}).finished
    assert m.event({"type": "message_stop"}).finished
    assert not m.event({"type": "content_block_delta", "delta": {"type": "text_delta", "text": "x"}}).finished


MT = ["--dataset", "multi-turn", "--num-prompts", "2", "--multi-turn-turns", "2", "--multi-turn-system-len", "10",
      "--input-len", "5", "--multi-turn-tool-len", "3", "--output-len", "4", "--multi-turn-think-time", "0"]


def _serve(srv, *extra):
    return ["bench", "serve", "--base-url", srv.url, "--quiet", *MT, *extra]


@pytest.mark.parametrize("kind", ["chat", "responses", "messages"])
def test_multi_turn_through_each_api(fake_server, tmp_path, word_tokenizer, kind):
    srv = fake_server(prefill_s=0.01, itl_s=0.002)
    out = tmp_path / "r.json"
    assert run_cli(_serve(srv, "--endpoint-type", kind, "--save-result", str(out)), tokenizer=word_tokenizer) == 0
    res = json.loads(out.read_text())
    s, reqs = res["summary"], res["requests"]
    assert s["completed"] == 4 and s["failed"] == 0 and res["config"]["endpoint_kind"] == kind
    assert all(r["api"] == kind for r in srv.stats.requests)
    served = sorted(srv.stats.requests, key=lambda r: r["arrival"])
    by_start = sorted(reqs, key=lambda r: r["start_s"])
    for r, rec in zip(by_start, served):
        # tokens and cached tokens as the server's usage gave them; TTFT after the 10 ms prefill
        assert r["output_tokens"] == 4 and r["output_tokens_source"] == "usage"
        assert r["prompt_tokens"] == rec["prompt_len"] and r["cached_tokens"] == rec["cached"]
        assert r["ttft_ms"] >= 10.0 and len(r["itl_ms"]) == 3
    # the second turn resends the first: its system prompt and first turn are cached
    assert all(r["cached_tokens"] > 0 for r in reqs if r["turn"] == 1)
    # the conversation the server rendered is the same whatever the API
    second = [rec["messages"] for rec in srv.stats.requests if len(rec["messages"]) == 4]
    assert [m["role"] for m in second[0]] == ["system", "user", "assistant", "user"]
    assert second[0][2]["content"] == " tok0 tok1 tok2 tok3" and second[0][3]["content"].startswith("Tool result:")
    # cached tokens in usage = the prefix-cache hits /metrics counted over the run
    c = res["cached_tokens"]
    assert c["in_usage"] == s["total_cached_tokens"] == sum(r["cached_tokens"] for r in reqs) > 0
    assert c["prefix_cache_hits"] == c["in_usage"] and c["difference"] == 0


def test_three_apis_in_one_command(fake_server, tmp_path, word_tokenizer, capsys):
    srv = fake_server(prefill_s=0.005, itl_s=0.002)
    out = tmp_path / "cmp.json"
    assert run_cli(_serve(srv, "--endpoint-type", "chat,responses,messages", "--max-concurrency", "2",
                          "--num-warmups", "1", "--save-result", str(out)), tokenizer=word_tokenizer) == 0
    table = capsys.readouterr().out
    assert "Endpoint comparison" in table and "Serving Benchmark Result" not in table   # --quiet: only the comparison
    doc = json.loads(out.read_text())
    assert doc["endpoint_types"] == ["chat", "responses", "messages"] and doc["baseline"] == "chat"
    assert [r["config"]["endpoint_kind"] for r in doc["runs"]] == ["chat", "responses", "messages"]
    assert srv.stats.resets == 3 and all(r["prefix_cache_reset"] for r in doc["comparison"])
    rows = {r["endpoint_type"]: r for r in doc["comparison"]}
    assert rows["chat"]["vs_baseline"] == 1.0
    for kind in ("responses", "messages"):
        # like for like: the same prompt and output tokens, the same cache hits from a reset cache
        for key in ("completed", "total_input_tokens", "total_output_tokens", "cached_tokens_in_usage",
                    "prefix_cache_hits"):
            assert rows[kind][key] == rows["chat"][key], (kind, key)
        assert rows[kind]["vs_baseline"] > 0 and rows[kind]["ttft_p99_ms"] >= rows[kind]["ttft_median_ms"]
    for r in doc["comparison"]:
        assert r["failed"] == 0 and r["cached_tokens_difference"] == 0 and r["cached_tokens_in_usage"] > 0

    # a server without the reset route: said in the table and the JSON
    srv = fake_server(prefill_s=0.001, itl_s=0.001, reset_route=False)
    assert run_cli(_serve(srv, "--endpoint-type", "messages,chat", "--save-result", str(out)),
                   tokenizer=word_tokenizer) == 0
    captured = capsys.readouterr()
    assert "cannot reset the prefix cache" in captured.err and "could not be reset" in captured.out
    doc = json.loads(out.read_text())
    assert [r["prefix_cache_reset"] for r in doc["comparison"]] == [False, False] and doc["baseline"] == "chat"


@pytest.mark.parametrize("kind", ["chat", "responses", "messages"])
def test_errors_of_each_api_are_failures_with_their_message(fake_server, tmp_path, word_tokenizer, kind):
    out = tmp_path / "r.json"
    srv = fake_server(error_after_tokens=2, prefill_s=0.001, itl_s=0.001)
    assert run_cli(_serve(srv, "--endpoint-type", kind, "--max-retries", "2", "--retry-backoff", "0",
                          "--save-result", str(out)), tokenizer=word_tokenizer) == 0
    res = json.loads(out.read_text())
    # a server error event after tokens (chat: code 500; responses: code api_error; messages:
    # error.type api_error) is retried mid-stream; each attempt fails alike, then the request
    # (and its session) fails, the retried attempts' tokens counted
    s = res["summary"]
    assert s["failed"] == 2 and s["total_retries"] == 4 and len(srv.stats.requests) == 6
    assert s["total_retried_output_tokens"] == 2 * 2 * 2
    assert all(r["error"] == "server error: engine died" and r["output_tokens"] == 2 for r in res["requests"])

    for code, retried in ((400, False), (429, True), (503, True)):
        srv = fake_server(error_after_tokens=1, error_code=code, prefill_s=0.001, itl_s=0.001)
        assert run_cli(_serve(srv, "--endpoint-type", kind, "--max-retries", "1", "--retry-backoff", "0",
                              "--save-result", str(out)), tokenizer=word_tokenizer) == 0
        s = json.loads(out.read_text())["summary"]
        # a request error (4xx) fails at once; a rate limit or an overloaded server is retried
        assert s["failed"] == 2 and s["total_retries"] == (2 if retried else 0), code

    srv = fake_server(fail_first_n=1, prefill_s=0.001, itl_s=0.001)
    assert run_cli(_serve(srv, "--endpoint-type", kind, "--max-concurrency", "1", "--save-result", str(out)),
                   tokenizer=word_tokenizer) == 0
    first = json.loads(out.read_text())["requests"][0]
    assert first["error"] == "HTTP 503: overloaded" and first["http_status"] == 503


@pytest.mark.parametrize("kind", ["responses", "messages"])
def test_a_refused_body_is_a_failure_naming_the_field(fake_server, tmp_path, word_tokenizer, kind):
    srv = fake_server(prefill_s=0.001, itl_s=0.001)
    out = tmp_path / "r.json"
    assert run_cli(_serve(srv, "--endpoint-type", kind, "--extra-body", '{"ignore_eos": true}',
                          "--save-result", str(out)), tokenizer=word_tokenizer) == 0
    res = json.loads(out.read_text())
    assert res["summary"]["failed"] == 2
    assert all(r["error"] == "HTTP 400: unknown fields: ignore_eos" for r in res["requests"])
    # --ignore-eos itself is refused before any request
    assert run_cli(_serve(srv, "--endpoint-type", kind, "--ignore-eos"), tokenizer=word_tokenizer) == 2


@pytest.mark.parametrize("kind", ["responses", "messages"])
def test_whole_json_answer_of_each_api(fake_server, tmp_path, word_tokenizer, kind):
    srv = fake_server(no_stream=True, prefill_s=0.001, itl_s=0.001)
    out = tmp_path / "r.json"
    assert run_cli(_serve(srv, "--endpoint-type", kind, "--save-result", str(out)), tokenizer=word_tokenizer) == 0
    res = json.loads(out.read_text())
    assert res["summary"]["completed"] == 4 and res["summary"]["total_output_tokens"] == 16
    assert res["cached_tokens"]["difference"] == 0
    last = max(srv.stats.requests, key=lambda r: len(r["messages"]))["messages"]
    assert last[2]["content"] == " tok0 tok1 tok2 tok3"    # the answer's text went into the next turn


def test_random_dataset_through_responses(fake_server, tmp_path, word_tokenizer):
    srv = fake_server(prefill_s=0.001, itl_s=0.001)
    out = tmp_path / "r.json"
    assert run_cli(["bench", "serve", "--base-url", srv.url, "--quiet", "--num-prompts", "2", "--input-len", "6",
                    "--output-len", "2", "--endpoint-type", "responses", "--save-result", str(out)],
                   tokenizer=word_tokenizer) == 0
    b = srv.stats.requests[0]["body"]
    assert "instructions" not in b and len(b["input"][0]["content"].split()) == 6
    assert json.loads(out.read_text())["summary"]["completed"] == 2


def test_sweep_takes_one_endpoint_type(fake_server, capsys):
    srv = fake_server()
    rc = run_cli(["bench", "sweep", "--base-url", srv.url, "--concurrencies", "1", "--num-prompts", "1",
                  "--endpoint-type", "chat,messages", "--slo", "ttft:1000"])
    assert rc == 2 and "--endpoint-type" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["chat", "responses", "messages"])
def test_abandoned_streams_and_mid_stream_retries_through_each_api(fake_server, tmp_path, word_tokenizer, kind):
    """The load model through every chat-turn API: the client closes each stream after 2
    text events, and retries an attempt whose connection broke mid-stream."""
    srv = fake_server(prefill_s=0.001, itl_s=0.02)
    out = tmp_path / "r.json"
    assert run_cli(_serve(srv, "--endpoint-type", kind, "--abort-fraction", "1", "--abort-after", "tokens:2",
                          "--save-result", str(out)), tokenizer=word_tokenizer) == 0
    res = json.loads(out.read_text())
    s = res["summary"]
    srv.wait_idle()
    assert s["aborted"] == 4 and s["failed"] == 0 and s["completed"] == 0 and s["total_aborted_output_tokens"] == 8
    assert srv.stats.disconnects == [2, 2, 2, 2] and srv.stats.success == 0
    assert all(r["aborted"] and r["error"] is None and r["abort_after_tokens"] == 2 for r in res["requests"])
    # Messages reports the prompt's usage in message_start, before any text: kept when abandoned
    assert all((r["cached_tokens"] is not None) == (kind == "messages") for r in res["requests"])

    srv = fake_server(prefill_s=0.001, itl_s=0.005, drop_first_attempt={0: 3})
    assert run_cli(_serve(srv, "--endpoint-type", kind, "--max-retries", "2", "--retry-backoff", "0",
                          "--save-result", str(out)), tokenizer=word_tokenizer) == 0
    res = json.loads(out.read_text())
    s = res["summary"]
    assert srv.stats.dropped == [3] and len(srv.stats.requests) == 5
    assert s["completed"] == 4 and s["failed"] == 0 and s["total_retries"] == 1
    assert s["total_retried_output_tokens"] == 3 and s["total_retried_prompt_tokens"] > 0
    retried = [r for r in res["requests"] if r["retries"]]
    assert len(retried) == 1 and retried[0]["output_tokens"] == 4 and retried[0]["success"]
