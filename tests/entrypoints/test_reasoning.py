"""Reasoning parsers (``--reasoning-parser``) and prompt-cache accounting.

Parsers on recorded outputs, whole and streamed at every cut; the chat adapter with the
hermes tool parser (a call after ``</think>`` is a call, one inside the think block is
not). Live: a random-weight Qwen3 behind the server, its output forced with
``structured_outputs.regex`` (grammars apply from the first token, so the regex can spell
the think block), through the ``openai`` client, whole and streamed; and over runs of
requests sharing a prefix (chat and completions, whole and streamed, n > 1, and with
n-gram speculative decoding), the usage blocks' ``cached_tokens`` against the server's
``vllm:prefix_cache_hits_total``.
"""
from __future__ import annotations

import json
import random
import time

import httpx
import pytest

from pagedllm.entrypoints.openai.reasoning import REASONING_PARSERS, get_reasoning_parser

W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
CALL = f"<tool_call>{W}</tool_call>"

# (parser, text, reasoning, answer): outputs as the models write them
RECORDED = [
    # qwen3: the model writes the whole block
    ("qwen3", "<think>\nThe user greets me.\n</think>\n\nHello!", "\nThe user greets me.\n", "\n\nHello!"),
    ("qwen3", "<think></think>Hello!", None, "Hello!"),
    ("qwen3", "  \n<think>x</think>", "x", None),                   # whitespace before <think> dropped
    ("qwen3", "Hello! No thinking here.", None, "Hello! No thinking here."),
    ("qwen3", "Hello <think>x</think> after text", None, "Hello <think>x</think> after text"),
    ("qwen3", "<think>\nLet me count: 1, 2, 3", "\nLet me count: 1, 2, 3", None),   # cut by max_tokens
    ("qwen3", "<think>", None, None),
    ("qwen3", "<thi", None, "<thi"),                                 # cut inside the tag: not a block
    ("qwen3", "<think>a</think>b</think>c<think>d", "a", "b</think>c<think>d"),
    ("qwen3", f"<think>I should call it.</think>\n{CALL}", "I should call it.", f"\n{CALL}"),
    ("qwen3", f"<think>{CALL}</think>no call", CALL, "no call"),
    ("qwen3", "", None, None),
    # deepseek_r1: the template opened <think>; the output usually shows only </think>
    ("deepseek_r1", "Okay, 2 + 2 = 4.\n</think>\n\nThe answer is 4.", "Okay, 2 + 2 = 4.\n",
     "\n\nThe answer is 4."),
    ("deepseek_r1", "<think>\nold template\n</think>answer", "\nold template\n", "answer"),
    ("deepseek_r1", "still thinking when max_tokens ran out", "still thinking when max_tokens ran out", None),
    ("deepseek_r1", "<think>unclosed", "unclosed", None),
    ("deepseek_r1", "</think>answer only", None, "answer only"),
    ("deepseek_r1", "  <thi", "  <thi", None),
    ("deepseek_r1", "a</thi", "a</thi", None),                       # cut inside </think>
    ("deepseek_r1", f"plan</think>{CALL}", "plan", CALL),
    ("deepseek_r1", "", None, None),
]


def _splits(text: str, seed: int = 0):
    """(name, cut positions): one delta; every single cut; every character; random cuts."""
    yield "whole", []
    for i in range(1, len(text)):
        yield f"cut at {i}", [i]
    yield "per character", list(range(1, len(text)))
    rng = random.Random(seed)
    for k in range(5):
        yield f"random {k}", sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 4))) if len(text) > 1 else []


def _streamed(parser, text: str, cuts: list[int]) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    st = parser.stream()
    bounds = [0, *cuts, len(text)]
    parts = [st.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [st.finish()]
    return "".join(r for r, _ in parts) or None, "".join(c for _, c in parts) or None, parts


@pytest.mark.parametrize("name,text,reasoning,answer", RECORDED)
def test_recorded_outputs_whole_and_streamed_at_every_cut(name, text, reasoning, answer):
    parser = get_reasoning_parser(name)()
    assert parser.extract(text) == (reasoning, answer)
    for how, cuts in _splits(text):
        r, c, parts = _streamed(parser, text, cuts)
        assert (r, c) == (reasoning, answer), how
        seen_answer = False                        # reasoning never follows answer text
        for pr, pc in parts:
            assert not (seen_answer and pr), how
            seen_answer = seen_answer or bool(pc)


def test_streaming_holds_back_only_a_possible_tag():
    st = get_reasoning_parser("qwen3")().stream()
    assert st.feed("  <th") == ("", "")            # may still open the block
    assert st.feed("ink>abc</th") == ("abc", "")   # "</th" may still close it
    assert st.feed("ink>\nans") == ("", "\nans")
    assert st.feed("wer</think>") == ("", "wer</think>")
    assert st.finish() == ("", "")
    with pytest.raises(RuntimeError):
        st.feed("x")
    st = get_reasoning_parser("qwen3")().stream()
    assert st.feed(" <tx") == ("", " <tx")         # cannot become <think>: the answer at once
    st = get_reasoning_parser("deepseek_r1")().stream()
    assert st.feed("Hmm") == ("Hmm", "")           # reasoning from the first character
    assert st.feed("</") == ("", "")
    assert st.finish() == ("</", "")


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_enable_thinking_false_and_constrained_outputs(name):
    cls = get_reasoning_parser(name)
    assert cls.thinking_enabled(None) and cls.thinking_enabled({"enable_thinking": True})
    assert cls.thinking_enabled({"enable_thinking": "false"})      # the templates test `is false`
    assert not cls.thinking_enabled({"enable_thinking": False})
    off = cls(enable_thinking=False)
    for text in ("<think>a</think>b", "a</think>b", "plain"):
        assert off.extract(text) == (None, text)
        assert _streamed(off, text, [1, 3])[:2] == (None, text)
    # under a grammar from the first token nothing is implicitly reasoning; an explicit
    # block the grammar allowed still is
    con = cls(constrained=True)
    for text, want in (('{"a": 1}', (None, '{"a": 1}')), ("a</think>b", (None, "a</think>b")),
                       ("<think>a</think>b", ("a", "b"))):
        assert con.extract(text) == want
        assert _streamed(con, text, [2])[:2] == want


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match=r"--reasoning-parser.*'mistral'.*deepseek_r1, qwen3"):
        get_reasoning_parser("mistral")
    from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat

    with pytest.raises(ValueError, match=r"--reasoning-parser.*deepseek_r1, qwen3"):
        OpenAIServingChat(engine=None, models=None, reasoning_parser="r1")


def test_serve_flag_refuses_an_unknown_parser(capsys):
    from pagedllm.entrypoints.cli import build_parser

    assert build_parser().parse_args(["serve", "--reasoning-parser", "qwen3"]).reasoning_parser == "qwen3"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--reasoning-parser", "r1"])
    assert "invalid choice: 'r1' (choose from 'deepseek_r1', 'qwen3')" in capsys.readouterr().err


# --------------------------------------------------------------------------------------
# The chat adapter: reasoning fields, and tool calls read from the answer only
# --------------------------------------------------------------------------------------
def _chat(parser: str | None = "qwen3", kwargs: dict | None = None):
    from types import SimpleNamespace

    from pagedllm.entrypoints.openai.chat_reasoning import ChatReasoning
    from pagedllm.entrypoints.openai.chat_tools import ChatTools

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    body = SimpleNamespace(tools=tools, tool_choice="auto", parallel_tool_calls=True, functions=None,
                           function_call=None, chat_template=None, response_format=None, structured_outputs=None)
    return (ChatReasoning(parser, kwargs, constrained=False),
            ChatTools(body, engine=None, enable_auto_tool_choice=True, tool_call_parser="hermes"))


def _whole(text: str, **kw) -> tuple[dict, str]:
    from pagedllm.outputs import CompletionOutput

    think, tools = _chat(**kw)
    reasoning, answer = think.split(CompletionOutput(index=0, text=text, token_ids=[], finish_reason="stop"))
    message, finish = tools.message(answer)
    return think.message(message, reasoning), finish


def _stream(text: str, cuts: list[int], **kw) -> tuple[str, str, list, list[dict]]:
    think, tools = _chat(**kw)
    bounds = [0, *cuts, len(text)]
    deltas = [d for a, b in zip(bounds, bounds[1:])
              for d in think.stream(0, text[a:b], b == len(text), tools.stream)]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    names = [tc["function"]["name"] for d in deltas for tc in d.get("tool_calls", []) if "id" in tc]
    for d in deltas:
        assert d.get("reasoning") == d.get("reasoning_content")
    return reasoning, content, names, deltas


def test_tool_call_after_reasoning_is_a_call_one_inside_is_not():
    after = f"<think>Paris weather: call the tool.</think>\n{CALL}"
    msg, finish = _whole(after)
    assert finish == "tool_calls" and msg["reasoning_content"] == msg["reasoning"] == "Paris weather: call the tool."
    assert [(t["function"]["name"], t["function"]["arguments"]) for t in msg["tool_calls"]] == [
        ("get_weather", '{"city": "Paris"}')]
    assert msg["content"] is None
    inside = f"<think>I could write {CALL} but will not.</think>It is sunny."
    msg, finish = _whole(inside)
    assert finish == "stop" and "tool_calls" not in msg
    assert msg["reasoning_content"] == f"I could write {CALL} but will not." and msg["content"] == "It is sunny."
    for text, want in ((after, ("Paris weather: call the tool.", "", ["get_weather"])),
                       (inside, (f"I could write {CALL} but will not.", "It is sunny.", []))):
        for how, cuts in _splits(text):
            assert _stream(text, cuts)[:3] == want, how


def test_chat_message_fields():
    msg, _ = _whole("<think>only thinking, cut")               # all reasoning: content null
    assert msg == {"role": "assistant", "content": None, "reasoning_content": "only thinking, cut",
                   "reasoning": "only thinking, cut"}
    msg, _ = _whole("plain")
    assert msg["content"] == "plain" and msg["reasoning_content"] is None
    msg, _ = _whole("<think>a</think>b", kwargs={"enable_thinking": False})
    assert msg["content"] == "<think>a</think>b" and msg["reasoning_content"] is None
    msg, _ = _whole("<think>a</think>b", parser=None)          # no parser: the message as before
    assert msg == {"role": "assistant", "content": "<think>a</think>b"}
    _, _, _, deltas = _stream("<think>ab</think>cd", [3, 9, 12, 17])
    kinds = ["r" if "reasoning_content" in d else "c" for d in deltas]
    assert kinds == sorted(kinds, reverse=True) and set(kinds) == {"r", "c"}   # reasoning, then answer


# --------------------------------------------------------------------------------------
# Live: a random-weight Qwen3 forced through structured outputs
# --------------------------------------------------------------------------------------
# A template that shows enable_thinking as Qwen3's does (an empty think block in the prompt).
THINK_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking is false %}"
                  "<think>\n\n</think>\n\n{% endif %}")
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def qwen3_dir(tiny_model_dir):
    return tiny_model_dir("qwen3", head_dim=64)


@pytest.fixture(scope="module")
def server(qwen3_dir):
    from server_helpers import _Server

    s = _Server(engine_kw=dict(model=qwen3_dir), reasoning_parser="qwen3", enable_auto_tool_choice=True,
                tool_call_parser="hermes", trust_request_chat_template=True)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _forced(server, regex: str, **kw) -> dict:
    return dict(model=server.engine.model_name, messages=kw.pop("messages", MESSAGES),
                max_tokens=kw.pop("max_tokens", 64), temperature=0,
                extra_body={"structured_outputs": {"regex": regex}, **kw.pop("extra_body", {})}, **kw)


def _count_tokens(server, text: str) -> int:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=30)
    return r.json()["count"]


def _collect(chunks) -> tuple[str, str, list, list, dict | None, list[str]]:
    """(reasoning, content, tool-call names, finish reasons, usage, delta kinds in order)."""
    reasoning = content = ""
    names, finishes, kinds, use = [], [], [], None
    for ch in chunks:
        if ch.usage is not None:
            use = ch.usage.model_dump()
        for c in ch.choices:
            d = c.delta
            r = getattr(d, "reasoning_content", None)
            if r:
                assert getattr(d, "reasoning", None) == r
                reasoning += r
                kinds.append("r")
            if d.content:
                content += d.content
                kinds.append("c")
            names += [t.function.name for t in d.tool_calls or [] if t.id]
            if c.finish_reason:
                finishes.append(c.finish_reason)
    return reasoning, content, names, finishes, use, kinds


@pytest.mark.slow   # a live server
def test_server_splits_reasoning_whole_and_streamed(server, client):
    r = client.chat.completions.create(**_forced(server, r"<think>abc def</think>\n\nThe answer\."))
    m = r.choices[0].message
    assert (m.reasoning_content, m.reasoning, m.content) == ("abc def", "abc def", "\n\nThe answer.")
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens_details.reasoning_tokens == _count_tokens(server, "abc def")
    s = client.chat.completions.create(**_forced(server, r"<think>abc def</think>\n\nThe answer\."), stream=True,
                                       stream_options={"include_usage": True})
    reasoning, content, names, finishes, use, kinds = _collect(s)
    assert (reasoning, content, names, finishes) == ("abc def", "\n\nThe answer.", [], ["stop"])
    assert kinds == sorted(kinds, reverse=True)              # every reasoning delta before the answer
    assert use["completion_tokens_details"]["reasoning_tokens"] == r.usage.completion_tokens_details.reasoning_tokens
    assert use["completion_tokens"] == r.usage.completion_tokens
    assert server.idle_and_free()


@pytest.mark.slow   # a live server
def test_server_think_block_cut_by_max_tokens(server, client):
    kw = _forced(server, r"<think>[a-z]{40}</think>done", max_tokens=12)
    r = client.chat.completions.create(**kw)
    m, c = r.choices[0].message, r.choices[0]
    assert c.finish_reason == "length" and m.content is None and r.usage.completion_tokens == 12
    assert m.reasoning_content and m.reasoning_content.isalpha()
    reasoning, content, _, finishes, _, _ = _collect(client.chat.completions.create(**kw, stream=True))
    assert (reasoning, content, finishes) == (m.reasoning_content, "", ["length"])
    assert server.idle_and_free()


@pytest.mark.slow   # a live server
def test_server_tool_calls_only_after_reasoning(server, client):
    after = (r'<think>I need the weather\.</think>\n'
             r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}</tool_call>')
    r = client.chat.completions.create(**_forced(server, after, tools=TOOLS, max_tokens=80))
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.reasoning_content == "I need the weather."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    reasoning, _, names, finishes, _, _ = _collect(
        client.chat.completions.create(**_forced(server, after, tools=TOOLS, max_tokens=80), stream=True))
    assert (reasoning, names, finishes) == ("I need the weather.", ["get_weather"], ["tool_calls"])
    inside = r'<think><tool_call>\{"name": "get_weather", "arguments": \{\}\}</tool_call></think>Sunny\.'
    r = client.chat.completions.create(**_forced(server, inside, tools=TOOLS, max_tokens=80))
    c = r.choices[0]
    assert c.finish_reason == "stop" and not c.message.tool_calls and c.message.content == "Sunny."
    assert c.message.reasoning_content == '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    assert server.idle_and_free()


@pytest.mark.slow   # a live server
def test_server_enable_thinking_false(server, client):
    """The flag reaches the template (the prompt grows by its empty think block) and the
    parser (the same forced output is all answer)."""
    forced = r"<think>abc</think>answer"
    on = client.chat.completions.create(**_forced(server, forced, extra_body={"chat_template": THINK_TEMPLATE}))
    off = client.chat.completions.create(**_forced(server, forced, extra_body={
        "chat_template": THINK_TEMPLATE, "chat_template_kwargs": {"enable_thinking": False}}))
    assert (on.choices[0].message.reasoning_content, on.choices[0].message.content) == ("abc", "answer")
    assert (off.choices[0].message.reasoning_content, off.choices[0].message.content) == (
        None, "<think>abc</think>answer")
    assert off.usage.prompt_tokens == on.usage.prompt_tokens + _count_tokens(server, "<think>\n\n</think>\n\n")
    assert off.usage.completion_tokens_details.reasoning_tokens == 0
    assert server.idle_and_free()


@pytest.mark.slow   # a live server
def test_server_deepseek_r1_under_a_grammar(server, client, monkeypatch):
    """deepseek_r1 (the server's parser swapped): a grammar from the first token leaves no
    implicit reasoning, so JSON output is the answer; an explicit block is reasoning."""
    monkeypatch.setattr(server.server.config.app.state.openai_serving_chat, "reasoning_parser", "deepseek_r1")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = client.chat.completions.create(model=server.engine.model_name, messages=MESSAGES, max_tokens=40,
                                       temperature=0, extra_body={"structured_outputs": {
                                           "json": schema, "disable_any_whitespace": True}})
    m = r.choices[0].message
    assert m.reasoning_content is None and isinstance(json.loads(m.content)["ok"], bool)
    r = client.chat.completions.create(**_forced(server, r"<think>x</think>y"))
    assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == ("x", "y")
    assert server.idle_and_free()


# --------------------------------------------------------------------------------------
# Prompt-cache accounting: usage's cached_tokens against vllm:prefix_cache_hits_total
# --------------------------------------------------------------------------------------
SYSTEM = "You answer questions about the weather. " * 12          # ~100 shared tokens


def _hits(server) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("vllm:prefix_cache_hits_total"))


def _settled_hits(server, want: float) -> float:
    """The counter once the engine is idle (the stat logger records after each step)."""
    assert server.idle_and_free()
    deadline = time.time() + 10
    while (got := _hits(server)) != want and time.time() < deadline:
        time.sleep(0.05)
    return got


def _usage_of_stream(r: httpx.Response) -> dict:
    events = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
    (last,) = [e for e in events if e.get("usage") and not e["choices"]]
    return last["usage"]


def _shared_blocks(server, a, b, key: str) -> int:
    """The tokens of the full blocks that prompts ``a`` and ``b`` (chat messages or text) share."""
    ids = [httpx.post(f"{server.url}/tokenize", json={key: x}, timeout=30).json()["tokens"] for x in (a, b)]
    n = next((i for i, (x, y) in enumerate(zip(*ids)) if x != y), min(map(len, ids)))
    bs = server.engine.engine.config.args.block_size
    return min(n, len(ids[1]) - 1) // bs * bs


def _run_shared_prefix(server, max_tokens: int, temperature: float) -> tuple[int, int, list[dict], list[dict]]:
    """Requests sharing SYSTEM's prefix through both routes, whole and streamed, n 1 to 3.
    Returns (sum of usage cached_tokens, the hits of n > 1 requests' sequences 1..n-1,
    the usages, the bodies)."""
    bs = server.engine.engine.config.args.block_size
    url = server.url
    usages, bodies, siblings = [], [], 0
    for i, (route, stream, n) in enumerate([("chat", False, 1), ("chat", True, 1), ("chat", False, 1),
                                            ("completions", False, 1), ("completions", True, 1),
                                            ("chat", False, 3), ("chat", True, 2), ("completions", True, 2)]):
        body = {"model": server.engine.model_name, "max_tokens": max_tokens, "temperature": temperature,
                "seed": i, "n": n}
        if route == "chat":
            body["messages"] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"City {i}?"}]
        else:
            body["prompt"] = SYSTEM + f"City {i}?"
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        r = httpx.post(f"{url}/v1/{'chat/completions' if route == 'chat' else 'completions'}", json=body,
                       timeout=120)
        assert r.status_code == 200, r.text
        use = _usage_of_stream(r) if stream else r.json()["usage"]
        usages.append(use)
        bodies.append(body)
        # sequences 1..n-1 start once sequence 0 has computed (and cached) the prompt:
        # each finds its full blocks, which usage does not count again
        siblings += (n - 1) * ((use["prompt_tokens"] - 1) // bs * bs)
    return sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages), siblings, usages, bodies


def _check_cached_tokens_equal_metric(server, max_tokens: int = 4, temperature: float = 1.0):
    httpx.post(f"{server.url}/reset_prefix_cache", timeout=30)
    h0 = _settled_hits(server, _hits(server))
    cached, siblings, usages, bodies = _run_shared_prefix(server, max_tokens, temperature)
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0           # the first saw an empty cache
    # requests 1, 2 (chat) and 4 (completions) found the full blocks they share with an earlier one
    for i, earlier, key in ((1, 0, "messages"), (2, 1, "messages"), (4, 3, "prompt")):
        assert usages[i]["prompt_tokens_details"]["cached_tokens"] == _shared_blocks(server, bodies[earlier][key],
                                                                                     bodies[i][key], key)
    assert all(u["prompt_tokens_details"]["cached_tokens"] < u["prompt_tokens"] for u in usages)
    assert cached > 0 and siblings > 0
    assert _settled_hits(server, h0 + cached + siblings) == h0 + cached + siblings


@pytest.mark.slow   # a live server
def test_cached_tokens_equal_the_metric(server):
    _check_cached_tokens_equal_metric(server)


@pytest.mark.slow   # a live server
def test_n_counts_the_prompt_once(server):
    """n = 3 on a fresh prompt: usage counts the prompt once, cached_tokens too (sequence
    0's lookup, 0 here), though sequences 1 and 2 found the prompt that 0 computed."""
    httpx.post(f"{server.url}/reset_prefix_cache", timeout=30)
    body = {"model": server.engine.model_name, "prompt": "fresh " * 70, "max_tokens": 3, "n": 3,
            "temperature": 1.0, "seed": 1}
    one = httpx.post(f"{server.url}/v1/completions", json={**body, "n": 1}, timeout=60).json()["usage"]
    httpx.post(f"{server.url}/reset_prefix_cache", timeout=30)
    h0 = _settled_hits(server, _hits(server))
    use = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["usage"]
    assert use["prompt_tokens"] == one["prompt_tokens"] and use["prompt_tokens_details"]["cached_tokens"] == 0
    full = (use["prompt_tokens"] - 1) // server.engine.engine.config.args.block_size * \
        server.engine.engine.config.args.block_size
    assert _settled_hits(server, h0 + 2 * full) == h0 + 2 * full


@pytest.mark.slow   # a live server
def test_cached_tokens_equal_the_metric_with_ngram_speculation(qwen3_dir):
    from server_helpers import _Server

    s = _Server(engine_kw=dict(model=qwen3_dir, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}))
    try:
        _check_cached_tokens_equal_metric(s, max_tokens=32, temperature=0.0)
        accepted = [float(ln.split()[-1]) for ln in httpx.get(f"{s.url}/metrics", timeout=30).text.splitlines()
                    if ln.startswith("vllm:spec_decode_num_accepted_tokens_total")]
        assert accepted and accepted[0] > 0                 # the run did verify drafts
    finally:
        s.stop()
