"""OpenAI's Responses API (``/v1/responses``): the store and the reading of input items
without a model; then the official ``openai`` client against the in-process server on the
bundled model (``--enable-auto-tool-choice --tool-call-parser hermes``): text answers with
their usage, streams whose every event the client's typed models parse and that agree with
the whole response, the length limit, forced tool calls and a tool loop, JSON-schema output,
``previous_response_id``, GET / DELETE, the prefix cache in usage, and errors in OpenAI's
shape naming the field."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from server_helpers import _Server

from pagedllm.entrypoints.openai.responses_protocol import (ResponsesRequest, chat_error_as_responses,
                                                            conversation_messages)
from pagedllm.entrypoints.openai.responses_store import ResponseStore
from pagedllm.errors import InvalidParameterError

slow = pytest.mark.slow   # the server tests: end-to-end on the bundled model

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
          "parameters": WEATHER}]
NAMED = {"type": "function", "name": "get_weather"}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


# --------------------------------------------------------------------------------------
# Without a model
# --------------------------------------------------------------------------------------
def _resp(rid: str) -> dict:
    return {"id": rid}


def test_store_evicts_least_recently_used_and_expires_by_age():
    now = [0.0]
    store = ResponseStore(max_entries=2, max_age_s=10.0, clock=lambda: now[0])
    a = store.put(_resp("a"), [{"n": 1}], None)
    store.put(_resp("b"), [{"n": 2}], a)
    assert store.get("a") is a                      # a is now the most recently used
    store.put(_resp("c"), [{"n": 3}], None)
    assert store.get("b") is None and len(store) == 2
    assert store.get("a") is a
    now[0] = 5.0
    store.put(_resp("d"), [{"n": 4}], None)         # evicts c (a was used after c was stored)
    assert store.get("c") is None and store.get("a") is a
    now[0] = 10.5                                    # a (stored at 0) is past 10 s; d (at 5) is not
    assert store.get("a") is None and store.get("d") is not None
    assert store.delete("d") and not store.delete("d") and len(store) == 0
    with pytest.raises(ValueError):
        ResponseStore(max_entries=0)


def test_stored_conversation_survives_an_evicted_turn():
    store = ResponseStore(max_entries=1)
    first = store.put(_resp("r1"), [{"t": "u1"}, {"t": "a1"}], None)
    second = store.put(_resp("r2"), [{"t": "u2"}, {"t": "a2"}], first)
    assert store.get("r1") is None
    assert [i["t"] for i in second.conversation()] == ["u1", "a1", "u2", "a2"]


def _items(items):
    return ResponsesRequest.model_validate({"input": items}).input_items()


def test_items_become_chat_turns():
    items = _items([
        {"role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "?"}]},
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{\"a\":1}"},
        {"type": "function_call_output", "call_id": "call_2", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text", "text": "rain"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"role": "assistant", "content": "Mixed."},
        {"role": "developer", "content": "Be brief."},
    ])
    msgs = conversation_messages(items, "Be kind.")
    call = {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}, "id": "call_1"}
    assert msgs == [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Weather ?"},
        {"role": "assistant", "content": "Checking.",
         "tool_calls": [call, {**call, "id": "call_2", "function": {"name": "get_weather", "arguments": "{\"a\":1}"}}]},
        {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        {"role": "assistant", "content": "Mixed.", "reasoning_content": "hmm"},
        {"role": "developer", "content": "Be brief."},
    ]
    assert _items("hi") == [{"type": "message", "role": "user", "content": "hi"}]


@pytest.mark.parametrize("items, needle", [
    ([{"type": "function_call_output", "call_id": "call_9", "output": "x"}], "input[0] (function_call_output)"),
    ([{"type": "web_search_call", "id": "ws"}], "'web_search_call' is not supported"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "text only"),
    ([{"role": "tool", "content": "x"}], "role must be one of"),
    ([{"type": "function_call", "call_id": "c", "name": "f"}], "needs arguments"),
    ([{"role": "user", "content": "x", "name": "bob"}], "unknown keys: name"),
    ([{"type": {"a": 1}}], "is not supported"),
    ([{"type": "reasoning", "content": 5}], "reasoning_text"),
    ([{"role": "user", "content": "\ud800"}], "lone surrogate"),
])
def test_bad_items_name_input(items, needle):
    with pytest.raises(InvalidParameterError) as e:
        conversation_messages(_items(items), None)
    assert e.value.param == "input" and needle in str(e.value)


def test_chat_errors_renamed_to_responses_fields():
    e = chat_error_as_responses(InvalidParameterError("max_completion_tokens", "max_completion_tokens must be >= 1"))
    assert (e.param, str(e)) == ("max_output_tokens", "max_output_tokens must be >= 1")
    e = chat_error_as_responses(InvalidParameterError("tools", "tools[0].function.name must be ..."))
    assert (e.param, str(e)) == ("tools", "tools[0].name must be ...")
    e = chat_error_as_responses(InvalidParameterError("response_format", "response_format / structured_outputs x"))
    assert (e.param, str(e)) == ("text", "text.format x")
    e = InvalidParameterError("temperature", "bad")
    assert chat_error_as_responses(e) is e


def _auto_tools():
    from types import SimpleNamespace

    from pagedllm.entrypoints.openai.chat_tools import ChatTools

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    body = SimpleNamespace(tools=tools, tool_choice="auto", parallel_tool_calls=True, functions=None,
                           function_call=None, chat_template=None, response_format=None, structured_outputs=None)
    return ChatTools(body, engine=None, enable_auto_tool_choice=True, tool_call_parser="hermes")


CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.mark.parametrize("text, finish, types, statuses, parser", [
    ("Paris is sunny.", "stop", ["message"], ["completed"], None),
    ("Paris is", "length", ["message"], ["incomplete"], None),
    (f"Let me check. {CALL} Done.", "stop", ["message", "function_call"], ["completed", "completed"], None),
    (f"{CALL}\nafter", "stop", ["message", "function_call"], ["completed", "completed"], None),
    (f"{CALL}{CALL}", "stop", ["function_call", "function_call"], ["completed", "completed"], None),
    ("", "stop", [], [], None),
    # --reasoning-parser qwen3: the think part is a reasoning item first; calls only from the answer
    ("<think>plan</think>Paris.", "stop", ["reasoning", "message"], ["completed"] * 2, "qwen3"),
    (f"<think>maybe {CALL}</think>{CALL}", "stop", ["reasoning", "function_call"], ["completed"] * 2, "qwen3"),
    ("<think>cut off here", "length", ["reasoning"], ["incomplete"], "qwen3"),
    ("no tags", "stop", ["message"], ["completed"], "qwen3"),
])
def test_streamed_items_equal_whole_items(text, finish, types, statuses, parser):
    """Text after a call joins the message ahead of the calls, as in the whole completion;
    the client's typed models parse every item and event."""
    from openai.types.responses import ResponseOutputItem, ResponseStreamEvent
    from pydantic import TypeAdapter

    from pagedllm.entrypoints.openai.chat_reasoning import ChatReasoning
    from pagedllm.entrypoints.openai.serving_responses import ResponseOutput
    from pagedllm.outputs import CompletionOutput

    whole = ResponseOutput(_auto_tools(), ChatReasoning(parser, None, False)).items(
        CompletionOutput(0, text, [], finish))
    streamed = ResponseOutput(_auto_tools(), ChatReasoning(parser, None, False))
    events = []
    for i in range(0, len(text), 5):
        events += streamed.stream(text[i:i + 5], None)
    events += streamed.stream("", finish)

    def strip(items):
        return [{k: v for k, v in it.items() if k not in ("id", "call_id")} for it in items]
    assert strip(streamed.output) == strip(whole)
    assert [it["type"] for it in whole] == types and [it["status"] for it in whole] == statuses
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == list(range(len(types)))   # each item closed before the next opens
    for item in whole:
        TypeAdapter(ResponseOutputItem).validate_python(item)
    for n, e in enumerate(events):
        TypeAdapter(ResponseStreamEvent).validate_python({**e, "sequence_number": n})


# --------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    s = _Server(enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture()
def model(server):
    yield server.engine.model_name
    assert server.idle_and_free(), "server left requests or KV blocks behind"


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/responses", content=json.dumps(body), timeout=120,   # ASCII-escaped
                      headers={"Content-Type": "application/json"})


def _whole(server, body: dict) -> dict:
    """The raw response object, checked against the client's typed model."""
    from openai.types.responses import Response

    r = _post(server, body)
    assert r.status_code == 200, r.text
    Response.model_validate(r.json())
    return r.json()


def _events(server, body: dict) -> list[dict]:
    """The raw events of a streamed request, each parsed by the client's typed models."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    adapter = TypeAdapter(ResponseStreamEvent)
    events, name = [], None
    with httpx.stream("POST", f"{server.url}/v1/responses", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                ev = json.loads(line[6:])
                assert ev["type"] == name
                adapter.validate_python(ev)
                events.append(ev)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def _without_ids(resp: dict) -> dict:
    """A response without what differs between two runs of one greedy request (ids, times,
    and the prompt tokens the second found in the prefix cache)."""
    out = {k: v for k, v in resp.items() if k not in ("id", "created_at", "completed_at")}
    if resp.get("usage"):
        out["usage"] = {**resp["usage"], "input_tokens_details": None}
    out["output"] = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in resp["output"]]
    return out


def _error(r: httpx.Response, status: int, param: str) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and err["message"]
    return err["message"]


QUESTION = "What is the capital of France?"


@slow
def test_text_answer_and_usage(server, client, model):
    r = client.responses.create(model=model, input=QUESTION, instructions="Answer in one sentence.",
                                max_output_tokens=24, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.output_text.strip() and r.output[0].type == "message" and r.output[0].role == "assistant"
    prompt = server.engine.engine.apply_chat_template([{"role": "system", "content": "Answer in one sentence."},
                                                       {"role": "user", "content": QUESTION}])
    u = r.usage
    assert u.input_tokens == len(prompt)
    assert 0 < u.output_tokens <= 24 and u.total_tokens == u.input_tokens + u.output_tokens
    assert u.output_tokens_details.reasoning_tokens == 0
    assert r.instructions == "Answer in one sentence." and r.max_output_tokens == 24 and r.store is True
    again = client.responses.create(model=model, input=QUESTION, instructions="Answer in one sentence.",
                                    max_output_tokens=24, temperature=0)
    assert again.output_text == r.output_text
    assert again.usage.input_tokens_details.cached_tokens >= 16   # the repeated prompt's full blocks


EVENT_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done"]


@slow
def test_stream_events_in_order_and_equal_to_whole(server, client, model):
    body = {"model": model, "input": QUESTION, "max_output_tokens": 24, "temperature": 0, "store": False,
            "metadata": {"k": "v"}}
    events = _events(server, body)
    types = [e["type"] for e in events]
    deltas = types.count("response.output_text.delta")
    assert deltas >= 2 and types == EVENT_ORDER[:4] + ["response.output_text.delta"] * deltas + EVENT_ORDER[5:] + [
        "response.completed"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert events[-4]["text"] == text
    final = events[-1]["response"]
    whole = _whole(server, body)
    assert _without_ids(final) == _without_ids(whole) and final["output"][0]["content"][0]["text"] == text
    assert final["metadata"] == {"k": "v"}
    # the client's own stream reads the same
    streamed = list(client.responses.create(**body, stream=True))
    assert streamed[-1].type == "response.completed" and streamed[-1].response.output_text == text


@slow
def test_max_output_tokens_is_incomplete(server, client, model):
    r = client.responses.create(model=model, input="Write a long story about a dragon.", max_output_tokens=3,
                                temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"
    events = _events(server, {"model": model, "input": "Write a long story about a dragon.",
                              "max_output_tokens": 3, "temperature": 0})
    assert events[-1]["type"] == "response.incomplete"
    assert _without_ids(events[-1]["response"]) == _without_ids(r.model_dump(exclude_unset=True, mode="json"))


@slow
@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_call_validates(server, model, stream):
    body = {"model": model, "input": "What is the weather in Paris?", "tools": TOOLS, "tool_choice": NAMED,
            "max_output_tokens": 60, "temperature": 0}
    if stream:
        events = _events(server, body)
        assert [e["type"] for e in events] == [
            "response.created", "response.in_progress", "response.output_item.added",
            "response.function_call_arguments.delta", "response.function_call_arguments.done",
            "response.output_item.done", "response.completed"]
        assert events[4]["arguments"] == events[3]["delta"] == events[5]["item"]["arguments"]
        resp = events[-1]["response"]
    else:
        resp = _whole(server, body)
    assert resp["status"] == "completed" and resp["tool_choice"] == NAMED
    [call] = resp["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather" and call["status"] == "completed"
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
    jsonschema.validate(json.loads(call["arguments"]), WEATHER)


@slow
def test_tool_loop_through_the_client(server, client, model):
    question = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
    first = client.responses.create(model=model, input=question, tools=TOOLS, tool_choice=NAMED,
                                    max_output_tokens=60, temperature=0, store=False)
    [call] = first.output
    args = json.loads(call.arguments)
    jsonschema.validate(args, WEATHER)
    result = {"type": "function_call_output", "call_id": call.call_id,
              "output": json.dumps({"city": args["city"], "temperature": 21, "unit": args["unit"]})}
    final = client.responses.create(
        model=model, input=question + [item.model_dump(exclude_none=True) for item in first.output] + [result],
        tools=TOOLS, tool_choice="none", max_output_tokens=30, temperature=0, store=False)
    assert final.output_text.strip() and all(item.type == "message" for item in final.output)
    # the call and its result reached the model
    assert final.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


@slow
def test_json_schema_output_validates(server, client, model):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    r = _whole(server, {"model": model, "input": "Describe a person as JSON.", "max_output_tokens": 60,
                        "temperature": 0, "text": {"format": fmt}})
    assert r["status"] == "completed" and r["text"] == {"format": fmt}
    jsonschema.validate(json.loads(r["output"][0]["content"][0]["text"]), PERSON)
    obj = client.responses.create(model=model, input="A JSON object with a colour.", max_output_tokens=40,
                                  temperature=0, text={"format": {"type": "json_object"}})
    assert obj.output_text.startswith("{")   # constrained to an object (this one rambles past 40 tokens)
    if obj.status == "completed":
        assert isinstance(json.loads(obj.output_text), dict)


@slow
def test_previous_response_id_continues_and_is_stored(server, client, model):
    first = client.responses.create(model=model, input="My name is Ada.", instructions="Be brief.",
                                    max_output_tokens=12, temperature=0)
    second = client.responses.create(model=model, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=12, temperature=0)
    assert second.previous_response_id == first.id and second.instructions is None
    # instructions are not carried over; the first turn (question and answer) is
    prompt = server.engine.engine.apply_chat_template([
        {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])
    assert second.usage.input_tokens == len(prompt)
    third = client.responses.create(model=model, input="And again?", previous_response_id=second.id,
                                    max_output_tokens=4, temperature=0)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    got = httpx.get(f"{server.url}/v1/responses/{second.id}", timeout=30)
    assert got.status_code == 200 and got.json() == second.model_dump(exclude_unset=True, mode="json")
    assert client.responses.retrieve(first.id).output_text == first.output_text
    gone = httpx.delete(f"{server.url}/v1/responses/{first.id}", timeout=30)
    assert gone.json() == {"id": first.id, "object": "response.deleted", "deleted": True}
    _error(httpx.get(f"{server.url}/v1/responses/{first.id}", timeout=30), 404, "response_id")
    _error(httpx.delete(f"{server.url}/v1/responses/{first.id}", timeout=30), 404, "response_id")
    _error(_post(server, {"model": model, "input": "x", "previous_response_id": first.id}), 404,
           "previous_response_id")
    # the second turn still continues: it holds the first turn's items itself
    fourth = client.responses.create(model=model, input="What is my name?", previous_response_id=second.id,
                                     max_output_tokens=1, temperature=0)
    assert fourth.usage.input_tokens > second.usage.input_tokens


@slow
def test_store_false_is_not_retrievable(server, model):
    r = _whole(server, {"model": model, "input": "Hi", "max_output_tokens": 2, "temperature": 0, "store": False})
    assert r["store"] is False
    _error(httpx.get(f"{server.url}/v1/responses/{r['id']}", timeout=30), 404, "response_id")
    _error(_post(server, {"model": model, "input": "x", "previous_response_id": r["id"]}), 404,
           "previous_response_id")
    events = _events(server, {"model": model, "input": "Hi", "max_output_tokens": 2, "temperature": 0})
    rid = events[-1]["response"]["id"]
    assert httpx.get(f"{server.url}/v1/responses/{rid}", timeout=30).json() == events[-1]["response"]


@slow
@pytest.mark.parametrize("extra, param, needle", [
    ({"previous_response_id": "resp_unknown"}, "previous_response_id", "resp_unknown"),
    ({"tools": [{"type": "web_search"}]}, "tools", "'web_search'"),
    ({"tools": TOOLS, "tool_choice": {"type": "web_search_preview"}}, "tool_choice", "not supported"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "input", "call_x"),
    ({"background": True}, "background", "background"),
    ({"truncation": "auto"}, "truncation", "truncation"),
    ({"include": ["message.output_text.logprobs"]}, "include", "include"),
    ({"reasoning": {"effort": "low", "summary": "auto"}}, "reasoning", "summar"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "schema"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"input": "x" * 6000}, "input", "max_model_len"),
    ({"conversation": "conv_1"}, "conversation", "unrecognized"),
    ({"metadata": {"k": "\ud800"}}, "metadata", "lone surrogate"),
])
def test_bad_requests_name_the_field(server, model, extra, param, needle):
    r = _post(server, {"model": model, "input": "Hi", "max_output_tokens": 2, **extra})
    assert needle in _error(r, 404 if param == "previous_response_id" else 400, param)


@slow
def test_reasoning_effort_is_accepted_and_echoed(server, model):
    r = _whole(server, {"model": model, "input": "Hi", "max_output_tokens": 2, "temperature": 0,
                        "reasoning": {"effort": "low"}})
    assert r["reasoning"]["effort"] == "low" and r["usage"]["output_tokens_details"]["reasoning_tokens"] == 0


@slow
def test_error_mid_stream_is_an_error_event_and_nothing_is_stored(server, model):
    from openai.types.responses import ResponseErrorEvent

    body = {"model": model, "input": "Write a long story about a dragon.", "max_output_tokens": 200,
            "temperature": 0, "stream": True}
    events = []
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if events[-1]["type"] == "response.output_text.delta" and len(events) == 5:
                    assert server.engine.fail_all(RuntimeError("the engine broke")) == 1
    err = ResponseErrorEvent.model_validate(events[-1])
    assert err.message == "the engine broke" and err.code == "internal_error"
    assert err.sequence_number == len(events) - 1
    assert not any(e["type"] in ("response.completed", "response.incomplete") for e in events)
    _error(httpx.get(f"{server.url}/v1/responses/{events[0]['response']['id']}", timeout=30), 404, "response_id")
    r = httpx.get(f"{server.url}/v1/responses/{events[0]['response']['id']}?stream=true", timeout=30)
    _error(r, 400, "stream")


@slow
@pytest.mark.parametrize("choice", ["auto", "required"])
def test_streamed_tool_choices_equal_whole(server, model, choice):
    body = {"model": model, "input": "What is the weather in Tokyo? Use the tool.", "tools": TOOLS,
            "tool_choice": choice, "parallel_tool_calls": False, "max_output_tokens": 60, "temperature": 0,
            "store": False}
    whole = _whole(server, body)
    final = _events(server, body)[-1]["response"]
    assert _without_ids(final) == _without_ids(whole)
    if choice == "required":
        assert [item["type"] for item in whole["output"]] == ["function_call"]
        jsonschema.validate(json.loads(whole["output"][0]["arguments"]), WEATHER)


def test_reasoning_item_belongs_to_the_assistant_turn_right_after_it():
    """An all-reasoning turn (cut by max_output_tokens) followed by the user's next message:
    its reasoning does not attach to a later, unrelated assistant turn."""
    from pagedllm.entrypoints.openai.responses_protocol import conversation_messages

    r = lambda t: {"type": "reasoning", "content": [{"type": "reasoning_text", "text": t}]}  # noqa: E731
    msgs = conversation_messages([{"type": "message", "role": "user", "content": "q1"}, r("R1"),
                                  {"type": "message", "role": "user", "content": "q2"}, r("R2"),
                                  {"type": "message", "role": "assistant", "content": "A2"},
                                  {"type": "message", "role": "user", "content": "q3"}], None)
    assistant = [m for m in msgs if m["role"] == "assistant"]
    assert len(assistant) == 1 and assistant[0].get("reasoning_content") == "R2"


@pytest.mark.parametrize("field,value", [("metadata", {f"k{i}": "v" for i in range(17)}),
                                         ("metadata", {"k": "v" * 513}), ("user", "u" * 513),
                                         ("prompt_cache_key", "p" * 513)])
def test_echoed_and_stored_fields_are_bounded(field, value):
    body = ResponsesRequest.model_validate({"model": "m", "input": "hi", field: value})
    with pytest.raises(InvalidParameterError) as e:
        body.check_supported()
    assert e.value.param == field
