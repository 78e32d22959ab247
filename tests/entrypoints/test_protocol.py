"""Request-body validation of the OpenAI server (entrypoints/openai/protocol.py): the
messages a client gets for malformed bodies, without starting a server."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from pagedllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                  describe_validation_error)
from pagedllm.errors import InvalidParameterError


def _error(model, body: dict) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    # FastAPI prefixes each location with "body"; the description must not depend on it.
    errs = [{**x, "loc": ("body", *x["loc"])} for x in e.value.errors()]
    assert describe_validation_error(errs) == describe_validation_error(e.value.errors())
    return describe_validation_error(errs)


@pytest.mark.parametrize("body, message, param", [
    ({"prompt": None},
     "invalid value for prompt: expected a string, an array of strings, an array of integers "
     "or an array of arrays of integers (got null)", "prompt"),
    ({"prompt": 3.5}, "invalid value for prompt: expected a string, an array of strings, an array "
     "of integers or an array of arrays of integers (got a number)", "prompt"),
    ({}, "missing required parameter: prompt", "prompt"),
    ({"prompt": "x", "stop": 5},
     "invalid value for stop: expected a string or an array of strings (got an integer)", "stop"),
    ({"prompt": "x", "max_tokens": "5"}, "invalid value for max_tokens: Input should be a valid integer",
     "max_tokens"),
    ({"prompt": "x", "stream_options": 3},
     "invalid value for stream_options: expected an object (got an integer)", "stream_options"),
    ({"prompt": "x", "frobnicate": 1},
     "unrecognized request argument: frobnicate (this server does not support it)", "frobnicate"),
    # Unknown keys named like pydantic's union tags are still unknown keys.
    ({"prompt": "x", "str": 1}, "unrecognized request argument: str (this server does not support it)", "str"),
    ({"prompt": "x", "list[int]": 1},
     "unrecognized request argument: list[int] (this server does not support it)", "list[int]"),
    ({"prompt": "x", "stream_options": {"bool": 1}},
     "unrecognized request argument: stream_options.bool (this server does not support it)", "stream_options"),
    # An array with a bad item says what its items are.
    ({"prompt": [None]}, "invalid value for prompt: expected a string, an array of strings, an array "
     "of integers or an array of arrays of integers (got an array of null)", "prompt"),
    ({"prompt": [1, "a"]}, "invalid value for prompt: expected a string, an array of strings, an array "
     "of integers or an array of arrays of integers (got an array of integers and strings)", "prompt"),
    ({"prompt": "x", "stop": [1]},
     "invalid value for stop: expected a string or an array of strings (got an array of integers)", "stop"),
])
def test_completion_body_errors(body, message, param):
    assert _error(CompletionRequest, body) == (message, param)


@pytest.mark.parametrize("messages, message", [
    ([{"content": "hi"}], "missing required parameter: messages.0.role"),
    ([{"role": "user", "content": 5}],
     "invalid value for messages.0.content: expected a string or an array of content parts "
     "(got an integer)"),
    (["hi"], "invalid value for messages.0: expected an object (got a string)"),
    ([], "invalid value for messages: List should have at least 1 item after validation, not 0"),
])
def test_chat_message_errors(messages, message):
    assert _error(ChatCompletionRequest, {"messages": messages}) == (message, "messages")


def test_assistant_message_may_omit_content():
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
        {"role": "developer", "content": "be brief"}, {"role": "user", "content": "again"}]})
    assert [m.role for m in req.messages] == ["user", "assistant", "developer", "user"]
    assert req.messages[1].content is None


def test_message_rules_live_in_the_engine_only():
    """The HTTP schema checks the JSON shape; which roles exist and when content may be
    null is decided once, by normalize_chat_messages (HTTP and LLM.chat alike)."""
    from pagedllm.engine.llm_engine import normalize_chat_messages
    from pagedllm.errors import InvalidParameterError

    for msgs, words in [([{"role": "bot", "content": "hi"}], "messages[0].role must be one of"),
                        ([{"role": "user", "content": None}], "messages[0].content is required")]:
        req = ChatCompletionRequest.model_validate({"messages": msgs})
        with pytest.raises(InvalidParameterError) as e:
            normalize_chat_messages([m.model_dump() for m in req.messages])
        assert e.value.param == "messages" and words in str(e.value)


def test_openai_names_map_onto_the_engine_once():
    from pagedllm.errors import InvalidParameterError

    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                "max_tokens": 5, "max_completion_tokens": 3})
    assert req.to_sampling_params(None).max_tokens == 3
    err = req.to_api_error(InvalidParameterError("max_tokens", "max_tokens (3) is too many"))
    assert (err.param, str(err)) == ("max_completion_tokens", "max_completion_tokens (3) is too many")
    assert req.to_api_error(InvalidParameterError("prompt", "x")).param == "messages"
    plain = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5})
    assert plain.to_api_error(InvalidParameterError("max_tokens", "m")).param == "max_tokens"
    assert CompletionRequest.model_validate({"prompt": "x"}).to_api_error(
        InvalidParameterError("prompt", "m")).param == "prompt"


@pytest.mark.parametrize("messages, words", [
    ([], "messages must be a non-empty list"),
    ("hi", "messages must be a non-empty list"),
    (["hi"], "messages[0] must be an object"),
    ([{"role": "robot", "content": "hi"}], "messages[0].role must be one of system, developer"),
    ([{"content": "hi"}], "got None"),
    ([{"role": "user"}], "messages[0].content is required for a message with role 'user'"),
    ([{"role": "system", "content": "x"}, {"role": "tool", "content": None}],
     "messages[1].content is required for a message with role 'tool'"),
    ([{"role": "user", "content": 5}], "messages[0].content must be a string or an array of text parts"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "only text content parts"),
    ([{"role": "user", "content": "a\ud800b"}], "lone surrogate '\\ud800' at character 1"),
])
def test_normalize_chat_messages_errors(messages, words):
    from pagedllm.engine.llm_engine import normalize_chat_messages
    from pagedllm.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError) as e:
        normalize_chat_messages(messages)
    assert e.value.param == "messages" and words in str(e.value)


def test_normalize_chat_messages_content():
    from pagedllm.engine.llm_engine import normalize_chat_messages

    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
            {"role": "assistant"}, {"role": "user", "content": "c", "name": "x"}]
    assert normalize_chat_messages(msgs) == [
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]},
        {"role": "assistant", "content": ""}, {"role": "user", "content": "c", "name": "x"}]
    assert msgs[1]["content"] is None      # the caller's messages are not modified


_MINIMAL = {CompletionRequest: {"prompt": "x"},
            ChatCompletionRequest: {"messages": [{"role": "user", "content": "Hi"}]}}


def _optional_fields(model) -> list[str]:
    return [name for name, f in model.model_fields.items() if not f.is_required()]


@pytest.mark.parametrize("model, name", [(m, n) for m in _MINIMAL for n in _optional_fields(m)],
                         ids=lambda x: x if isinstance(x, str) else x.__name__)
def test_null_means_the_default_for_every_optional_field(model, name):
    """Every declared optional field of both request bodies accepts null, and null means
    its default: the same field value and the same SamplingParams as leaving it out."""
    base = model.model_validate(_MINIMAL[model])
    got = model.model_validate({**_MINIMAL[model], name: None})
    default = model.model_fields[name].default
    assert getattr(got, name) == default == getattr(base, name)
    assert got.to_sampling_params(default_max_tokens=16) == base.to_sampling_params(default_max_tokens=16)


def test_all_optional_fields_null_at_once():
    for model, minimal in _MINIMAL.items():
        body = {**minimal, **{n: None for n in _optional_fields(model)}}
        assert model.model_validate(body) == model.model_validate(minimal)
    r = CompletionRequest.model_validate({"prompt": "x", "stream_options": {"include_usage": None}})
    assert r.stream_options.include_usage is False
    r = CompletionRequest.model_validate({"prompt": "x", "n": None, "stream": None, "min_tokens": None,
                                          "ignore_eos": None, "skip_special_tokens": None})
    assert (r.n, r.stream, r.min_tokens, r.ignore_eos, r.skip_special_tokens) == (1, False, 0, False, True)
    r = ChatCompletionRequest.model_validate({**_MINIMAL[ChatCompletionRequest],
                                              "add_generation_prompt": None,
                                              "include_stop_str_in_output": None})
    assert (r.add_generation_prompt, r.include_stop_str_in_output) == (True, False)


@pytest.mark.parametrize("model, body, message, param", [
    (CompletionRequest, {"prompt": "x", "frobnicate": None},
     "unrecognized request argument: frobnicate (this server does not support it)", "frobnicate"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "Hi"}], "nope": None},
     "unrecognized request argument: nope (this server does not support it)", "nope"),
    (ChatCompletionRequest, {"messages": None},
     "invalid value for messages: Input should be a valid list", "messages"),
    (CompletionRequest, {"prompt": "x", "stream_options": {"bogus": None}},
     "unrecognized request argument: stream_options.bogus (this server does not support it)",
     "stream_options"),
])
def test_null_for_unknown_or_required_fields_is_still_refused(model, body, message, param):
    assert _error(model, body) == (message, param)


@pytest.mark.parametrize("json_schema, message", [
    ({"schema": {"type": "object"}}, "missing required parameter: response_format.json_schema.name"),
    ({"name": "a b", "schema": {"type": "object"}},
     "invalid value for response_format.json_schema.name: String should match pattern '^[A-Za-z0-9_-]{1,64}$'"),
    ({"name": "x" * 65, "schema": {"type": "object"}},
     "invalid value for response_format.json_schema.name: String should match pattern '^[A-Za-z0-9_-]{1,64}$'"),
])
def test_json_schema_needs_a_name(json_schema, message):
    """As OpenAI's API (and vLLM's): ``json_schema.name`` is required, a-z A-Z 0-9 _ -, <= 64."""
    body = {"messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": json_schema}}
    assert _error(ChatCompletionRequest, body) == (message, "response_format")
    ok = {**body, "response_format": {"type": "json_schema", "json_schema": {**json_schema, "name": "ok_1-x"}}}
    assert ChatCompletionRequest.model_validate(ok).response_format.json_schema.name == "ok_1-x"


@pytest.mark.parametrize("model, body", [(CompletionRequest, {"prompt": "x"}),
                                         (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]})])
def test_stream_options_only_with_stream(model, body):
    r = model.model_validate({**body, "stream_options": {"include_usage": True}})
    with pytest.raises(InvalidParameterError) as e:
        r.check_supported()
    assert e.value.param == "stream_options" and "only allowed when stream is true" in str(e.value)
    for ok in ({"stream": True, "stream_options": {"include_usage": True}}, {"stream": None, "stream_options": None},
               {"stream": False}):
        model.model_validate({**body, **ok}).check_supported()
