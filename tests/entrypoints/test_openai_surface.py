"""The OpenAI surface agents use, over HTTP with the official client on the bundled model
(float32): logprobs against transformers, n, structured outputs validated with
jsonschema, forced tool calls whose arguments validate, and a whole agent loop (call,
tool result, final answer), streaming and not. The server runs with
``--enable-auto-tool-choice --tool-call-parser hermes``."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
import torch
from server_helpers import _Server

pytestmark = pytest.mark.slow   # server end-to-end suite, HF-reference logprobs

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server():
    s = _Server(enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(autouse=True)
def _blocks_free_after(server):
    yield
    assert server.idle_and_free(), "server left requests or KV blocks behind"


def _model(server):
    return server.engine.model_name


def _hf_logprobs(hf_model, ids):
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)


def test_chat_logprobs_match_hf(server, client, hf_model):
    msgs = [{"role": "user", "content": "Name three colors."}]
    r = client.chat.completions.create(model=_model(server), messages=msgs, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=3)
    eng = server.engine.engine
    prompt = eng.apply_chat_template(msgs)
    content = r.choices[0].logprobs.content
    gen = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=6,
                            pad_token_id=0)[0, len(prompt):].tolist()
    ref = _hf_logprobs(hf_model, prompt + gen)
    assert len(content) == r.usage.completion_tokens == 6
    assert [c.token for c in content] == [eng.tokenizer.decode([t]) for t in gen]
    for j, c in enumerate(content):
        row = ref[len(prompt) - 1 + j]
        assert abs(c.logprob - row.max().item()) < 2e-3           # greedy: the most likely token
        top = row.topk(3)
        assert [round(t.logprob, 2) for t in c.top_logprobs] == [round(v, 2) for v in top.values.tolist()]
        assert c.bytes == list(c.token.encode())


def test_completion_logprobs_with_echo_and_prompt_logprobs(server, hf_model):
    prompt = "The capital of France is"
    r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": _model(server), "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 2,
        "echo": True}).json()
    ch = r["choices"][0]
    lp = ch["logprobs"]
    eng = server.engine.engine
    p_ids = eng.tokenizer.encode(prompt)
    assert ch["text"].startswith(prompt)
    n = len(p_ids) + r["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert "".join(lp["tokens"]) == ch["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]
    out_ids = hf_model.generate(torch.tensor([p_ids]), do_sample=False, max_new_tokens=4,
                                pad_token_id=0)[0].tolist()
    assert lp["tokens"] == [eng.tokenizer.decode([t]) for t in out_ids]
    ref = _hf_logprobs(hf_model, out_ids)
    for i in range(1, n):
        assert abs(lp["token_logprobs"][i] - ref[i - 1, out_ids[i]].item()) < 2e-3
        top = lp["top_logprobs"][i]
        # the 2 most likely, plus the position's own token when it is not among them
        # (OpenAI's legacy API and vLLM: up to logprobs + 1 entries)
        best = [eng.tokenizer.decode([t]) for t in ref[i - 1].topk(2).indices.tolist()]
        assert list(top)[:2] == best
        assert top[lp["tokens"][i]] == lp["token_logprobs"][i]
        assert len(top) == (2 if lp["tokens"][i] in best else 3)


def test_echo_with_max_tokens_zero_scores_the_prompt(server, hf_model):
    """echo + max_tokens 0 (lm-evaluation-harness' loglikelihood request): the prompt and
    its logprobs alone, as HF computes them, finish_reason "length", no completion tokens,
    streamed or not; max_tokens 0 without echo stays a 400 naming max_tokens."""
    url = f"{server.url}/v1/completions"
    prompt = "The capital of France is Paris"
    body = {"model": _model(server), "prompt": prompt, "max_tokens": 0, "logprobs": 1, "echo": True}
    r = httpx.post(url, timeout=60, json=body)
    assert r.status_code == 200, r.text
    r = r.json()
    ch = r["choices"][0]
    eng = server.engine.engine
    p_ids = eng.tokenizer.encode(prompt)
    assert ch["text"] == prompt and ch["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == 0 and r["usage"]["prompt_tokens"] == len(p_ids)
    lp = ch["logprobs"]
    assert lp["tokens"] == [eng.tokenizer.decode([t]) for t in p_ids]
    assert lp["token_logprobs"][0] is None
    ref = _hf_logprobs(hf_model, p_ids)
    for i in range(1, len(p_ids)):
        assert abs(lp["token_logprobs"][i] - ref[i - 1, p_ids[i]].item()) < 2e-3
    chunks = []
    with httpx.stream("POST", url, timeout=60, json={**body, "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    assert "".join(c["choices"][0]["text"] for c in chunks) == prompt
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks) == len(p_ids)
    r = httpx.post(url, timeout=60, json={**body, "echo": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_n_choices_seeded_distinct_and_streamed(server, client):
    kw = dict(model=_model(server), messages=[{"role": "user", "content": "Write a word."}], max_tokens=8,
              temperature=1.0, seed=5, n=4)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2, 3]
    assert texts == [c.message.content for c in b.choices]
    assert len(set(texts)) > 1
    one = client.chat.completions.create(**{**kw, "n": 1})
    assert one.choices[0].message.content == texts[0]
    got = {i: "" for i in range(4)}
    finish = {}
    for ch in client.chat.completions.create(**kw, stream=True):
        for c in ch.choices:
            got[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert [got[i] for i in range(4)] == texts and len(finish) == 4
    # usage counts the prompt once and every choice's tokens
    assert a.usage.prompt_tokens == one.usage.prompt_tokens
    assert 4 <= a.usage.completion_tokens <= 4 * 8


def test_json_schema_outputs_validate(server, client):
    r = client.chat.completions.create(
        model=_model(server), messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=60,
        temperature=0.8, seed=1, n=3,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    stops = [c for c in r.choices if c.finish_reason == "stop"]
    assert stops
    for c in stops:
        jsonschema.validate(json.loads(c.message.content), PERSON)
    short = client.chat.completions.create(
        model=_model(server), messages=[{"role": "user", "content": "JSON please."}], max_tokens=3, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    assert short.choices[0].finish_reason == "length"


def test_regex_and_choice_via_structured_outputs(server):
    url = f"{server.url}/v1/completions"
    r = httpx.post(url, timeout=60, json={"model": _model(server), "prompt": "A phone number:", "max_tokens": 20,
                                          "temperature": 0, "structured_outputs": {"regex": r"\d{3}-\d{4}"}}).json()
    assert re.fullmatch(r"\d{3}-\d{4}", r["choices"][0]["text"])
    r = httpx.post(url, timeout=60, json={"model": _model(server), "prompt": "Is the sky blue?", "max_tokens": 5,
                                          "temperature": 0, "structured_outputs": {"choice": ["yes", "no"]}}).json()
    assert r["choices"][0]["text"] in ("yes", "no")


def test_invalid_schema_is_400_naming_the_field(server):
    url = f"{server.url}/v1/chat/completions"
    body = {"model": _model(server), "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    r = httpx.post(url, timeout=60, json={**body, "response_format": {
        "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "object", "properties": 5}}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    r = httpx.post(url, timeout=60, json={**body, "tools": TOOLS, "tool_choice": "required",
                                          "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_validate(server, client, choice):
    r = client.chat.completions.create(
        model=_model(server), messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, max_tokens=60, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in c.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    if isinstance(choice, dict):
        assert [t.function.name for t in c.message.tool_calls] == ["get_weather"]


@pytest.mark.parametrize("stream", [False, True])
def test_agent_loop_through_the_openai_client(server, client, stream):
    msgs = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
    kw = dict(model=_model(server), tools=TOOLS, max_tokens=60, temperature=0)
    named = {"type": "function", "function": {"name": "get_weather"}}
    if stream:
        calls: dict[int, dict] = {}
        finish = None
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60,
                          json={**kw, "messages": msgs, "tool_choice": named, "stream": True}) as resp:
            assert resp.headers.get("x-pagedllm-warning")   # SmolLM2's template cannot show tools
            for line in resp.iter_lines():
                if not line.startswith("data: {"):
                    continue
                ch = json.loads(line[6:])["choices"][0]
                for tc in ch["delta"].get("tool_calls") or []:
                    slot = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
                    if "id" in tc:
                        assert slot["id"] is None and not slot["arguments"]   # id and name come first
                        slot["id"], slot["name"] = tc["id"], tc["function"]["name"]
                    slot["arguments"] += tc["function"].get("arguments", "")
                finish = ch["finish_reason"] or finish
        assert finish == "tool_calls"
        call = calls[0]
        tool_calls = [{"id": call["id"], "type": "function",
                       "function": {"name": call["name"], "arguments": call["arguments"]}}]
    else:
        r = client.chat.completions.create(messages=msgs, tool_choice=named, **kw)
        assert r.choices[0].finish_reason == "tool_calls"
        tool_calls = [t.model_dump() for t in r.choices[0].message.tool_calls]
    args = json.loads(tool_calls[0]["function"]["arguments"])
    jsonschema.validate(args, WEATHER)
    msgs += [{"role": "assistant", "content": None, "tool_calls": tool_calls},
             {"role": "tool", "tool_call_id": tool_calls[0]["id"],
              "content": json.dumps({"city": args["city"], "temperature": 21, "unit": args["unit"]})}]
    final = client.chat.completions.create(messages=msgs, tool_choice="none", **{**kw, "max_tokens": 30})
    c = final.choices[0]
    assert c.finish_reason in ("stop", "length") and c.message.content and not c.message.tool_calls
    # the tool result reached the model: the prompt holds it
    assert final.usage.prompt_tokens > 100


def test_auto_reads_hermes_calls_or_returns_content(server, client):
    r = client.chat.completions.create(
        model=_model(server), messages=[{"role": "user", "content": "What time is it in Tokyo?"}], tools=TOOLS,
        tool_choice="auto", max_tokens=40, temperature=0)
    c = r.choices[0]
    if c.finish_reason == "tool_calls":
        for t in c.message.tool_calls:
            assert t.function.name in ("get_weather", "get_time")
            json.loads(t.function.arguments)
    else:
        assert c.message.content is not None and not c.message.tool_calls


def test_sampling_options_and_continuous_usage(server):
    body = {"model": _model(server), "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0.7, "seed": 3,
            "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2, "logit_bias": {"11": -5},
            "bad_words": ["dragon"], "min_p": 0.05, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    assert all("usage" in c for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    plain = {k: v for k, v in body.items() if k != "stream_options"}   # stream_options: streams only
    again = httpx.post(f"{server.url}/v1/completions", json={**plain, "stream": False}, timeout=60).json()
    assert again["choices"][0]["text"] == text
