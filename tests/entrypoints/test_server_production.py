"""The server as a team runs it: the engine core in its own process, API-key auth on every
route, backpressure, request ids, the tokenizer routes, 256 concurrent streaming clients
of which 30 % go away mid-request, schemathesis against /openapi.json, and a SIGTERM that
drains a long stream and exits 0 leaving no engine process. Loopback only; every loop
is bounded in count and time."""
from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
from server_helpers import _alive, _free_port, _Server, _wait_gone


KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}


class _AuthServer(_Server):
    auth = AUTH


@pytest.fixture(scope="module")
def server():
    s = _AuthServer(engine_kw=dict(engine_process=True, max_model_len=256, kv_cache_memory="1GiB"),
                    api_key=KEY)
    yield s
    s.stop()


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_every_route_but_health_needs_the_key(server):
    from fastapi.routing import APIRoute

    app = server.server.config.app
    checked = set()
    for route in app.routes:
        path = route.path.replace("{model_id:path}", "x")
        for method in sorted(getattr(route, "methods", None) or ["GET"]):
            if method == "HEAD":
                continue
            kw = {"json": {}} if method == "POST" else {}
            no_key = httpx.request(method, f"{server.url}{path}", timeout=30, **kw)
            wrong = httpx.request(method, f"{server.url}{path}", timeout=30,
                                  headers={"Authorization": "Bearer nope"}, **kw)
            with_key = httpx.request(method, f"{server.url}{path}", timeout=30, headers=AUTH, **kw)
            if path == "/health":
                assert no_key.status_code == 200
                continue
            x_wrong = httpx.request(method, f"{server.url}{path}", timeout=30, headers={"x-api-key": "nope"}, **kw)
            x_key = httpx.request(method, f"{server.url}{path}", timeout=30, headers={"x-api-key": KEY}, **kw)
            for r in (no_key, wrong, x_wrong):
                assert r.status_code == 401, (method, path, r.status_code)
                if path.startswith("/v1/messages"):   # Anthropic's error shape there
                    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"
                else:
                    assert r.json()["error"]["code"] == 401 and r.json()["error"]["type"] == "AuthenticationError"
                assert r.headers["www-authenticate"] == "Bearer"
            assert with_key.status_code != 401 and x_key.status_code != 401, (method, path)
            if isinstance(route, APIRoute):
                checked.add(route.path)
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model_id:path}", "/tokenize",
            "/detokenize", "/version", "/metrics", "/reset_prefix_cache", "/v1/messages",
            "/v1/messages/count_tokens"} <= checked


def test_metrics_without_auth_opens_only_metrics():
    from pagedllm.entrypoints.openai.middleware import ApiKeyMiddleware

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def go():
        transport = httpx.ASGITransport(app=ApiKeyMiddleware(app, KEY, metrics_without_auth=True))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return [(await c.get(p)).status_code for p in ("/metrics", "/health", "/v1/models")]

    assert asyncio.run(go()) == [200, 200, 401]
    with pytest.raises(ValueError):
        ApiKeyMiddleware(app, "")


def test_unexpected_error_is_a_500_and_the_app_returns():
    """An exception no handler caught is answered with a 500 in OpenAI's shape and does not
    propagate (Starlette's last-resort handler re-raises, and uvicorn then closes the
    keep-alive connection, failing the client's next request); after a response has
    started it propagates (that response cannot be completed)."""
    from pagedllm.entrypoints.openai.middleware import InternalErrorMiddleware

    async def boom(scope, receive, send):
        raise RuntimeError("boom")

    async def boom_mid_stream(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError("boom")

    async def go(app):
        sent = []

        async def send(m):
            sent.append(m)

        await InternalErrorMiddleware(app)({"type": "http", "method": "POST", "path": "/x"}, None, send)
        return sent

    sent = asyncio.run(go(boom))
    assert sent[0]["status"] == 500
    assert json.loads(sent[1]["body"]) == {"error": {"message": "internal error: boom", "type": "internal_error",
                                                     "param": None, "code": 500}}
    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(go(boom_mid_stream))


def test_tokenize_detokenize_version_models(server):
    u = server.url
    r = httpx.post(f"{u}/tokenize", json={"prompt": "Hello world"}, headers=AUTH).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == 256
    back = httpx.post(f"{u}/detokenize", json={"tokens": r["tokens"]}, headers=AUTH).json()
    assert back == {"prompt": "Hello world"}
    chat = httpx.post(f"{u}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]},
                      headers=AUTH).json()
    assert chat["count"] > 3 and "<|im_start|>" in httpx.post(
        f"{u}/detokenize", json={"tokens": chat["tokens"]}, headers=AUTH).json()["prompt"]
    bad = httpx.post(f"{u}/detokenize", json={"tokens": [10**9]}, headers=AUTH)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    # with tools, the prompt a chat request with the same tools has (the template's own
    # tools, or Hermes' text in the system prompt): not the bare conversation's
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    with_tools = httpx.post(f"{u}/tokenize", json={"messages": msgs, "tools": tools}, headers=AUTH).json()
    bare = httpx.post(f"{u}/tokenize", json={"messages": msgs}, headers=AUTH).json()
    sent = httpx.post(f"{u}/v1/chat/completions", headers=AUTH, timeout=60, json={
        "messages": msgs, "tools": tools, "tool_choice": "none", "max_tokens": 1}).json()
    assert with_tools["count"] == sent["usage"]["prompt_tokens"] > bare["count"] + 20
    assert "get_weather" in httpx.post(f"{u}/detokenize", json={"tokens": with_tools["tokens"]},
                                       headers=AUTH).json()["prompt"]
    bad_tools = httpx.post(f"{u}/tokenize", json={"messages": msgs, "tools": [{"type": "nope"}]}, headers=AUTH)
    assert bad_tools.status_code == 400 and bad_tools.json()["error"]["param"] == "tools"
    bad_turn = httpx.post(f"{u}/tokenize", headers=AUTH, json={
        "messages": [*msgs, {"role": "assistant", "content": None, "tool_calls": "x"}]})
    assert bad_turn.status_code == 400 and bad_turn.json()["error"]["param"] == "messages", bad_turn.text
    both = httpx.post(f"{u}/tokenize", json={"prompt": "a", "messages": []}, headers=AUTH)
    assert both.status_code == 400 and both.json()["error"]["param"] == "prompt"
    for field, value in [("tools", tools), ("chat_template_kwargs", {}), ("add_generation_prompt", True)]:
        r = httpx.post(f"{u}/tokenize", json={"prompt": "a", field: value}, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert "only with messages" in r.json()["error"]["message"]
    assert httpx.get(f"{u}/version", headers=AUTH).json() == {"version": "0.1.0"}
    assert httpx.get(f"{u}/v1/models", headers=AUTH).json()["data"][0]["max_model_len"] == 256
    spec = httpx.get(f"{u}/openapi.json", headers=AUTH).json()
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/version", "/health",
            "/metrics", "/v1/models", "/v1/models/{model_id}"} <= set(spec["paths"])


@pytest.mark.slow   # ~4 s (fast-tier budget)
def test_request_id_echoed_and_duplicates_never_cross(server):
    """Two streams in flight with the same X-Request-Id each get their own text, and so
    does a request that reuses the id of one its client just walked away from (the
    engine has not dropped that one yet)."""
    prompts = ["The capital of France is", "def fibonacci(n):"]

    def body(p, stream):
        return {"prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": stream}

    alone = [httpx.post(f"{server.url}/v1/completions", json=body(p, False), headers=AUTH, timeout=60).json()
             for p in prompts]

    async def both():
        async with httpx.AsyncClient(timeout=60, headers={**AUTH, "X-Request-Id": "same-id"}) as c:
            async def one(p):
                text, ids = "", set()
                async with c.stream("POST", f"{server.url}/v1/completions", json=body(p, True)) as r:
                    assert r.headers["x-request-id"] == "same-id"
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            import json
                            chunk = json.loads(line[6:])
                            ids.add(chunk["id"])
                            text += chunk["choices"][0]["text"]
                return text, ids
            return await asyncio.gather(*[one(p) for p in prompts])

    got = asyncio.run(both())
    assert [t for t, _ in got] == [a["choices"][0]["text"] for a in alone]
    (_, ids0), (_, ids1) = got
    assert ids0 == ids1 == {"cmpl-same-id"}
    for _ in range(3):   # walk away after the first chunk, then reuse the id at once
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body(prompts[0], True), timeout=60,
                          headers={**AUTH, "X-Request-Id": "retry"}) as r:
            next(ln for ln in r.iter_lines() if ln.startswith("data: {"))
        again = httpx.post(f"{server.url}/v1/completions", json=body(prompts[1], False), timeout=60,
                           headers={**AUTH, "X-Request-Id": "retry"}).json()
        assert again["choices"][0]["text"] == alone[1]["choices"][0]["text"]
        assert again["choices"][0]["finish_reason"] == "length"
    assert httpx.get(f"{server.url}/health").status_code == 200
    r = httpx.post(f"{server.url}/v1/completions", json=body("Hi", False), timeout=60,
                   headers={**AUTH, "X-Request-Id": "solo"})
    assert r.headers["x-request-id"] == "solo" and r.json()["id"] == "cmpl-solo"
    assert len(httpx.get(f"{server.url}/version", headers=AUTH).headers["x-request-id"]) == 32   # a uuid


def test_access_log_line_per_request_with_its_tokens(server):
    """One ``pagedllm.access`` line per request: id, route, status, prompt and output
    tokens, TTFT and E2E; a stream the client leaves after two chunks logs what it sent."""
    import logging

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    log = logging.getLogger("pagedllm.access")
    handler, level = Keep(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60, headers={**AUTH, "X-Request-Id": "whole"})
        n_prompt = r.json()["usage"]["prompt_tokens"]
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "max_tokens": 200, "stream": True},
                          timeout=60, headers={**AUTH, "X-Request-Id": "left"}) as r:
            it = (ln for ln in r.iter_lines() if ln.startswith("data: {"))
            next(it), next(it)
        deadline = time.time() + 10
        while not any(ln.startswith("left ") for ln in lines) and time.time() < deadline:
            time.sleep(0.05)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    whole = [ln for ln in lines if ln.startswith("whole ")]
    assert len(whole) == 1
    assert re.fullmatch(rf"whole POST /v1/completions 200 prompt_tokens={n_prompt} output_tokens=8 "
                        r"ttft=\d+\.\d{3}s e2e=\d+\.\d{3}s", whole[0]), whole[0]
    left = [ln for ln in lines if ln.startswith("left ")]
    assert len(left) == 1
    m = re.fullmatch(rf"left POST /v1/completions 200 prompt_tokens={n_prompt} output_tokens=(\d+) "
                     r"ttft=\d+\.\d{3}s e2e=\d+\.\d{3}s", left[0])
    assert m and 2 <= int(m.group(1)) < 200, left[0]
    assert server.idle_and_free(timeout=20)


@pytest.mark.slow
def test_256_streaming_clients_with_30_percent_disconnects(server):
    """Every client that stays gets the greedy text its prompt gets alone; the ones that go
    away (before the first token, or after 1-4 chunks) free everything they held."""
    prompts = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
               "The three primary colors are", "Question: What is 17 plus 25? Answer:",
               "My favorite recipe for pancakes starts with", "Water boils at a temperature of",
               "A list of the planets in the solar system:"]
    n_clients, max_tokens = 256, 8

    def body(p, stream):
        return {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}

    alone = {p: httpx.post(f"{server.url}/v1/completions", json=body(p, False), headers=AUTH,
                           timeout=60).json()["choices"][0]["text"] for p in prompts}
    rng = random.Random(7)
    plan = [(prompts[i % len(prompts)], rng.choice([0, 1, 2, 4]) if rng.random() < 0.3 else None)
            for i in range(n_clients)]

    async def run():
        limits = httpx.Limits(max_connections=n_clients + 8, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=300, headers=AUTH, limits=limits) as c:
            async def one(prompt, leave_after):
                import json
                text, chunks = "", 0
                async with c.stream("POST", f"{server.url}/v1/completions", json=body(prompt, True)) as r:
                    assert r.status_code == 200
                    if leave_after == 0:
                        return None   # before any token: the request is in prefill or waiting
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            text += json.loads(line[6:])["choices"][0]["text"]
                            chunks += 1
                            if leave_after is not None and chunks >= leave_after:
                                return None
                return text
            return await asyncio.wait_for(asyncio.gather(*[one(p, k) for p, k in plan]), 240)

    def aborted() -> float:
        m = re.search(r'^vllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)$',
                      httpx.get(f"{server.url}/metrics", headers=AUTH).text, re.M)
        return float(m.group(1)) if m else 0.0

    aborted_before = aborted()
    results = asyncio.run(run())
    stayed = [(p, t) for (p, k), t in zip(plan, results) if k is None]
    assert len(stayed) > 150
    wrong = [(p, t) for p, t in stayed if t != alone[p]]
    assert not wrong, f"{len(wrong)} of {len(stayed)} texts differ from alone, e.g. {wrong[0]}"
    assert server.idle_and_free(timeout=20)
    deadline = time.time() + 10
    while time.time() < deadline:   # the gauges follow the core's news of the aborts
        m = httpx.get(f"{server.url}/metrics", headers=AUTH).text
        vals = [_metric(m, f"vllm:{g}") for g in ("num_requests_running", "num_requests_waiting",
                                                  "kv_cache_usage_perc")]
        if vals == [0, 0, 0]:
            break
        time.sleep(0.2)
    assert vals == [0, 0, 0], vals
    # every client gone before its first token aborted its request, and the engine in its
    # own process counts those (a client gone later may have been sent its last token)
    n_left = sum(k is not None for _, k in plan)
    assert sum(k == 0 for _, k in plan) <= aborted() - aborted_before <= n_left


@pytest.fixture(scope="module")
def tiny_server(tiny_dir):  # noqa: F811 (fixture)
    s = _Server(engine_kw=dict(model=tiny_dir, engine_process=True, max_model_len=128, max_num_seqs=8))
    yield s
    s.stop()


@pytest.mark.serial   # timing-sensitive: run alone, after the parallel part of `make test`
def test_backpressure_503_with_retry_after(tiny_dir):  # noqa: F811 (fixture)
    """One request runs (max_num_seqs 1) and one waits: the next is refused at once."""
    s = _Server(engine_kw=dict(model=tiny_dir, engine_process=True, max_model_len=1024, max_num_seqs=1),
                max_waiting_requests=1)
    try:
        long = {"prompt": "Count:", "max_tokens": 1000, "ignore_eos": True, "temperature": 0}

        async def go():
            async with httpx.AsyncClient(timeout=120) as c:
                first = asyncio.ensure_future(c.post(f"{s.url}/v1/completions", json=long))
                for _ in range(500):   # until it runs and the server has seen a step since
                    await asyncio.sleep(0.02)   # (its waiting count errs high until then)
                    if s.engine.engine.get_scheduler_stats().num_running == 1 and s.engine.num_waiting() == 0:
                        break
                second = asyncio.ensure_future(c.post(f"{s.url}/v1/completions", json=long))
                await asyncio.sleep(0.3)
                third = await c.post(f"{s.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1})
                chat = await c.post(f"{s.url}/v1/chat/completions",
                                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
                health = await c.get(f"{s.url}/health")
                return await first, await second, third, chat, health

        first, second, third, chat, health = asyncio.run(go())
        assert first.status_code == second.status_code == 200
        for r in (third, chat):
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == 503 and "max-waiting-requests" in r.json()["error"]["message"]
        assert health.status_code == 200
        # once the queue has drained, requests are served again
        ok = httpx.post(f"{s.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=60)
        assert ok.status_code == 200
        assert s.idle_and_free()
    finally:
        s.stop()


@pytest.mark.slow
def test_schemathesis_no_5xx_and_openai_shaped_4xx(tiny_server):
    """A few hundred generated requests over every route of /openapi.json (4xx in Anthropic's
    shape on the Messages routes)."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(f"{tiny_server.url}/openapi.json")
    failures, calls = [], [0]

    for op in schema.get_all_operations():
        operation = op.ok()

        @settings(max_examples=80, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def check(case):
            if isinstance(case.body, dict):
                case.body.pop("stream", None)   # streamed bodies are checked elsewhere
                if "max_tokens" in case.body and isinstance(case.body["max_tokens"], int):
                    case.body["max_tokens"] = min(case.body["max_tokens"], 8)
            r = case.call(timeout=60)
            calls[0] += 1
            if r.status_code >= 500:
                failures.append((case.method, case.path, r.status_code, r.text[:200]))
            elif r.status_code >= 400:
                body = r.json()
                err = body.get("error", {})
                if case.path.startswith("/v1/messages"):   # Anthropic's error shape
                    if not (body.get("type") == "error" and set(err) == {"type", "message"}
                            and isinstance(err["message"], str)):
                        failures.append((case.method, case.path, r.status_code, r.text[:200]))
                elif not (isinstance(err.get("message"), str) and "type" in err and err.get("code") == r.status_code
                          and "param" in err):
                    failures.append((case.method, case.path, r.status_code, r.text[:200]))

        check()
    assert not failures, failures[:5]
    assert calls[0] >= 300
    assert tiny_server.idle_and_free()


def _spawn_server(*flags: str) -> tuple[subprocess.Popen, str]:
    """``pagedllm serve`` in float32 on one thread and a free port, in a session of its own
    (so a signal can go to its whole process group), stderr piped; (process, base URL)."""
    port = _free_port()
    env = {**os.environ, "PAGEDLLM_LOG_LEVEL": "INFO"}
    p = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(port),
                          "--dtype", "float32", "--num-threads", "1", *flags],
                         stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    return p, f"http://127.0.0.1:{port}"


def _wait_healthy(url: str, deadline: float) -> None:
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)


@pytest.mark.serial   # timing-sensitive: run alone, after the parallel part of `make test`
def test_sigterm_drains_a_long_stream_and_exits_0_without_orphans():
    """SIGTERM to the server's whole process group, as Ctrl-C, ``kill -- -PGID`` or a
    process supervisor send it: the engine core (in a group of its own) keeps serving
    while the front end drains, and nothing reports a death."""
    p, url = _spawn_server("--max-model-len", "256", "--kv-cache-memory", "64MiB", "--shutdown-timeout", "60")
    try:
        engine_pid = None
        deadline = time.time() + 120
        while engine_pid is None and time.time() < deadline:
            line = p.stderr.readline()
            m = re.search(r"engine core running in process (\d+)", line)
            if m:
                engine_pid = int(m.group(1))
            assert line or p.poll() is None, "the server exited while starting"
        assert engine_pid is not None
        _wait_healthy(url, deadline)
        body = {"prompt": "Count to a hundred:", "max_tokens": 40, "ignore_eos": True, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        chunks, done, last = 0, False, None
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    last = line
                    if chunks == 2:
                        os.killpg(p.pid, signal.SIGTERM)
                        time.sleep(0.5)
                        with pytest.raises(httpx.ConnectError):   # no longer accepting
                            httpx.get(f"{url}/health", timeout=2)
                done = done or line == "data: [DONE]"
        # the in-flight stream finished whole
        assert done and '"completion_tokens": 40' in last
        assert p.wait(60) == 0
        assert _wait_gone(engine_pid, 5), "the engine process outlived the server"
        rest = p.stderr.read()
        assert "ERROR" not in rest and "Traceback" not in rest, rest[-2000:]
        assert "server stopped" in rest
    finally:
        if p.poll() is None:
            p.kill()
        p.stderr.close()
    assert not _alive(engine_pid)


@pytest.mark.serial   # timing-sensitive: run alone, after the parallel part of `make test`
def test_requests_past_the_drain_time_end_with_a_503_not_a_cut():
    """``--shutdown-timeout 2`` with two requests far longer than that: just before the
    drain time runs out, the stream gets a 503 error event and ``[DONE]`` and the whole
    response an OpenAI-style 503 (uvicorn would cancel them: a cut stream, a plain-text
    500 and tracebacks); the server still exits 0 without an ERROR line."""
    import threading

    p, url = _spawn_server("--max-model-len", "4096", "--kv-cache-memory", "256MiB", "--shutdown-timeout", "2")
    try:
        _wait_healthy(url, time.time() + 120)
        body = {"prompt": "Count:", "max_tokens": 3000, "ignore_eos": True, "temperature": 0}
        whole = {}
        t = threading.Thread(target=lambda: whole.update(
            r=httpx.post(f"{url}/v1/completions", json=body, timeout=120)))
        t.start()
        lines = []
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    if len(lines) == 2:
                        os.killpg(p.pid, signal.SIGTERM)
        t.join(60)
        assert lines[-1] == "data: [DONE]"
        err = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert err["code"] == 503 and "shutting down" in err["message"]
        assert whole["r"].status_code == 503 and whole["r"].json()["error"]["type"] == "service_unavailable"
        assert p.wait(60) == 0
        rest = p.stderr.read()
        assert "ended 2 request(s) still running" in rest and "server stopped" in rest
        assert "ERROR" not in rest and "Traceback" not in rest, rest[-2000:]
    finally:
        if p.poll() is None:
            p.kill()
        p.stderr.close()
