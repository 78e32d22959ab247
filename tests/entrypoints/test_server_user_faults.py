"""Inputs a user sent to the server, each with what it must get:

- ``parallel_tool_calls: false`` (with ``tool_choice: "required"`` and two tools, and in
  the other modes): at most one call, whole or streamed;
- six requests at once to ``--max-waiting-requests 1 --max-num-seqs 1``: requests that
  arrive within one engine step see each other (``admission.py``); those past the limit
  get 503 with ``Retry-After`` and are counted nowhere;
- ``Authorization: bearer KEY``: the scheme is case-insensitive (RFC 9110), the key is
  not."""
from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from server_helpers import _Server

from pagedllm.entrypoints.openai.admission import AdmissionControl
from pagedllm.entrypoints.openai.chat_tools import ChatTools
from pagedllm.entrypoints.openai.middleware import ApiKeyMiddleware
from pagedllm.outputs import CompletionOutput

ID = re.compile(r"call_[A-Za-z0-9]{24}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


# --------------------------------------------------------------------------------------
# parallel_tool_calls: false
# --------------------------------------------------------------------------------------
def _tools(choice, parallel: bool) -> ChatTools:
    body = SimpleNamespace(tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel, functions=None,
                           function_call=None, chat_template=None, response_format=None, structured_outputs=None)
    return ChatTools(body, engine=None, enable_auto_tool_choice=True, tool_call_parser="hermes")


def _whole(choice, parallel: bool, text: str) -> tuple[list[tuple[str, str]], str | None, str]:
    msg, finish = _tools(choice, parallel).message(CompletionOutput(index=0, text=text, token_ids=[],
                                                                    finish_reason="stop"))
    return [(t["function"]["name"], t["function"]["arguments"]) for t in msg.get("tool_calls") or []], \
        msg["content"] or None, finish


def _streamed(choice, parallel: bool, text: str) -> tuple[list[tuple[str, str]], str | None, str]:
    tools = _tools(choice, parallel)
    half = len(text) // 2
    deltas = tools.stream(0, text[:half], False) + tools.stream(0, text[half:], True)
    calls, content = [], ""
    for d in deltas:
        if "content" in d:
            content += d["content"]
            continue
        (tc,) = d["tool_calls"]
        if "id" in tc:
            assert ID.fullmatch(tc["id"]) and tc["index"] == len(calls)
            calls.append([tc["function"]["name"], ""])
        else:
            calls[tc["index"]][1] += tc["function"]["arguments"]
    finish = tools.finish_reason(CompletionOutput(index=0, text=text, token_ids=[], finish_reason="stop"))
    return [tuple(c) for c in calls], content or None, finish


TWO_FORCED = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {"city": "Rome"}}]'
TWO_HERMES = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
              '<tool_call>{"name": "get_time", "arguments": {"city": "Rome"}}</tool_call>')


@pytest.mark.parametrize("read", [_whole, _streamed])
@pytest.mark.parametrize("choice,text", [("required", TWO_FORCED), ("auto", TWO_HERMES)])
def test_parallel_tool_calls_false_keeps_the_first_call(read, choice, text):
    """An output holding two calls (``required``'s under a looser constraint, ``auto``'s
    free text) gives one call without parallel tool calls, and both with them."""
    assert read(choice, False, text) == ([("get_weather", '{"city":"Paris"}' if choice == "required"
                                           else '{"city": "Paris"}')], None, "tool_calls")
    calls, _, finish = read(choice, True, text)
    assert [name for name, _ in calls] == ["get_weather", "get_time"] and finish == "tool_calls"


@pytest.mark.parametrize("read", [_whole, _streamed])
def test_named_tool_choice_is_one_call(read):
    assert read(NAMED, False, '{"city": "Paris"}') == ([("get_weather", '{"city":"Paris"}')], None, "tool_calls")
    assert read(NAMED, True, '{"city": "Paris"}') == ([("get_weather", '{"city":"Paris"}')], None, "tool_calls")


@pytest.fixture(scope="module")
def tool_server():
    s = _Server(enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield s
    s.stop()


BAD_SCHEMA = {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}


@pytest.mark.parametrize("route, body, where", [
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required",
                          "tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}]},
     "tools[].function.parameters is invalid"),
    ("responses", {"input": "hi", "tool_choice": "required",
                   "tools": [{"type": "function", "name": "f", "parameters": BAD_SCHEMA}]},
     "tools[].parameters is invalid"),
    ("messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "any"},
                  "tools": [{"name": "f", "input_schema": BAD_SCHEMA}]},
     "tools[].input_schema is invalid"),
])
def test_a_forced_calls_bad_schema_is_blamed_on_tools(tool_server, route, body, where):
    """A tool schema xgrammar cannot compile, forced by tool_choice: a 400 naming ``tools``
    and the schema as the API spells it, not the structured outputs the request never set."""
    model = httpx.get(f"{tool_server.url}/v1/models", timeout=30).json()["data"][0]["id"]
    r = httpx.post(f"{tool_server.url}/v1/{route}", json={"model": model, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert where in error["message"] and "structured_outputs" not in error["message"], error
    if route != "messages":
        assert error["param"] == "tools"
    assert tool_server.idle_and_free()


def test_a_tool_message_must_answer_an_earlier_call(tool_server):
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "zzz", "content": "x"}],
            "max_tokens": 5}
    r = httpx.post(f"{tool_server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "'zzz' matches no tool_calls[].id" in r.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_required_without_parallel_calls_over_http(tool_server, stream):
    """Two tools, ``tool_choice: "required"``, ``parallel_tool_calls: false`` and a
    question that asks for four calls: one call."""
    body = {"messages": [{"role": "user", "content": "What is the weather and the time in Paris and in Rome? "
                                                     "Call both tools for both cities."}],
            "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 80,
            "temperature": 0, "stream": stream}
    r = httpx.post(f"{tool_server.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    if stream:
        indices = {tc["index"] for line in r.text.splitlines() if line.startswith("data: {")
                   for ch in json.loads(line[6:])["choices"] for tc in ch["delta"].get("tool_calls") or []}
        assert indices == {0}
    else:
        calls = r.json()["choices"][0]["message"]["tool_calls"]
        assert len(calls) == 1 and calls[0]["function"]["name"] in ("get_weather", "get_time")
    assert tool_server.idle_and_free()


# --------------------------------------------------------------------------------------
# --max-waiting-requests: requests within one engine step
# --------------------------------------------------------------------------------------
def _stats(running: int, waiting: int):
    return SimpleNamespace(num_running=running, num_waiting=waiting)


def test_admission_counts_each_request_as_it_arrives():
    a = AdmissionControl(max_waiting_requests=1, max_num_seqs=1)
    first, second = a.try_admit(1), a.try_admit(1)   # no step in between: one runs, one waits
    assert first is not None and second is not None and a.in_flight == 2 and a.num_waiting() == 1
    assert a.try_admit(1) is None and a.in_flight == 2   # refused: counted nowhere
    first.release()
    first.release()   # once only
    assert a.in_flight == 1 and a.num_waiting() == 0
    assert a.try_admit(1) is not None and a.try_admit(1) is None
    with pytest.raises(ValueError, match="max-waiting-requests"):
        AdmissionControl(max_waiting_requests=0, max_num_seqs=1)


def test_admission_with_a_full_scheduler_and_n_sequences():
    a = AdmissionControl(max_waiting_requests=3, max_num_seqs=8)
    held = [a.try_admit(4)]                    # n=4: four sequences, all can run
    assert a.num_waiting() == 0
    a.record(_stats(running=3, waiting=1), None)   # the KV cache holds only 3
    assert a.num_waiting() == 1                # full: only those running run
    held.append(a.try_admit(1))                # 5 in flight, 3 running: 2 wait
    assert a.num_waiting() == 2 and held[-1] is not None
    held.append(a.try_admit(1))
    assert a.num_waiting() == 3 and a.try_admit(1) is None
    for h in held:
        h.release()
    assert a.in_flight == 0 and a.num_waiting() == 0   # a stale count never exceeds what is in flight
    assert a.try_admit(1) is not None


def test_six_requests_within_one_step(tiny_dir, monkeypatch):  # noqa: F811 (fixture)
    """``--max-waiting-requests 1 --max-num-seqs 1``, six requests sent at once while the
    engine takes no step: one may run and one wait; the four others get 503 with
    Retry-After, and reach neither the engine nor the count."""
    s = _Server(engine_kw=dict(model=tiny_dir, max_model_len=256, max_num_seqs=1), max_waiting_requests=1)
    try:
        gate = threading.Event()
        step = s.engine.engine.step

        def held_step(*args, **kwargs):
            gate.wait(60)
            return step(*args, **kwargs)

        queued = []
        add_requests = s.engine.add_requests

        async def counted_add_requests(requests):
            queued.extend(rid for rid, _, _ in requests)
            return await add_requests(requests)

        monkeypatch.setattr(s.engine.engine, "step", held_step)
        monkeypatch.setattr(s.engine, "add_requests", counted_add_requests)
        completion = ("/v1/completions", {"prompt": "Count:", "max_tokens": 4, "temperature": 0})
        chat = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})

        async def go():
            async with httpx.AsyncClient(base_url=s.url, timeout=120) as c:
                tasks = [asyncio.ensure_future(c.post(path, json=body))
                         for path, body in [completion, chat] * 3]
                deadline = time.monotonic() + 15   # (all admitted: none answers until the gate opens)
                while sum(t.done() for t in tasks) < 4 and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                gate.set()
                return await asyncio.gather(*tasks)

        responses = asyncio.run(go())
        assert sorted(r.status_code for r in responses) == [200, 200, 503, 503, 503, 503]
        for r in responses:
            if r.status_code == 503:
                assert r.headers["retry-after"] == "1" and "max-waiting-requests" in r.json()["error"]["message"]
        admission = s.server.config.app.state.openai_serving_completion.admission
        deadline = time.monotonic() + 10
        while admission.in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
        assert admission.in_flight == 0
        assert len(queued) == 2
        ok = httpx.post(f"{s.url}/v1/completions", json=completion[1], timeout=60)
        assert ok.status_code == 200
        assert s.idle_and_free()
    finally:
        gate.set()
        s.stop()


# --------------------------------------------------------------------------------------
# Authorization: the scheme is case-insensitive, the key is not
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("authorization,status", [
    ("Bearer Key-123", 200), ("bearer Key-123", 200), ("BEARER Key-123", 200), ("bEaReR   Key-123", 200),
    ("bearer key-123", 401), ("Bearer KEY-123", 401), ("Bearer Key-1234", 401), ("BearerKey-123", 401),
    ("Basic Key-123", 401), ("Key-123", 401), ("Bearer", 401), ("", 401),
])
def test_bearer_scheme_any_case_key_exact(authorization, status):
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def go():
        transport = httpx.ASGITransport(app=ApiKeyMiddleware(app, "Key-123"))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            headers = {"Authorization": authorization} if authorization else {}
            return await c.get("/v1/models", headers=headers)

    r = asyncio.run(go())
    assert r.status_code == status
    if status == 401:
        assert r.json()["error"]["code"] == 401 and r.headers["www-authenticate"] == "Bearer"
