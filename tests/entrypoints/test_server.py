"""The OpenAI-compatible server, in-process (uvicorn in a thread) so the tests can look at
the engine's KV blocks: the official ``openai`` client, streaming vs non-streaming text
(English and Korean), disconnects freeing blocks, bad input → HTTP 400 naming the
parameter while the server keeps serving."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
from server_helpers import MAX_MODEL_LEN, _Server

from pagedllm.entrypoints.openai.api_server import build_app

pytestmark = pytest.mark.slow   # server end-to-end suite on the bundled model


@pytest.fixture(scope="module")
def server():
    s = _Server()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(autouse=True)
def _blocks_free_after(server):
    yield
    assert server.idle_and_free(), "server left requests or KV blocks behind"


def test_models_and_health(server, client):
    models = client.models.list().data
    assert len(models) == 1 and models[0].id == server.engine.model_name
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_model_retrieve_and_a_fixed_card(server, client):
    """The openai client's models.retrieve works; the card's ``created`` is the server's
    start (the same on every call) and ``root`` is the served name, not a filesystem path."""
    name = server.engine.model_name
    listed = client.models.list().data[0]
    time.sleep(1.1)
    got = client.models.retrieve(name)
    assert got.model_dump() == client.models.list().data[0].model_dump() == listed.model_dump()
    assert (got.id, got.object, got.owned_by, got.root) == (name, "model", "pagedllm", name)
    assert got.max_model_len == MAX_MODEL_LEN
    assert got.created <= time.time() - 1
    assert server.engine.model_path not in httpx.get(f"{server.url}/v1/models").text
    for unknown in ("nope", "org/nope"):
        r = httpx.get(f"{server.url}/v1/models/{unknown}", timeout=30)
        assert r.status_code == 404
        assert r.json() == {"error": {"message": f"The model `{unknown}` does not exist.",
                                      "type": "NotFoundError", "param": "model", "code": 404}}
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_chat_answers_and_usage(client, server):
    r = client.chat.completions.create(model=server.engine.model_name, temperature=0, max_tokens=16,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 16 and r.usage.prompt_tokens > 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completions_match_offline_greedy(client, server):
    """The server's greedy text equals the engine's own offline result for the same prompt."""
    prompt = "The three primary colors are"
    r = client.completions.create(model=server.engine.model_name, prompt=prompt, max_tokens=12, temperature=0)
    ids = server.engine.tokenizer.encode(prompt)
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
    # batch of two prompts: choices indexed in order, same text for the repeated prompt
    r2 = client.completions.create(model=server.engine.model_name, prompt=[prompt, "Water boils at"],
                                   max_tokens=12, temperature=0)
    assert [c.index for c in r2.choices] == [0, 1]
    assert r2.choices[0].text == r.choices[0].text


@pytest.mark.parametrize("content", [
    "Write two sentences about the ocean.",
    "Say hi in Korean",
])
def test_stream_concatenates_to_full_text(client, server, content):
    kw = dict(model=server.engine.model_name, temperature=0, max_tokens=48,
              messages=[{"role": "user", "content": content}])
    full = client.chat.completions.create(**kw)
    text = full.choices[0].message.content
    parts, finish, usage = [], None, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                assert "\ufffd" not in c.delta.content
                parts.append(c.delta.content)
            if c.finish_reason:
                finish = c.finish_reason
    assert "".join(parts) == text
    assert finish == full.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    if "Korean" in content:
        assert any("\uac00" <= ch <= "\ud7a3" for ch in text), text  # Hangul was produced


def test_completion_stream_sse_shape(server):
    body = {"model": server.engine.model_name, "prompt": "Once upon a time", "max_tokens": 8,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[len("data: "):]) for ln in lines[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_stop_string_excluded(client, server):
    r = client.completions.create(model=server.engine.model_name, prompt="1, 2, 3, 4,", max_tokens=30,
                                  temperature=0, stop=[" 7"])
    assert r.choices[0].finish_reason == "stop"
    assert " 7" not in r.choices[0].text and r.choices[0].text.strip().startswith("5")


def _stream_then_disconnect(server, at_third_chunk) -> None:
    """Stream a long completion, call ``at_third_chunk()`` when the third chunk arrives,
    then close the connection without reading the rest."""
    body = {"model": server.engine.model_name, "prompt": "Tell me a very long story about dragons.",
            "max_tokens": 500, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            got = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    got += 1
                    if got == 3:
                        at_third_chunk()
                        break


def test_disconnect_mid_stream_frees_blocks(server):
    """A client that goes away mid-stream aborts its request; its blocks are freed."""
    def holds_blocks():
        assert server.engine.engine.get_scheduler_stats().num_blocks_used > 0

    _stream_then_disconnect(server, holds_blocks)
    assert server.idle_and_free(timeout=10)


def test_disconnect_non_streaming_frees_blocks(server):
    body = {"model": server.engine.model_name, "prompt": "Count to a thousand:", "max_tokens": 900,
            "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=1.5)
    assert server.idle_and_free(timeout=10)


@pytest.mark.parametrize("field,value", [
    ("max_tokens", -1),
    ("temperature", -0.5),
    ("top_p", 0),
    ("top_p", 1.5),
    ("max_tokens", "many"),
    ("temperature", "hot"),
    ("stop", 7),
])
def test_bad_input_is_400_naming_param(server, client, field, value):
    body = {"model": server.engine.model_name, "prompt": "hi", "max_tokens": 4, field: value}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["type"] == "invalid_request_error" and err["message"]
    # the server keeps serving
    ok = client.completions.create(model=server.engine.model_name, prompt="hi", max_tokens=2)
    assert ok.usage.completion_tokens == 2


@pytest.mark.parametrize("method,path,status", [("GET", "/v1/nope", 404), ("GET", "/v1/completions", 405)])
def test_unknown_route_and_method_have_openai_error_shape(server, method, path, status):
    r = httpx.request(method, f"{server.url}{path}", timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["message"] and "detail" not in r.json(), r.text


def test_max_completion_tokens_wins_and_is_named(server):
    """OpenAI's current field takes precedence over the deprecated max_tokens, and an
    error in it names it."""
    body = {"model": server.engine.model_name, "messages": [{"role": "user", "content": "Tell me a story."}],
            "temperature": 0, "ignore_eos": True, "max_completion_tokens": 3, "max_tokens": 5}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    r = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "max_completion_tokens": 0}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens", r.text
    # Over max_model_len (checked when the request is added), with max_tokens absent.
    del body["max_tokens"]
    r = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "max_completion_tokens": 10**30}, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "max_completion_tokens", r.text
    assert "max_tokens" not in err["message"].replace("max_completion_tokens", ""), r.text


def test_prompt_over_max_model_len_is_400(server, client):
    long_prompt = "hello " * (MAX_MODEL_LEN + 50)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.engine.model_name, prompt=long_prompt, max_tokens=4)
    assert e.value.body["param"] == "prompt" and str(MAX_MODEL_LEN) in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.engine.model_name, prompt="hi", max_tokens=MAX_MODEL_LEN)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.engine.model_name, max_tokens=4,
                                       messages=[{"role": "user", "content": long_prompt}])
    assert e.value.body["param"] == "messages"
    assert client.completions.create(model=server.engine.model_name, prompt="hi", max_tokens=2).choices


def test_wrong_type_chat_messages_400(server):
    r = httpx.post(f"{server.url}/v1/chat/completions",
                   json={"model": server.engine.model_name, "messages": "hello"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(f"{server.url}/v1/chat/completions",
                   json={"model": server.engine.model_name, "messages": []}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_unknown_model_404(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "nope", "prompt": "hi"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


@pytest.mark.parametrize("path, raw, status, param", [
    ("completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', 400, "prompt"),
    ("completions", '{"prompt": "hi", "model": "\\ud800"}', 404, "model"),
    ("chat/completions", '{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}', 400,
     "messages"),
    ("completions", '{"prompt": "a", "stop": ["\\ud800"], "max_tokens": 2}', 400, "stop"),
    ("completions", '{"prompt": "a", "stop": ["x"], "n": 2, "cache_salt": "\\ud800", "max_tokens": 2}', 400,
     "cache_salt"),
    ("completions", '{"prompt": "a", "bad_words": ["\\ud800"], "max_tokens": 2}', 400, "bad_words"),
    ("chat/completions", '{"messages": [{"role": "user", "content": "a"}], "stream": true, "max_tokens": 2, '
                         '"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": '
                         '{"type": "string", "pattern": "\\ud800"}}}}', 400, "response_format"),
    ("chat/completions", '{"messages": [{"role": "user", "content": "a"}], "max_tokens": 2, "response_format": '
                         '{"type": "json_schema", "json_schema": {"name": "s", "schema": {"enum": ["\\ud800"]}}}}',
     400, "response_format"),
    ("chat/completions", '{"messages": [{"role": "user", "content": "a"}], "max_tokens": 2, "tool_choice": "none", '
                         '"tools": [{"type": "function", "function": {"name": "f", "description": "\\ud800"}}]}',
     400, "tools"),
])
def test_lone_surrogates_are_client_errors(server, path, raw, status, param):
    """JSON may escape a lone UTF-16 surrogate, which has no UTF-8 form: the request is
    refused naming the field (it was a 500 before), and the server keeps serving."""
    r = httpx.post(f"{server.url}/v1/{path}", content=raw.encode(), timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    assert server.idle_and_free(timeout=10)
    assert _post(server, "completions", _body(server, "completions")).status_code == 200


def test_concurrent_requests_all_served(server):
    """Many connections at once are batched by the one engine loop; greedy results equal
    the one-at-a-time results."""
    prompts = [f"Fact number {i} about cats:" for i in range(8)]

    async def one(c, p):
        r = await c.post(f"{server.url}/v1/completions", json={
            "model": server.engine.model_name, "prompt": p, "max_tokens": 10, "temperature": 0})
        return r.json()["choices"][0]["text"]

    async def run_all():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*[one(c, p) for p in prompts])

    together = asyncio.run(run_all())
    alone = [httpx.post(f"{server.url}/v1/completions", json={
        "model": server.engine.model_name, "prompt": p, "max_tokens": 10, "temperature": 0},
        timeout=60).json()["choices"][0]["text"] for p in prompts[:3]]
    assert together[:3] == alone


def test_metrics_exposed(server, client):
    client.completions.create(model=server.engine.model_name, prompt="hello there", max_tokens=3)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_queue_time_seconds_count", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:num_requests_running",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total"):
        assert name in text, name
    gen = [ln for ln in text.splitlines() if ln.startswith("vllm:generation_tokens_total")]
    assert float(gen[0].split()[-1]) >= 3


def test_cache_salt_and_reset_prefix_cache(server):
    prompt = list(range(5000, 5070))  # 70 tokens: 4 full blocks can be reused

    def cached(salt=None):
        body = {"model": server.engine.model_name, "prompt": prompt, "max_tokens": 2, "temperature": 0}
        if salt:
            body["cache_salt"] = salt
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("a") == 0
    assert cached("a") == 64
    assert cached("b") == 0
    assert cached() == 0
    r = httpx.post(f"{server.url}/reset_prefix_cache", timeout=30)
    assert r.status_code == 200 and r.json()["num_blocks_dropped"] > 0
    assert cached("a") == 0
    bad = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "cache_salt": ""}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"


# --------------------------------------------------------------------------------------
# Request hygiene: bodies that are not JSON objects, fields we would silently ignore,
# request-supplied chat templates, and no tokenizer work on the event loop.
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
@pytest.mark.parametrize("content,ctype,needle", [
    ('{"prompt": "hi", ', "application/json", "not valid JSON"),
    ("{not json", "application/json", "not valid JSON"),
    ("[1, 2]", "application/json", "must be a JSON object"),
    ('{"prompt": "hi"}', "text/plain", "Content-Type: application/json"),
    ("", "application/json", "empty"),
])
def test_body_not_a_json_object_is_400(server, endpoint, content, ctype, needle):
    r = httpx.post(f"{server.url}/v1/{endpoint}", content=content, headers={"content-type": ctype},
                   timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] is None and err["type"] == "invalid_request_error"
    assert needle in err["message"], err["message"]


def _body(server, endpoint: str) -> dict:
    base = {"model": server.engine.model_name, "max_tokens": 2, "temperature": 0}
    if endpoint == "chat":
        return {**base, "messages": [{"role": "user", "content": "Hi"}]}
    return {**base, "prompt": "Hi"}


def _post(server, endpoint: str, body: dict) -> httpx.Response:
    path = "chat/completions" if endpoint == "chat" else "completions"
    return httpx.post(f"{server.url}/v1/{path}", json=body, timeout=60)


@pytest.mark.parametrize("endpoint,field,value", [
    ("chat", "tool_choice", "required"),          # no tools to call
    ("chat", "top_logprobs", 3),                  # without logprobs: true
    ("chat", "reasoning_effort", "low"),
    ("chat", "echo", True),
    ("chat", "functions", [{"name": "f"}]),       # deprecated: tools instead
    ("chat", "response_format", {"type": "json_schema"}),   # no schema
    ("chat", "logit_bias", {"x": 5}),
    ("chat", "logit_bias", {"1_0": 5}),           # int() reads these three as 10, 1 and 3
    ("completions", "logit_bias", {" 1": 5}),
    ("completions", "logit_bias", {"\u0663": 5}),
    ("completions", "logit_bias", {"1": 5, "01": -5}),   # one token, two biases
    ("completions", "best_of", 2),                # vLLM V1: best_of > n is not supported
    ("completions", "suffix", " the end"),
    ("completions", "logprobs", 21),
    ("completions", "structured_outputs", {"regex": "(unclosed"}),
    ("completions", "guided_json", {"type": "object"}),
    ("completions", "max_token", 5),  # a typo is not ignored either
])
def test_unsupported_field_is_400_naming_it(server, endpoint, field, value):
    r = _post(server, endpoint, {**_body(server, endpoint), field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["type"] == "invalid_request_error", err
    assert field in err["message"]


def test_neutral_and_harmless_fields_accepted(server, client):
    """Fields the openai client sends when a user sets them to their neutral value, and
    fields that do not change the output, are accepted."""
    kw = dict(model=server.engine.model_name, max_tokens=2, temperature=0)
    r = client.chat.completions.create(
        messages=[{"role": "user", "content": "Hi"}], n=1, presence_penalty=0, frequency_penalty=0.0,
        logprobs=False, logit_bias={}, user="u-1", metadata={"team": "a"}, store=False,
        response_format={"type": "text"}, tool_choice="none", parallel_tool_calls=False,
        stream_options=None, **kw)
    assert r.usage.completion_tokens == 2
    r = client.completions.create(prompt="Hi", n=1, best_of=1, echo=False, suffix=None, logprobs=None,
                                  user="u-1", **kw)
    assert r.usage.completion_tokens == 2
    r = _post(server, "chat", {**_body(server, "chat"), "tools": [], "top_logprobs": 0,
                               "repetition_penalty": 1.0, "modalities": ["text"]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


_CONTENT_ONLY_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_request_chat_template_needs_trust(server):
    body = {**_body(server, "chat"), "messages": [{"role": "user", "content": "Hello there"}],
            "chat_template": _CONTENT_ONLY_TEMPLATE}
    r = _post(server, "chat", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "chat_template" and "--trust-request-chat-template" in err["message"]

    # The same engine behind an app that trusts request templates renders it.
    app = build_app(server.engine, trust_request_chat_template=True)

    async def post(b):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as c:
            return await c.post("/v1/chat/completions", json=b, timeout=60)

    r = asyncio.run(post(body))
    assert r.status_code == 200, r.text
    want = len(server.engine.tokenizer.encode("Hello there", add_special_tokens=False))
    assert r.json()["usage"]["prompt_tokens"] == want
    r = asyncio.run(post({**body, "chat_template": "{% for m in messages %}"}))  # unclosed block
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text


def test_tokenize_chat_template_needs_trust(server):
    """/tokenize takes a request chat_template under --trust-request-chat-template, as chat
    does, and counts what chat would prompt with; without the flag, or with a prompt, a 400."""
    body = {"messages": [{"role": "user", "content": "Hello there"}], "chat_template": _CONTENT_ONLY_TEMPLATE}
    r = httpx.post(f"{server.url}/tokenize", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    assert "--trust-request-chat-template" in r.json()["error"]["message"]
    app = build_app(server.engine, trust_request_chat_template=True)

    async def post(path, b):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as c:
            return await c.post(path, json=b, timeout=60)

    r = asyncio.run(post("/tokenize", body))
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == server.engine.tokenizer.encode("Hello there", add_special_tokens=False)
    chat = asyncio.run(post("/v1/chat/completions", {**_body(server, "chat"), **body}))
    assert chat.json()["usage"]["prompt_tokens"] == r.json()["count"]
    r = asyncio.run(post("/v1/chat/completions", {**_body(server, "chat"), **body, "chat_template": ""}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    for bad, param in [({**body, "chat_template": "{% for m in messages %}"}, "chat_template"),
                       ({**body, "chat_template": ""}, "chat_template"),
                       ({"prompt": "Hello", "chat_template": _CONTENT_ONLY_TEMPLATE}, "chat_template")]:
        r = asyncio.run(post("/tokenize", bad))
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_chat_template_kwargs(server):
    """chat_template_kwargs reach the template as variables (vLLM's field); a template that
    does not use one ignores it; names the renderer owns and non-objects are a 400."""
    base = {**_body(server, "chat"), "messages": [{"role": "user", "content": "Hello there"}]}
    plain = _post(server, "chat", base)
    assert plain.status_code == 200, plain.text
    r = _post(server, "chat", {**base, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]
    for bad, words in [({"tokenize": True}, "may not set tokenize"),
                       ({"messages": [], "add_generation_prompt": False}, "add_generation_prompt, messages"),
                       (5, "expected an object (got an integer)"),
                       (["enable_thinking"], "expected an object (got an array of strings)")]:
        r = _post(server, "chat", {**base, "chat_template_kwargs": bad})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "chat_template_kwargs" and words in err["message"], err

    app = build_app(server.engine, trust_request_chat_template=True)
    template = "{% if shout %}LOUD {% endif %}" + _CONTENT_ONLY_TEMPLATE

    async def post(b):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as c:
            return await c.post("/v1/chat/completions", json=b, timeout=60)

    for kwargs, text in [({"shout": True}, "LOUD Hello there"), (None, "Hello there")]:
        r = asyncio.run(post({**base, "chat_template": template, "chat_template_kwargs": kwargs}))
        assert r.status_code == 200, r.text
        want = len(server.engine.tokenizer.encode(text, add_special_tokens=False))
        assert r.json()["usage"]["prompt_tokens"] == want


@pytest.mark.parametrize("endpoint,method", [("chat", "apply_chat_template"),
                                             ("completions", "process")])
def test_tokenizer_work_runs_off_the_event_loop(server, monkeypatch, endpoint, method):
    """While a chat template renders (or a prompt is tokenized) the server keeps answering:
    the work is held here until /health has answered, which it could not do if the work
    ran on the event loop."""
    started, release = threading.Event(), threading.Event()
    original = getattr(server.engine.engine, method)

    def held(*args, **kwargs):
        started.set()
        release.wait(30)
        return original(*args, **kwargs)

    monkeypatch.setattr(server.engine.engine, method, held)
    result = {}
    t = threading.Thread(target=lambda: result.update(r=_post(server, endpoint, _body(server, endpoint))))
    t.start()
    try:
        assert started.wait(30)
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        assert not result  # the request is still held
    finally:
        release.set()
        t.join(60)
    assert result["r"].status_code == 200, result["r"].text
    assert result["r"].json()["usage"]["completion_tokens"] == 2


def _metric(text: str, name: str, **labels) -> float:
    for ln in text.splitlines():
        if ln.startswith(name) and ln[len(name)] in "{ " and all(f'{k}="{v}"' in ln for k, v in labels.items()):
            return float(ln.split()[-1])
    raise KeyError(f"{name} {labels} not in /metrics")


def test_abort_on_idle_server_refreshes_metrics(server):
    """A client that disconnects leaves an idle engine that takes no further step: the
    gauges must still show it gone, and the abort is counted as vLLM counts it."""
    def read():
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        return (_metric(text, "vllm:num_requests_running"), _metric(text, "vllm:num_requests_waiting"),
                _metric(text, "vllm:kv_cache_usage_perc"),
                _metric(text, "vllm:request_success_total", finished_reason="abort"))

    aborted_before = read()[3]

    def running_with_blocks():
        running, _, kv, _ = read()
        assert running == 1 and kv > 0

    _stream_then_disconnect(server, running_with_blocks)
    assert server.idle_and_free(timeout=10)
    deadline = time.time() + 10
    while (now := read()) != (0, 0, 0, aborted_before + 1) and time.time() < deadline:
        time.sleep(0.05)
    assert now == (0, 0, 0, aborted_before + 1)


def test_bad_prompt_in_a_list_queues_none_of_them(server):
    """A completions request with several prompts is validated whole before any prompt is
    queued: one bad prompt is a 400 and no request was admitted (nor aborted)."""
    def aborted():
        return _metric(httpx.get(f"{server.url}/metrics", timeout=30).text,
                       "vllm:request_success_total", finished_reason="abort")

    before = aborted()
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"model": server.engine.model_name, "prompt": ["hi", "hello", ""], "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert server.idle_and_free(timeout=10)
    assert aborted() == before
    assert not server.engine._streams


def test_chat_message_extra_keys_reach_the_template(server):
    """Keys beside role/content (a message's name, an assistant's tool_calls) are kept for
    the chat template, as normalize_chat_messages documents, not dropped by the HTTP layer."""
    seen = []
    orig = server.engine.engine.apply_chat_template

    def spy(messages, *args, **kw):
        seen.append(messages)
        return orig(messages, *args, **kw)

    server.engine.engine.apply_chat_template = spy
    try:
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": server.engine.model_name, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": "hi", "name": "bob"}]})
    finally:
        del server.engine.engine.apply_chat_template
    assert r.status_code == 200, r.text
    assert seen and seen[0][0]["name"] == "bob"


def _text_both_ways(server, endpoint: str, body: dict) -> tuple[str, str, dict]:
    """(non-streamed text, concatenated streamed deltas, non-streamed choice) for ``body``."""
    r = _post(server, endpoint, body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    full = choice["message"]["content"] if endpoint == "chat" else choice["text"]
    path = "chat/completions" if endpoint == "chat" else "completions"
    parts = []
    with httpx.stream("POST", f"{server.url}/v1/{path}", json={**body, "stream": True}, timeout=60) as s:
        assert s.status_code == 200
        for ln in s.iter_lines():
            if ln.startswith("data: {"):
                for c in json.loads(ln[len("data: "):])["choices"]:
                    parts.append((c["delta"].get("content") if endpoint == "chat" else c["text"]) or "")
    return full, "".join(parts), choice


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_only_with_include_stop_str(server, include):
    """vLLM leaves the text of the stop token id that ended a request out of ``text`` and
    out of every streamed delta, unless include_stop_str_in_output (token 1797 is " United")."""
    body = {"model": server.engine.model_name, "prompt": "The capital city of France is", "max_tokens": 24,
            "temperature": 0, "stop_token_ids": [1797], "include_stop_str_in_output": include}
    full, streamed, choice = _text_both_ways(server, "completions", body)
    want = " Paris.\n\nThe United" if include else " Paris.\n\nThe"
    assert (full, streamed) == (want, want)
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", 1797)


@pytest.mark.parametrize("include", [False, True])
def test_eos_text_only_with_include_stop_str(server, include):
    """With skip_special_tokens false the EOS that ended a chat answer is not in its text
    (nor in the stream) unless include_stop_str_in_output."""
    body = {**_body(server, "chat"), "max_tokens": 64, "skip_special_tokens": False,
            "include_stop_str_in_output": include}
    full, streamed, choice = _text_both_ways(server, "chat", body)
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] is None
    assert full == streamed
    assert full.endswith("<|im_end|>") == include
    assert full.count("<|im_end|>") == int(include)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_null_optional_fields_mean_their_default(server, endpoint):
    nulls = {"n": None, "stream": None, "stream_options": None, "min_tokens": None, "ignore_eos": None,
             "include_stop_str_in_output": None, "skip_special_tokens": None, "seed": None, "stop": None}
    if endpoint == "chat":
        nulls["add_generation_prompt"] = None
    plain = _post(server, endpoint, _body(server, endpoint))
    r = _post(server, endpoint, {**_body(server, endpoint), **nulls})
    assert r.status_code == 200, r.text
    key = "message" if endpoint == "chat" else "text"
    assert r.json()["choices"][0][key] == plain.json()["choices"][0][key]
    assert r.json()["usage"] == plain.json()["usage"]
    r = _post(server, endpoint, {**_body(server, endpoint), "frobnicate": None})
    assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate"


def test_prompt_tokens_counter_includes_prefix_cached_tokens(server):
    """vllm:prompt_tokens_total grows by each request's usage.prompt_tokens, cached or not
    (two identical ~310-token prompts added 310 + 6); cache hits have their own counter."""
    prompt = list(range(6000, 6310))

    def read():
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        return _metric(text, "vllm:prompt_tokens_total"), _metric(text, "vllm:prefix_cache_hits_total")

    tokens0, hits0 = read()
    usages = []
    for _ in range(2):
        r = _post(server, "completions", {**_body(server, "completions"), "prompt": prompt})
        assert r.status_code == 200, r.text
        usages.append(r.json()["usage"])
    assert [u["prompt_tokens"] for u in usages] == [310, 310]
    cached = usages[1]["prompt_tokens_details"]["cached_tokens"]
    assert cached == 304
    tokens1, hits1 = read()
    assert tokens1 - tokens0 == 620
    assert hits1 - hits0 == cached
