"""OpenAI tool calling building blocks (pagedllm/entrypoints/openai/tool_calls/): the
hermes and llama3_json parsers (whole and streamed, which must agree however the text is
cut), request checks, constrained-decoding schemas, and rendering for chat templates with
and without tools. No engine: only SmolLM2's tokenizer, for its real chat template."""
from __future__ import annotations

import json
import random
import re

import jinja2
import pytest

from pagedllm.entrypoints.openai.tool_calls import (
    ConstrainedOutputError, ExtractedToolCalls, ToolCall, get_tool_parser, new_tool_call_id,
    parse_constrained_output, render_messages_for_template, template_supports_tools, tool_choice_json_schema,
    validate_parallel_tool_calls, validate_tool_choice, validate_tool_request, validate_tools)
from pagedllm.entrypoints.openai.tool_calls.json_scan import JsonValueScanner, Scan
from pagedllm.errors import InvalidParameterError

ID = re.compile(r"call_[A-Za-z0-9]{24}")
W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def _calls(result: ExtractedToolCalls) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in result.tool_calls]


# --------------------------------------------------------------------------------------
# Recorded outputs: (parser, text, expected calls [(name, arguments)], expected content)
# --------------------------------------------------------------------------------------
WELL_FORMED = [
    ("hermes", f"<tool_call>{W}</tool_call>", [("get_weather", '{"city": "Paris"}')], None),
    ("hermes", f"<tool_call>\n{W}\n</tool_call>\n", [("get_weather", '{"city": "Paris"}')], None),
    ("hermes", f"Let me check.\n\n<tool_call>\n{W}\n</tool_call>",
     [("get_weather", '{"city": "Paris"}')], "Let me check."),
    ("hermes", f"<tool_call>\n{W}\n</tool_call>\n<tool_call>\n"
               '{"name": "get_time", "arguments": {"tz": "Europe/Paris", "24h": true}}\n</tool_call>',
     [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "Europe/Paris", "24h": true}')], None),
    ("hermes", '<tool_call>{"name": "translate", "arguments": {"text": "Grüße aus Zürich ☀️ \\u00e9", '
               '"to": "日本語"}}</tool_call>',
     [("translate", '{"text": "Grüße aus Zürich ☀️ \\u00e9", "to": "日本語"}')], None),
    ("hermes", '<tool_call>{"arguments": {"n": -1.5e3, "xs": [1, {"a": null}], "s": "}{<tool_call>\\""}, '
               '"name": "f"}</tool_call>',
     [("f", '{"n": -1.5e3, "xs": [1, {"a": null}], "s": "}{<tool_call>\\""}')], None),
    ("hermes", '<tool_call>{"name": "now"}</tool_call>', [("now", "{}")], None),
    ("hermes", '<tool_call>{"name": "now", "arguments": {}, "id": 7}</tool_call>', [("now", "{}")], None),
    ("hermes", f"<tool_call>{W}</tool_call>\nI asked for the weather.",
     [("get_weather", '{"city": "Paris"}')], "\nI asked for the weather."),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}',
     [("get_weather", '{"city": "Paris"}')], None),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}}',
     [("a", '{"x": 1}'), ("b", "{}")], None),
    ("llama3_json", '  {"name": "a", "parameters": {"x": 10}} ;\n{"name": "b", "parameters": {"y": "é"}}\n',
     [("a", '{"x": 10}'), ("b", '{"y": "é"}')], None),
]

PLAIN = [  # no call: all content
    ("hermes", "The weather in Paris is sunny."),
    ("hermes", "  leading and trailing whitespace \n"),
    ("hermes", "I will use <tool_call> blocks later"),      # marker inside text: malformed, content
    ("hermes", "a < b and <tool but not a call"),
    ("hermes", "ends with a partial marker <tool_ca"),
    ("hermes", ""),
    ("llama3_json", "The answer is 42."),
    ("llama3_json", "Sure! " + W),
    ("llama3_json", "<|python_tag|>print('hi')"),
    ("llama3_json", "  \n"),
]

MALFORMED = [  # the non-streaming parser returns them as content
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}</tool_call>'),   # missing }
    ("hermes", "<tool_call>not json</tool_call>"),
    ("hermes", '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>'),                        # no name
    ("hermes", f"<tool_call>{W}"),                                                                 # unterminated
    ("hermes", f"<tool_call>{W}</tool_call><tool_call>" + '{"name": "x", "arguments": {'),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'),              # string args
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "name": "g", "arguments": {}}</tool_call>'),
    ("hermes", f"<tool_call>{W} trailing</tool_call>"),
    ("hermes", f"Text <tool_call>{W}</tool_cal"),
    ("llama3_json", '{"name": "a", "parameters": {"x": 1}} and then text'),
    ("llama3_json", '{"name": "a", "parameters": {"x": 1}};'),
    ("llama3_json", '{"parameters": {"x": 1}}'),
    ("llama3_json", '{"name": "a", "parameters": {"x": 1}'),
    ("llama3_json", '{"answer": 42}'),
]


@pytest.mark.parametrize("parser, text, calls, content", WELL_FORMED)
def test_extract_well_formed(parser, text, calls, content):
    r = get_tool_parser(parser)().extract_tool_calls(text)
    assert r.tools_called
    assert _calls(r) == calls
    assert r.content == content
    for c in r.tool_calls:
        assert ID.fullmatch(c.id)
        json.loads(c.arguments)
    assert len({c.id for c in r.tool_calls}) == len(r.tool_calls)


@pytest.mark.parametrize("parser, text", PLAIN + MALFORMED)
def test_extract_plain_and_malformed_are_content(parser, text):
    r = get_tool_parser(parser)().extract_tool_calls(text)
    assert r == ExtractedToolCalls(tools_called=False, tool_calls=[], content=text)


def _stream(parser_name: str, text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str, str]], list[dict]]:
    """Feed ``text`` cut at ``cuts``; returns (content, [(id, name, arguments)], deltas),
    checking the OpenAI shape of every delta on the way."""
    p = get_tool_parser(parser_name)()
    bounds = [0, *cuts, len(text)]
    deltas = []
    for a, b in zip(bounds, bounds[1:]):
        deltas += p.extract_streaming(text[a:b])
    deltas += p.finish()
    content, calls = "", []
    for d in deltas:
        assert len(d) == 1
        if "content" in d:
            assert d["content"]
            content += d["content"]
            continue
        (tc,) = d["tool_calls"]
        if "id" in tc:   # a call's first delta: id, type, name, no arguments yet
            assert tc["index"] == len(calls) and ID.fullmatch(tc["id"]) and tc["type"] == "function"
            assert tc["function"]["arguments"] == ""
            calls.append([tc["id"], tc["function"]["name"], ""])
        else:
            assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
            assert tc["index"] == len(calls) - 1 and tc["function"]["arguments"]
            calls[-1][2] += tc["function"]["arguments"]
    assert [tuple(c) for c in calls] == [(c.id, c.name, c.arguments) for c in p.tool_calls]
    return content, [tuple(c) for c in calls], deltas


def _splits(text: str):
    yield "whole", []
    for step in (1, 2, 3, 7):
        yield f"every {step}", list(range(step, len(text), step))
    rng = random.Random(len(text))
    for k in range(5 if len(text) > 1 else 0):
        yield f"random {k}", sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))


@pytest.mark.parametrize("parser, text, calls, content", WELL_FORMED)
def test_streaming_equals_non_streaming(parser, text, calls, content):
    for how, cuts in _splits(text):
        got_content, got_calls, _ = _stream(parser, text, cuts)
        assert got_content == (content or ""), how
        assert [(n, a) for _, n, a in got_calls] == calls, how


@pytest.mark.parametrize("parser, text", PLAIN + MALFORMED)
def test_streaming_never_depends_on_the_cuts(parser, text):
    """Malformed outputs may stream differently from non-streaming (a call sent cannot be
    taken back), but never raise, and what is sent does not depend on the cuts."""
    results = set()
    for how, cuts in _splits(text):
        content, calls, _ = _stream(parser, text, cuts)
        results.add((content, tuple((n, a) for _, n, a in calls)))
    assert len(results) == 1, results


@pytest.mark.parametrize("parser, text", PLAIN + [
    ("hermes", "<tool_call>not json</tool_call>"),
    ("hermes", '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>'),
    ("hermes", "<tool_call>"),
    ("hermes", "\n<tool_call>{\"na"),
    ("llama3_json", '{"parameters": {"x": 1}}'),
    ("llama3_json", '{"answer": 42}'),
])
def test_streamed_as_content_when_broken_before_the_name(parser, text):
    """No call was sent yet: streaming gives exactly the non-streaming result (all content)."""
    for how, cuts in _splits(text):
        content, calls, _ = _stream(parser, text, cuts)
        assert (content, calls) == (text, []), how


def test_streaming_after_a_sent_call_keeps_it():
    # the missing brace is found after the call was sent: the call stays, the rest is content
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}</tool_call>'
    content, calls, _ = _stream("hermes", text, [])
    assert content == "</tool_call>"
    assert [(n, a) for _, n, a in calls] == [("get_weather", '{"city": "Paris"}')]
    # an unterminated call: sent as far as it went
    content, calls, _ = _stream("hermes", f'ok <tool_call>{{"name": "f", "arguments": {{"a": [1, 2', [])
    assert content == "ok" and [(n, a) for _, n, a in calls] == [("f", '{"a": [1, 2')]


def test_streaming_delta_shapes_and_hold_back():
    p = get_tool_parser("hermes")()
    assert p.extract_streaming("Sure") == [{"content": "Sure"}]
    assert p.extract_streaming(". \n<tool") == [{"content": "."}]      # " \n<tool" held back
    assert p.extract_streaming("_call>\n{\"name\": \"get_") == []
    first = p.extract_streaming('weather", "arguments": {"ci')
    assert first[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first[1:] == [{"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}]
    assert p.extract_streaming('ty": "Paris"}}\n</tool_call>\n') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]}]
    assert p.finish() == []
    assert not p.malformed and p.tool_calls[0].arguments == '{"city": "Paris"}'
    with pytest.raises(RuntimeError):
        p.extract_streaming("x")

    p = get_tool_parser("hermes")()
    assert p.extract_streaming("x <tool_c") == [{"content": "x"}]
    assert p.finish() == [{"content": " <tool_c"}]          # no call: held text is content


def test_tool_call_ids():
    ids = {new_tool_call_id() for _ in range(200)}
    assert len(ids) == 200 and all(ID.fullmatch(i) for i in ids)
    text = f"<tool_call>{W}</tool_call><tool_call>{W}</tool_call>"
    a, b = (get_tool_parser("hermes")().extract_tool_calls(text) for _ in range(2))
    assert len({c.id for c in a.tool_calls + b.tool_calls}) == 4
    assert ToolCall("call_x", "f", "{}").to_openai() == {
        "id": "call_x", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def test_get_tool_parser_unknown_name():
    with pytest.raises(ValueError, match=r"--tool-call-parser.*'mistral'.*hermes, llama3_json"):
        get_tool_parser("mistral")


@pytest.mark.parametrize("text, ok", [
    ('{"a": [1, 2.5, -0, 1e-3, true, false, null, "\\u00e9\\n"]}', True),
    ('{"a": 01}', False), ('{"a": 1.}', False), ('{"a": .5}', False), ('{"a": tru}', False),
    ('{"a": "\\x"}', False), ('{"a": "\n"}', False), ('{"a": 1,}', False), ('{a: 1}', False),
    ('[1, [2, [3]]]', True), ('{"a": Infinity}', False), ('"\\ud83d\\ude00"', True),
])
def test_json_scanner_agrees_with_json_loads(text, ok):
    s, results = JsonValueScanner(), []
    for c in text:
        results.append(s.feed(c))
        if results[-1] in (Scan.DONE, Scan.ERROR):
            break
    assert (results[-1] is Scan.DONE and len(results) == len(text)) == ok
    if ok:
        json.loads(text)


# --------------------------------------------------------------------------------------
# Request checks
# --------------------------------------------------------------------------------------
def _tool(name, params=None, **extra):
    fn = {"name": name, "description": f"{name} tool", **extra}
    if params is not None:
        fn["parameters"] = params
    return {"type": "function", "function": fn}


WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [_tool("get_weather", WEATHER_SCHEMA), _tool("now")]


def test_validate_tools_normalises():
    tools = validate_tools(TOOLS)
    assert tools[0] == TOOLS[0]
    assert tools[1]["function"]["parameters"] == {"type": "object", "properties": {}}
    assert "parameters" not in TOOLS[1]["function"]    # input not modified
    assert validate_tools(None) == [] and validate_tools([]) == []


@pytest.mark.parametrize("tools, message", [
    ({"type": "function"}, "tools must be an array"),
    (["x"], r"tools\[0\] must be an object"),
    ([{"type": "code_interpreter"}], r"tools\[0\].type must be \"function\""),
    ([{"type": "function", "function": {"name": "f"}, "x": 1}], "unknown keys: x"),
    ([{"type": "function"}], r"tools\[0\].function must be an object"),
    ([_tool("get weather")], "1 to 64 letters"),
    ([_tool("f" * 65)], "1 to 64 letters"),
    ([{"type": "function", "function": {"name": 3}}], "1 to 64 letters"),
    ([_tool("f"), _tool("g"), _tool("f")], r"tools\[2\].function.name: 'f' is given twice"),
    ([_tool("f", description=3)], "description must be a string"),
    ([_tool("f", params=[1])], "parameters must be a JSON Schema object"),
    ([_tool("f", params={"type": "string"})], "must describe an object"),
    ([_tool("f", strict="yes")], "strict must be a boolean"),
    ([{"type": "function", "function": {"name": "f", "examples": []}}], "unknown keys: examples"),
])
def test_validate_tools_refuses(tools, message):
    with pytest.raises(InvalidParameterError, match=message) as e:
        validate_tools(tools)
    assert e.value.param == "tools"


def test_validate_tool_choice():
    tools = validate_tools(TOOLS)
    assert validate_tool_choice(None, tools) == "auto"
    assert validate_tool_choice(None, []) == "none"
    for mode in ("none", "auto", "required"):
        assert validate_tool_choice(mode, tools) == mode
    named = {"type": "function", "function": {"name": "now"}}
    assert validate_tool_choice(named, tools) == named
    for bad, message in [("any", "must be one of"), (3, "must be"), ({"type": "function"}, "must be"),
                         ({"type": "function", "function": {"name": "nope"}}, "'nope', which is not among"),
                         ({"type": "function", "function": {"name": "now", "x": 1}}, "must be")]:
        with pytest.raises(InvalidParameterError, match=message) as e:
            validate_tool_choice(bad, tools)
        assert e.value.param == "tool_choice"
    with pytest.raises(InvalidParameterError, match="needs tools"):
        validate_tool_choice("required", [])
    with pytest.raises(InvalidParameterError, match="none given"):
        validate_tool_choice(named, [])


def test_validate_parallel_tool_calls_and_legacy_fields():
    assert validate_parallel_tool_calls(None) is True
    assert validate_parallel_tool_calls(False) is False
    with pytest.raises(InvalidParameterError) as e:
        validate_parallel_tool_calls("false")
    assert e.value.param == "parallel_tool_calls"
    req = validate_tool_request(TOOLS, {"type": "function", "function": {"name": "now"}}, False,
                                functions=[], function_call="none")
    assert req.named_function == "now" and req.parallel_tool_calls is False and len(req.tools) == 2
    for kwargs, param in [({"functions": [{"name": "f"}]}, "functions"), ({"function_call": "auto"}, "function_call")]:
        with pytest.raises(InvalidParameterError, match="deprecated") as e:
            validate_tool_request(**kwargs)
        assert e.value.param == param


# --------------------------------------------------------------------------------------
# Constrained decoding
# --------------------------------------------------------------------------------------
def test_schema_for_a_named_function_is_its_parameters():
    tools = validate_tools(TOOLS)
    assert tool_choice_json_schema(tools, {"type": "function", "function": {"name": "get_weather"}}) == WEATHER_SCHEMA
    assert tool_choice_json_schema(tools, {"type": "function", "function": {"name": "now"}}) == {
        "type": "object", "properties": {}}
    assert tool_choice_json_schema(tools, "auto") is None and tool_choice_json_schema(tools, "none") is None


def test_schema_for_required():
    tools = validate_tools(TOOLS)
    schema = tool_choice_json_schema(tools, "required", parallel_tool_calls=True)
    assert schema == {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "const": "get_weather"}, "parameters": WEATHER_SCHEMA},
         "required": ["name", "parameters"]},
        {"properties": {"name": {"type": "string", "const": "now"},
                        "parameters": {"type": "object", "properties": {}}},
         "required": ["name", "parameters"]}]}}
    assert tool_choice_json_schema(tools, "required", parallel_tool_calls=False)["maxItems"] == 1


def test_schema_for_required_reroots_references():
    """Under "required" each tool's local references are re-rooted where its schema sits,
    so $defs, draft-07 definitions, #/properties/... and # itself resolve; two tools may use
    one $defs name for different schemas; values under const/enum/default are data."""
    unit = {"enum": ["C", "F"]}
    params = {"type": "object", "properties": {"u": {"$ref": "#/$defs/unit"}}, "$defs": {"unit": unit}}
    other = {**params, "$defs": {"unit": {"enum": ["K"]}}}
    old_style = {"type": "object", "properties": {"c": {"$ref": "#/definitions/C"},
                                                  "d": {"$ref": "#/properties/c"},
                                                  "default": {"$ref": "#/properties/c"}},
                 "definitions": {"C": {"type": "integer"}}, "required": ["c", "d"],
                 "default": {"$ref": "#/not/a/schema"}}
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}},
            "required": ["kids"], "additionalProperties": False}
    tools = validate_tools([_tool("a", params), _tool("b", other), _tool("c", old_style), _tool("t", tree)])
    schema = tool_choice_json_schema(tools, "required")
    alts = [a["properties"]["parameters"] for a in schema["items"]["anyOf"]]
    assert alts[0]["properties"]["u"] == {"$ref": "#/items/anyOf/0/properties/parameters/$defs/unit"}
    assert alts[1]["properties"]["u"] == {"$ref": "#/items/anyOf/1/properties/parameters/$defs/unit"}
    assert alts[2]["properties"]["d"] == {"$ref": "#/items/anyOf/2/properties/parameters/properties/c"}
    assert alts[2]["properties"]["default"] == alts[2]["properties"]["d"]   # a property named "default"
    assert alts[2]["default"] == {"$ref": "#/not/a/schema"}                  # data, left as it is
    assert alts[3]["properties"]["kids"]["items"] == {"$ref": "#/items/anyOf/3/properties/parameters"}
    # draft-07 "dependencies" maps property names (here "default") to schemas
    dep = {"type": "object", "properties": {"default": {}}, "dependencies": {"default": {"$ref": "#/$defs/T"}},
           "$defs": {"T": {"required": ["default"]}}}
    (alt,) = tool_choice_json_schema(validate_tools([_tool("d", dep)]), "required")["items"]["anyOf"]
    assert alt["properties"]["parameters"]["dependencies"]["default"] == {
        "$ref": "#/items/anyOf/0/properties/parameters/$defs/T"}
    assert tools[0]["function"]["parameters"] == params    # input not modified
    from pagedllm.sampling_params import StructuredOutputsParams
    from pagedllm.structured_output import validate_structured_outputs
    validate_structured_outputs(StructuredOutputsParams(json=schema))   # the references resolve (else raises)
    # What the grammar takes: each tool's own $defs/unit, its own #/properties/c, recursion.
    import json

    import xgrammar as xgr
    tok = xgr.TokenizerInfo([chr(i) for i in range(32, 127)])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(tok).compile_json_schema(json.dumps(schema)))

    def accepts(value) -> bool:
        matcher.reset()
        return all(matcher.accept_string(ch) for ch in json.dumps([value], separators=(",", ":")))
    assert accepts({"name": "a", "parameters": {"u": "F"}})
    assert not accepts({"name": "a", "parameters": {"u": "K"}})
    assert accepts({"name": "b", "parameters": {"u": "K"}})
    assert accepts({"name": "c", "parameters": {"c": 1, "d": 2}})
    assert not accepts({"name": "c", "parameters": {"c": 1, "d": "x"}})
    assert accepts({"name": "t", "parameters": {"kids": [{"kids": []}]}})
    assert not accepts({"name": "t", "parameters": {"kids": [{"kids": [1]}]}})


def test_parse_constrained_output():
    tools = validate_tools(TOOLS)
    named = {"type": "function", "function": {"name": "get_weather"}}
    (call,) = parse_constrained_output('{ "city" : "Zürich" }', tools, named)
    assert (call.name, call.arguments) == ("get_weather", '{"city":"Zürich"}') and ID.fullmatch(call.id)
    calls = parse_constrained_output('[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
                                     '{"name": "now", "parameters": {}}]', tools, "required")
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city":"Paris"}'), ("now", "{}")]
    assert calls[0].id != calls[1].id
    for text, choice in [('{"city": "Par', named), ("[1]", named), ("[]", "required"),
                         ('[{"name": "nope", "parameters": {}}]', "required"),
                         ('[{"name": "now"}]', "required")]:
        with pytest.raises(ConstrainedOutputError):
            parse_constrained_output(text, tools, choice)
    with pytest.raises(ValueError):
        parse_constrained_output("{}", tools, "auto")


# --------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------
CONVERSATION = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_abc", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_abc", "content": '{"temperature_c": 21, "sky": "ensoleillé"}'},
]

TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}[{{ t.function.name }}]{% endfor %}\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for tc in m.tool_calls or [] %}CALL {{ tc.function.name }} {{ tc.function.arguments.city }}{% endfor %}"
    "{% if m.tool_call_id %} (for {{ m.tool_call_id }}){% endif %}\n{% endfor %}")


def test_template_supports_tools():
    assert template_supports_tools(TOOLS_TEMPLATE)
    assert not template_supports_tools("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert not template_supports_tools("{% set tools = [] %}{{ tools }}")     # its own variable
    assert not template_supports_tools(None) and not template_supports_tools("")
    # jinja2 cannot parse transformers' {% generation %} tag: the regex decides
    assert template_supports_tools("{% generation %}{{ tools | tojson }}{% endgeneration %}")
    assert not template_supports_tools("{% generation %}{{ messages }}{% endgeneration %}")


def test_render_for_a_template_with_tools():
    tools = validate_tools(TOOLS)
    messages, tools_kwarg, note = render_messages_for_template(CONVERSATION, tools, True)
    assert tools_kwarg == tools and note is None
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert CONVERSATION[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'   # not modified
    assert messages[2]["tool_call_id"] == "call_abc"
    text = jinja2.Environment().from_string(TOOLS_TEMPLATE).render(messages=messages, tools=tools_kwarg)
    assert text.startswith("TOOLS:[get_weather][now]\n")
    assert "CALL get_weather Paris" in text and "(for call_abc)" in text
    # malformed arguments echoed back by a client stay a string instead of failing
    bad = [{**CONVERSATION[1], "tool_calls": [{"id": "c", "type": "function",
                                                "function": {"name": "f", "arguments": "{oops"}}]}]
    assert render_messages_for_template(bad, tools, True)[0][0]["tool_calls"][0]["function"]["arguments"] == "{oops"


def test_render_without_template_support():
    tools = validate_tools(TOOLS)
    messages, tools_kwarg, note = render_messages_for_template(
        [{"role": "system", "content": "Be brief."}] + CONVERSATION + [
            {"role": "tool", "tool_call_id": "call_abc", "name": "now", "content": "12:00"}], tools, False)
    assert tools_kwarg is None and "system prompt" in note and "does not support tools" in note
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools")
    assert json.dumps(tools[0], ensure_ascii=False) in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content":
                           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'}
    assert messages[3]["content"] == (
        '<tool_response>\n{"name": "get_weather", "tool_call_id": "call_abc", "content": '
        '"{\\"temperature_c\\": 21, \\"sky\\": \\"ensoleillé\\"}"}\n</tool_response>\n'
        '<tool_response>\n{"name": "now", "tool_call_id": "call_abc", "content": "12:00"}\n</tool_response>')
    # what the rendered assistant turn says is what the hermes parser reads back
    r = get_tool_parser("hermes")().extract_tool_calls(messages[2]["content"])
    assert _calls(r) == [("get_weather", '{"city": "Paris"}')]
    # no system message: one is added; no tools and no tool messages: nothing changes
    messages, _, _ = render_messages_for_template(CONVERSATION[:1], tools, False)
    assert messages[0]["role"] == "system" and messages[1:] == CONVERSATION[:1]
    assert render_messages_for_template(CONVERSATION[:1], None, False) == (CONVERSATION[:1], None, None)
    _, _, note = render_messages_for_template(CONVERSATION, None, False)
    assert "messages as text" in note


@pytest.mark.parametrize("messages", [
    [{"role": "assistant", "content": None, "tool_calls": {"id": "x"}}],
    [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}],
    [{"role": "tool", "content": "x"}],
    [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "zzz", "content": "x"}],
    CONVERSATION[:2] + [{"role": "tool", "tool_call_id": "call_zzz", "content": "x"}],
    [{"role": "tool", "tool_call_id": "call_abc", "content": "x"}] + CONVERSATION[:2],   # before the call
    [{"role": "assistant", "content": None, "tool_calls": [{"id": ["c1"], "type": "function",
                                                             "function": {"name": "f", "arguments": "{}"}}]}],
])
def test_render_refuses_malformed_tool_messages(messages):
    with pytest.raises(InvalidParameterError) as e:
        render_messages_for_template(messages, None, False)
    assert e.value.param == "messages"


@pytest.mark.parametrize("messages", ["hi", ["hi"], None])
def test_render_leaves_other_shapes_to_the_engine_checks(messages):
    assert render_messages_for_template(messages, None, False) == (messages, None, None)


@pytest.fixture(scope="module")
def smollm_tokenizer():
    """The bundled model's tokenizer (~5-12 s to load)."""
    from pagedllm.tokenizer import get_tokenizer
    from pagedllm.utils import default_model_path
    return get_tokenizer(default_model_path())


def test_render_with_smollm2_template(smollm_tokenizer):
    """SmolLM2's ChatML template knows no tools: they reach the prompt as text."""
    from pagedllm.engine.llm_engine import normalize_chat_messages
    tok = smollm_tokenizer
    assert not template_supports_tools(tok.chat_template)
    tools = validate_tools(TOOLS)
    messages, tools_kwarg, note = render_messages_for_template(CONVERSATION, tools, False)
    messages = normalize_chat_messages(messages)     # as LLMEngine.apply_chat_template does
    text = tok.apply_chat_template(messages, tools=tools_kwarg, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert '"name": "get_weather"' in text and '"name": "now"' in text
    assert json.dumps(WEATHER_SCHEMA) in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<|im_start|>user\n<tool_response>" in text and "call_abc" in text and "ensoleillé" in text
    assert text.endswith("<|im_start|>assistant\n")
    # without the rewrite the same template would silently drop them
    plain = tok.apply_chat_template(normalize_chat_messages(CONVERSATION), tools=tools, tokenize=False)
    assert "get_weather" not in plain.replace("What is the weather", "")


# --------------------------------------------------------------------------------------
# ChatTools, tool_choice "auto": streamed and whole completions give the same message
# --------------------------------------------------------------------------------------
def _auto_tools(names=("get_weather", "get_time", "f", "now", "translate", "a", "b", "x")):
    from types import SimpleNamespace

    from pagedllm.entrypoints.openai.chat_tools import ChatTools

    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in names]
    body = SimpleNamespace(tools=tools, tool_choice="auto", parallel_tool_calls=True, functions=None,
                           function_call=None, chat_template=None, response_format=None, structured_outputs=None)
    return ChatTools(body, engine=None, enable_auto_tool_choice=True, tool_call_parser="hermes")


def _streamed_message(text: str, cuts: list[int], finish_reason: str = "stop"):
    """(content, [(name, arguments)], finish reason, deltas) of ``text`` streamed in the cuts."""
    from pagedllm.outputs import CompletionOutput

    ct = _auto_tools()
    bounds = [0, *cuts, len(text)]
    deltas = []
    for a, b in zip(bounds, bounds[1:]):
        deltas.append(ct.stream(0, text[a:b], b == len(text)))
    content, calls = "", []
    for d in (x for ds in deltas for x in ds):
        if "content" in d:
            content += d["content"]
            continue
        (tc,) = d["tool_calls"]
        if "id" in tc:
            assert ID.fullmatch(tc["id"]) and tc["function"]["arguments"] == "" and tc["index"] == len(calls)
            calls.append([tc["function"]["name"], ""])
        else:
            calls[tc["index"]][1] += tc["function"]["arguments"]
    reason = ct.finish_reason(CompletionOutput(index=0, text=text, token_ids=[], finish_reason=finish_reason))
    return content or None, [tuple(c) for c in calls], reason, deltas


def _whole_message(text: str, finish_reason: str = "stop"):
    from pagedllm.outputs import CompletionOutput

    msg, reason = _auto_tools().message(CompletionOutput(index=0, text=text, token_ids=[],
                                                         finish_reason=finish_reason))
    calls = [(t["function"]["name"], t["function"]["arguments"]) for t in msg.get("tool_calls", [])]
    return msg["content"] or None, calls, reason     # "" and None: no content


UNDECLARED = '<tool_call>\n{"name": "launch_rocket", "arguments": {"x": 1}}\n</tool_call>'


@pytest.mark.parametrize("text", [t for p, t, *_ in WELL_FORMED + PLAIN + MALFORMED if p == "hermes"] + [
    UNDECLARED, f"<tool_call>{W}</tool_call>\n{UNDECLARED}",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>',   # the helper's case
])
def test_auto_streaming_gives_the_whole_completions_message(text):
    """Whatever the cuts, a streamed "auto" completion makes exactly the calls and content
    of the same completion read whole: a malformed call or one to an undeclared function
    is content in both (never a call with broken arguments), finish_reason alike."""
    whole = _whole_message(text)
    for how, cuts in _splits(text):
        content, calls, reason, _ = _streamed_message(text, cuts)
        assert (content, calls, reason) == whole, how


def test_auto_undeclared_function_and_broken_arguments_are_content():
    assert _whole_message(UNDECLARED) == (UNDECLARED, [], "stop")
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>'
    assert _whole_message(broken) == (broken, [], "stop")
    ok = f"Let me check.\n<tool_call>{W}</tool_call>"
    assert _whole_message(ok) == ("Let me check.", [("get_weather", '{"city": "Paris"}')], "tool_calls")
    assert _whole_message("") == (None, [], "stop")


def test_auto_streaming_sends_content_before_a_call_at_once():
    text = f"Let me check. <tool_call>{W}</tool_call>"
    cut = text.index("<tool_call>") + 3
    _, calls, reason, deltas = _streamed_message(text, [cut])
    assert deltas[0] == [{"content": "Let me check."}]      # not held until the end
    assert calls == [("get_weather", '{"city": "Paris"}')] and reason == "tool_calls"
