"""Anthropic's Messages API (pagedllm/entrypoints/anthropic/). Without a model: the request's
conversion to a chat request, the streamed block events, the error translation. Over HTTP
with the official ``anthropic`` client on the bundled model (float32; slow), the server run
with ``--enable-auto-tool-choice --tool-call-parser hermes`` and an API key sent as
``x-api-key``: text answers whose usage agrees with count_tokens, /tokenize and the same chat
request; streams that the client's typed models parse and that end as the whole message
does; max_tokens and stop_sequences stops; forced tool calls that validate; a tool loop;
prefix-cache reads; errors in Anthropic's shape naming the field."""
from __future__ import annotations

import json
import re

import httpx
import pytest

from pagedllm.entrypoints.anthropic.errors import from_openai, stream_error_body
from pagedllm.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from pagedllm.entrypoints.anthropic.serving_messages import BlockEvents, stop_reason
from pagedllm.errors import EngineDeadError, InvalidParameterError, ServerShuttingDownError

KEY = "messages-test-key"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER},
         {"name": "get_time", "description": "Local time in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
GREEDY = {"temperature": 0}   # the client has no temperature argument: sent as an extra field
ASK = [{"role": "user", "content": "What is the capital of France?"}]


def _request(**kw) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 8, **kw})


# --------------------------------------------------------------------------------------
# Without a model
# --------------------------------------------------------------------------------------
def test_conversion_to_a_chat_request():
    body = _request(
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": [
                      {"type": "text", "text": "Let me look."},
                      {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "21 C"}]},
                      {"type": "text", "text": "And in Rome?"}]}],
        tools=TOOLS, tool_choice={"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
        stop_sequences=["END"], temperature=0, top_k=5, metadata={"user_id": "u-1"})
    chat = body.to_chat_request()
    assert [m.model_dump() for m in chat.messages] == [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}],
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "21 C", "tool_call_id": "toolu_1"},
        {"role": "user", "content": [{"type": "text", "text": "And in Rome?"}]}]
    assert chat.tools == [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                            "parameters": t["input_schema"]}} for t in TOOLS]
    assert (chat.tool_choice, chat.parallel_tool_calls) == ({"type": "function", "function": {"name": "get_time"}},
                                                            False)
    assert (chat.max_tokens, chat.stop, chat.temperature, chat.top_k, chat.user) == (8, ["END"], 0.0, 5, "u-1")
    for kind, expected in (("auto", "auto"), ("any", "required"), ("none", "none")):
        assert _request(messages=ASK, tools=TOOLS, tool_choice={"type": kind}).to_chat_request().tool_choice == expected
    error = _request(messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "x", "is_error": True}]}])
    with pytest.raises(InvalidParameterError, match="toolu_x"):
        error.to_chat_request()
    counted = CountTokensRequest.model_validate({"model": "m", "messages": ASK}).to_chat_request()
    assert counted.max_tokens is None and not counted.stream
    # the engine's parameter names come back as the Messages API's
    e = chat.to_api_error(InvalidParameterError("stop", "stop must be a non-empty string"))
    assert (e.param, str(e)) == ("stop_sequences", "stop_sequences must be a non-empty string")
    assert chat.TOOL_SCHEMA == "tools[].input_schema"   # a forced call's bad schema, in errors


def test_tool_result_errors_are_shown_as_errors():
    body = _request(messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "timeout",
                                      "is_error": True}]}])
    assert body.to_chat_request().messages[-1].model_dump() == {"role": "tool", "content": "Error: timeout",
                                                                "tool_call_id": "t1"}


@pytest.mark.parametrize("kw, param, needle", [
    (dict(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": "1"}]}]),
     "messages", "matches no tool_use"),
    (dict(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]),
     "messages", "belongs in an assistant message"),
    (dict(messages=[*ASK, {"role": "assistant", "content": "The capital is"}]), "messages", "prefill"),
    (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), "messages", "'image'"),
    (dict(messages=[{"role": "user", "content": [{"type": "text", "text": "x", "lang": "en"}]}]), "messages",
     "unknown keys: lang"),
    (dict(messages=[{"role": "user", "content": []}]), "messages", "empty array"),
    (dict(messages=[{"role": "user", "content": "\ud800"}]), "messages", "surrogate"),
    (dict(messages=ASK, system=[{"type": "image"}]), "system", "text block"),
    (dict(messages=ASK, tools=[{"name": "a b", "input_schema": {"type": "object"}}]), "tools", "tools[0].name"),
    (dict(messages=ASK, tools=[TOOLS[0], TOOLS[0]]), "tools", "twice"),
    (dict(messages=ASK, tools=[{"name": "f", "input_schema": {"type": "array"}}]), "tools", "input_schema"),
    (dict(messages=ASK, tool_choice={"type": "any"}), "tool_choice", "needs tools"),
    (dict(messages=ASK, tools=TOOLS, tool_choice={"type": "tool", "name": "nope"}), "tool_choice", "'nope'"),
    (dict(messages=ASK, tools=TOOLS, tool_choice={"type": "tool"}), "tool_choice", "name"),
    (dict(messages=ASK, tools=TOOLS, tool_choice={"type": "auto", "name": "get_time"}), "tool_choice", "name"),
])
def test_conversion_refuses_naming_the_field(kw, param, needle):
    with pytest.raises(InvalidParameterError, match=re.escape(needle)) as e:
        _request(**kw).to_chat_request()
    assert e.value.param == param


def test_block_events_put_text_before_calls_and_number_blocks():
    b = BlockEvents()
    events = b.feed([{"content": "Let"}]) + b.feed([])
    events += b.feed([{"content": " me"},
                      {"tool_calls": [{"index": 0, "id": "call_A", "type": "function",
                                       "function": {"name": "f", "arguments": ""}}]},
                      {"tool_calls": [{"index": 0, "function": {"arguments": '{"x": 1}'}}]},
                      {"tool_calls": [{"index": 1, "id": "call_B", "type": "function",
                                       "function": {"name": "g", "arguments": ""}}]},
                      {"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]},
                      {"content": " see."}])
    events += b.close() + b.close()
    parsed = [(e.split("\n")[0].removeprefix("event: "), json.loads(e.split("\n")[1].removeprefix("data: ")))
              for e in events]
    assert all(name == data["type"] for name, data in parsed)
    assert [d for _, d in parsed] == [
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Let"}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": " me see."}},
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1,
         "content_block": {"type": "tool_use", "id": "toolu_A", "name": "f", "input": {}}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": '{"x": 1}'}},
        {"type": "content_block_stop", "index": 1},
        {"type": "content_block_start", "index": 2,
         "content_block": {"type": "tool_use", "id": "toolu_B", "name": "g", "input": {}}},
        {"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": "{}"}},
        {"type": "content_block_stop", "index": 2}]


def test_stop_reasons_and_error_translation():
    assert stop_reason("tool_calls", "END") == ("tool_use", None)
    assert stop_reason("length", None) == ("max_tokens", None)
    assert stop_reason("stop", "END") == ("stop_sequence", "END")
    assert stop_reason("stop", 2) == stop_reason("stop", None) == ("end_turn", None)

    def body(message, param=None):
        return {"error": {"message": message, "type": "x", "param": param, "code": 0}}
    assert from_openai(body("missing required parameter: max_tokens", "max_tokens"), 400, False) == {
        "type": "error", "error": {"type": "invalid_request_error",
                                   "message": "missing required parameter: max_tokens"}}
    assert from_openai(body("must be positive", "top_k"), 400, False)["error"]["message"] == "top_k: must be positive"
    assert from_openai(body("no key"), 401, False)["error"]["type"] == "authentication_error"
    assert from_openai(body("no model"), 404, False)["error"]["type"] == "not_found_error"
    assert from_openai(body("full"), 503, True)["error"]["type"] == "overloaded_error"
    assert from_openai(body("dead"), 503, False)["error"]["type"] == "api_error"
    assert from_openai(body("boom"), 500, False)["error"]["type"] == "api_error"
    assert stream_error_body(ServerShuttingDownError("drained"))["error"] == {"type": "overloaded_error",
                                                                             "message": "drained"}
    assert stream_error_body(EngineDeadError("gone"))["error"]["type"] == "api_error"
    assert stream_error_body(RuntimeError("x")) == {"type": "error", "error": {"type": "api_error", "message": "x"}}


# --------------------------------------------------------------------------------------
# Over HTTP, on the bundled model
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    from server_helpers import _Server

    class _KeyServer(_Server):
        auth = {"x-api-key": KEY}

    s = _KeyServer(api_key=KEY, enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


@pytest.fixture(autouse=True)
def _blocks_free_after(request):
    yield
    if "server" in request.fixturenames:
        assert request.getfixturevalue("server").idle_and_free(), "server left requests or KV blocks behind"


def _model(server) -> str:
    return server.engine.model_name


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers={"x-api-key": KEY}, timeout=120)


def _sse(server, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of a streamed Messages request, every event having both lines."""
    events, name = [], None
    with httpx.stream("POST", f"{server.url}/v1/messages", json={**body, "stream": True},
                      headers={"x-api-key": KEY}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[6:])))
                name = None
    return events


def _total_input(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def _blocks(message) -> list[dict]:
    """Content blocks without the per-response tool_use ids."""
    return [{k: v for k, v in b.model_dump(exclude_none=True).items() if k != "id"} for b in message.content]


@pytest.mark.slow
def test_text_answer_agrees_with_count_tokens_tokenize_and_chat(server, client):
    import anthropic

    system = "You are a concise geography assistant."
    r = client.messages.create(model=_model(server), max_tokens=24, system=system, messages=ASK, extra_body=GREEDY)
    assert isinstance(r, anthropic.types.Message)
    assert r.id.startswith("msg_") and (r.type, r.role, r.model) == ("message", "assistant", _model(server))
    assert [b.type for b in r.content] == ["text"] and r.content[0].text.strip()
    n = client.messages.count_tokens(model=_model(server), system=system, messages=ASK).input_tokens
    assert _total_input(r.usage) == n and r.usage.cache_creation_input_tokens == 0
    chat_messages = [{"role": "system", "content": system}, *ASK]
    assert _post(server, "/tokenize", {"messages": chat_messages}).json()["count"] == n
    chat = _post(server, "/v1/chat/completions", {"messages": chat_messages, "max_tokens": 24, **GREEDY}).json()
    choice = chat["choices"][0]
    assert r.content[0].text == choice["message"]["content"]
    assert r.usage.output_tokens == chat["usage"]["completion_tokens"] <= 24
    assert r.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[choice["finish_reason"]]
    assert r.stop_sequence is None


@pytest.mark.slow
def test_count_tokens_renders_tools_as_create_does(server, client):
    n = client.messages.count_tokens(model=_model(server), messages=ASK, tools=TOOLS).input_tokens
    openai_tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                      "parameters": t["input_schema"]}} for t in TOOLS]
    assert n == _post(server, "/tokenize", {"messages": ASK, "tools": openai_tools}).json()["count"]
    assert n > client.messages.count_tokens(model=_model(server), messages=ASK).input_tokens + 50
    r = client.messages.create(model=_model(server), max_tokens=1, messages=ASK, tools=TOOLS,
                               tool_choice={"type": "none"}, extra_body=GREEDY)
    assert _total_input(r.usage) == n


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["text", "forced_tool"])
def test_stream_events_parse_and_end_as_the_whole_message(server, client, kind):
    from pydantic import TypeAdapter
    import anthropic

    body = {"model": _model(server), "max_tokens": 40, "messages": [
        {"role": "user", "content": "What is the weather in Paris? Use the tool."}]}
    if kind == "forced_tool":
        body.update(tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"})
    whole = client.messages.create(**body, extra_body=GREEDY)
    with client.messages.stream(**body, extra_body=GREEDY) as s:
        kinds = {ev.type for ev in s}
        final = s.get_final_message()
    assert _blocks(final) == _blocks(whole)
    assert (final.stop_reason, final.stop_sequence) == (whole.stop_reason, whole.stop_sequence)
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert _total_input(final.usage) == _total_input(whole.usage)
    if kind == "forced_tool":
        assert whole.stop_reason == "tool_use" and [b.type for b in whole.content] == ["tool_use"]
        assert whole.content[0].id.startswith("toolu_") and final.content[0].id.startswith("toolu_")
        assert "input_json" in kinds
    else:
        assert "text" in kinds

    events = _sse(server, {**body, **GREEDY})
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert re.fullmatch(r"(content_block_start (content_block_delta )*content_block_stop )*",
                        "".join(n + " " for n in names[2:-2])), names
    adapter = TypeAdapter(anthropic.types.RawMessageStreamEvent)
    for name, data in events:
        assert data["type"] == name
        if name == "ping":
            assert data == {"type": "ping"}
            continue
        assert type(adapter.validate_python(data)).__name__.startswith("Raw"), data
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert start["usage"]["input_tokens"] + start["usage"]["cache_read_input_tokens"] == _total_input(whole.usage)
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": whole.stop_reason, "stop_sequence": whole.stop_sequence}
    assert delta["usage"]["output_tokens"] == whole.usage.output_tokens


@pytest.mark.slow
def test_max_tokens_and_stop_sequences(server, client):
    kw = dict(model=_model(server), messages=[{"role": "user", "content": "Write a sentence about Paris."}],
              extra_body=GREEDY)
    r = client.messages.create(max_tokens=3, **kw)
    assert (r.stop_reason, r.stop_sequence, r.usage.output_tokens) == ("max_tokens", None, 3)
    base = client.messages.create(max_tokens=24, **kw).content[0].text
    words = base.split()
    assert len(words) >= 4, base
    sequence = words[2]
    cut = base.index(sequence)
    assert base[:cut].strip()
    r = client.messages.create(max_tokens=24, stop_sequences=["never-in-the-text", sequence], **kw)
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", sequence)
    assert r.content[0].text == base[:cut]
    with client.messages.stream(max_tokens=24, stop_sequences=[sequence], **kw) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence, _blocks(final)) == ("stop_sequence", sequence, _blocks(r))


@pytest.mark.slow
@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"},
                                    {"type": "any", "disable_parallel_tool_use": True}])
def test_forced_tool_call_input_validates(server, client, choice):
    import jsonschema

    r = client.messages.create(model=_model(server), max_tokens=60, tools=TOOLS, tool_choice=choice,
                               messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                               extra_body=GREEDY)
    assert r.stop_reason == "tool_use" and r.content and all(b.type == "tool_use" for b in r.content)
    schemas = {t["name"]: t["input_schema"] for t in TOOLS}
    for b in r.content:
        assert re.fullmatch(r"toolu_[A-Za-z0-9]{24}", b.id)
        jsonschema.validate(b.input, schemas[b.name])
    if choice["type"] == "tool":
        assert [b.name for b in r.content] == ["get_weather"]
    else:   # no parallel calls: one
        assert len(r.content) == 1


@pytest.mark.slow
def test_tool_loop_call_result_answer(server, client):
    import jsonschema

    messages = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
    kw = dict(model=_model(server), tools=TOOLS, extra_body=GREEDY)
    first = client.messages.create(max_tokens=60, tool_choice={"type": "tool", "name": "get_weather"},
                                   messages=messages, **kw)
    call = first.content[-1]
    assert first.stop_reason == "tool_use" and call.type == "tool_use"
    jsonschema.validate(call.input, WEATHER)
    result = json.dumps({"city": call.input["city"], "temperature": 21, "unit": call.input["unit"]})
    messages += [{"role": "assistant", "content": first.content},   # as the client's users write it
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                               "content": [{"type": "text", "text": result}]}]}]
    final = client.messages.create(max_tokens=30, tool_choice={"type": "none"}, messages=messages, **kw)
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in final.content] == ["text"] and final.content[0].text.strip()
    n = client.messages.count_tokens(model=_model(server), tools=TOOLS, tool_choice={"type": "none"},
                                     messages=messages).input_tokens
    assert _total_input(final.usage) == n > _total_input(first.usage) + first.usage.output_tokens


@pytest.mark.slow
def test_repeated_prompt_reads_the_prefix_cache(server, client):
    kw = dict(model=_model(server), max_tokens=2, extra_body=GREEDY,
              system="Zebra crossings in Reykjavik are painted in seven colours. " * 6,
              messages=[{"role": "user", "content": "How many colours?"}])
    a = client.messages.create(**kw)
    b = client.messages.create(**kw)
    assert b.usage.cache_read_input_tokens > a.usage.cache_read_input_tokens
    assert b.usage.cache_read_input_tokens >= 64 and b.usage.input_tokens >= 1
    assert _total_input(a.usage) == _total_input(b.usage)
    with client.messages.stream(**kw) as s:
        streamed = s.get_final_message()
    assert streamed.usage.cache_read_input_tokens == b.usage.cache_read_input_tokens


def _anthropic_error(r: httpx.Response, status: int, type_: str, needle: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == type_, body
    assert needle in body["error"]["message"], body


@pytest.mark.slow
@pytest.mark.parametrize("path, body, status, type_, needle", [
    ("/v1/messages", {"messages": ASK}, 400, "invalid_request_error", "max_tokens"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "1"}]}]}, 400, "invalid_request_error",
     "messages"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, 400,
     "invalid_request_error", "messages"),
    ("/v1/messages", {"max_tokens": 5, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 1024}},
     400, "invalid_request_error", "thinking"),
    ("/v1/messages", {"max_tokens": 5, "messages": ASK, "mcp_servers": []}, 400, "invalid_request_error",
     "mcp_servers"),
    ("/v1/messages", {"max_tokens": 5, "messages": ASK, "tools": [{"type": "web_search_20250305",
                                                                  "name": "web_search"}]},
     400, "invalid_request_error", "tools"),
    ("/v1/messages", {"max_tokens": 5, "messages": ASK, "temperature": "hot"}, 400, "invalid_request_error",
     "temperature"),
    ("/v1/messages", {"max_tokens": 5, "messages": ASK, "top_k": -3}, 400, "invalid_request_error", "top_k"),
    ("/v1/messages", {"max_tokens": 5000, "messages": ASK}, 400, "invalid_request_error", "max_tokens"),
    ("/v1/messages", {"max_tokens": 5, "messages": ASK, "stop_sequences": [""]}, 400, "invalid_request_error",
     "stop_sequences"),
    ("/v1/messages/count_tokens", {"max_tokens": 5, "messages": ASK}, 400, "invalid_request_error", "max_tokens"),
    ("/v1/messages/count_tokens", {}, 400, "invalid_request_error", "model"),
])
def test_bad_input_is_an_anthropic_error_naming_the_field(server, path, body, status, type_, needle):
    body = {"model": _model(server), **body} if body else body
    _anthropic_error(_post(server, path, body), status, type_, needle)


@pytest.mark.slow
def test_other_errors_have_anthropic_shape_there_and_openai_shape_elsewhere(server, client):
    import anthropic

    _anthropic_error(_post(server, "/v1/messages", {"model": "claude-nope", "max_tokens": 5, "messages": ASK}),
                     404, "not_found_error", "claude-nope")
    _anthropic_error(_post(server, "/v1/messages/batches", {}), 404, "not_found_error", "Not Found")
    _anthropic_error(httpx.get(f"{server.url}/v1/messages", headers={"x-api-key": KEY}), 405,
                     "invalid_request_error", "Method Not Allowed")
    with pytest.raises(anthropic.BadRequestError) as e:   # the client reads the error too
        client.messages.create(model=_model(server), max_tokens=5, messages=[
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "1"}]}])
    assert e.value.body["error"]["type"] == "invalid_request_error" and "toolu_nope" in e.value.message
    r = _post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 5000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


@pytest.mark.slow
def test_api_key_by_x_api_key_or_bearer(server, client):
    import anthropic

    for headers in ({"x-api-key": "wrong"}, {}):
        _anthropic_error(httpx.post(f"{server.url}/v1/messages", headers=headers, timeout=30,
                                    json={"model": _model(server), "max_tokens": 1, "messages": ASK}),
                         401, "authentication_error", "API key")
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.count_tokens(
            model=_model(server), messages=ASK)
    assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error"
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0)
    assert bearer.messages.count_tokens(model=_model(server), messages=ASK).input_tokens > 0
    assert httpx.get(f"{server.url}/v1/models", headers={"x-api-key": KEY}).status_code == 200
    r = httpx.get(f"{server.url}/v1/models", headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"


@pytest.mark.slow
def test_error_mid_stream_is_an_error_event(server):
    """The server's drain time running out mid-stream: an ``error`` event (overloaded_error),
    and the server serves on."""
    body = {"model": _model(server), "max_tokens": 200, "stream": True, **GREEDY,
            "messages": [{"role": "user", "content": "Count from 1 to 100, one number per line."}]}
    for _ in range(3):   # the request must still be running when it is failed
        events, failed = [], 0
        with httpx.stream("POST", f"{server.url}/v1/messages", json=body, headers={"x-api-key": KEY},
                          timeout=120) as r:
            name = None
            for line in r.iter_lines():
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    events.append((name, json.loads(line[6:])))
                    if name == "content_block_delta" and not failed:
                        failed = server.engine.fail_all(ServerShuttingDownError("drain time is over"))
        if failed:
            break
    assert failed == 1
    assert events[0][0] == "message_start" and events[-1] == (
        "error", {"type": "error", "error": {"type": "overloaded_error", "message": "drain time is over"}})
    assert "message_stop" not in [n for n, _ in events]
    assert _post(server, "/v1/messages/count_tokens", {"model": _model(server), "messages": ASK}).status_code == 200


# --------------------------------------------------------------------------------------
# Reasoning (--reasoning-parser): thinking blocks, without a model
# --------------------------------------------------------------------------------------
def _thinking_parts(text: str, cut: int | None):
    """(whole blocks, streamed blocks rebuilt from the events) of ``text`` under the qwen3
    parser, the stream cut into two deltas at ``cut`` (None: one per character)."""
    from pagedllm.entrypoints.anthropic.serving_messages import message_blocks
    from pagedllm.entrypoints.openai.chat_reasoning import ChatReasoning
    from pagedllm.entrypoints.openai.chat_tools import ChatTools
    from pagedllm.outputs import CompletionOutput

    chat = _request(messages=ASK).to_chat_request()
    c = CompletionOutput(index=0, text=text, token_ids=[1], cumulative_logprob=None, logprobs=None,
                         finish_reason="stop")
    whole, _ = message_blocks(ChatTools(chat, None, False, None), ChatReasoning("qwen3", None, False), c)
    pieces = [text[:cut], text[cut:]] if cut is not None else list(text)
    tools, think, b = ChatTools(chat, None, False, None), ChatReasoning("qwen3", None, False), BlockEvents()
    events = []
    for i, p in enumerate(pieces):
        events += b.feed(think.stream(0, p, i == len(pieces) - 1, tools.stream))
    events += b.close()
    blocks = []
    for e in events:
        data = json.loads(e.split("\n")[1].removeprefix("data: "))
        if data["type"] == "content_block_start":
            blocks.append(dict(data["content_block"]))
        elif data["type"] == "content_block_delta":
            d = data["delta"]
            key = "thinking" if d["type"] == "thinking_delta" else "text"
            blocks[data["index"]][key] += d[key]
    return whole, blocks


@pytest.mark.parametrize("cut", [None, 3, 9, 14, 20])
def test_thinking_block_first_whole_and_streamed(cut):
    whole, streamed = _thinking_parts("<think>plan it</think>Paris.", cut)
    assert whole == [{"type": "thinking", "thinking": "plan it", "signature": ""}, {"type": "text", "text": "Paris."}]
    assert streamed == whole


def test_no_think_block_is_all_text_and_an_unclosed_one_all_thinking():
    assert _thinking_parts("Paris.", None) == ([{"type": "text", "text": "Paris."}],) * 2
    whole, streamed = _thinking_parts("<think>still going", 5)
    assert whole == streamed == [{"type": "thinking", "thinking": "still going", "signature": ""}]


def test_thinking_in_history_is_dropped_and_sets_enable_thinking():
    body = _request(messages=[
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "greet back", "signature": "s"},
                                          {"type": "redacted_thinking", "data": "xx"},
                                          {"type": "text", "text": "Hello!"}]},
        {"role": "user", "content": "Bye"}], thinking={"type": "enabled", "budget_tokens": 1024})
    chat = body.to_chat_request()
    assert [m.model_dump()["content"] for m in chat.messages] == [
        [{"type": "text", "text": "Hi"}], [{"type": "text", "text": "Hello!"}], [{"type": "text", "text": "Bye"}]]
    assert chat.chat_template_kwargs == {"enable_thinking": True}
    assert _request(messages=ASK, thinking={"type": "disabled"}).to_chat_request().chat_template_kwargs == {
        "enable_thinking": False}
    assert _request(messages=ASK).to_chat_request().chat_template_kwargs is None
    with pytest.raises(InvalidParameterError, match="thinking block belongs in an assistant message") as e:
        _request(messages=[{"role": "user", "content": [{"type": "thinking", "thinking": "x", "signature": ""}]}]
                 ).to_chat_request()
    assert e.value.param == "messages"


def test_fields_anthropic_clients_send_are_accepted_and_system_named():
    body = _request(messages=ASK, tools=[{**TOOLS[0], "strict": True}], stream=None,
                    thinking={"type": "enabled", "budget_tokens": 2048, "display": "summarized"})
    chat = body.to_chat_request()
    assert chat.stream is False and chat.tools[0]["function"]["name"] == "get_weather"
    with pytest.raises(InvalidParameterError) as e:
        _request(messages=ASK, system="\udc00").to_chat_request()
    assert e.value.param == "system"
