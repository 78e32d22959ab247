"""OpenAI API request bodies (pydantic, strict types) and their mapping to SamplingParams.

Extensions as in vLLM: top_k, min_p, min_tokens, ignore_eos, stop_token_ids,
include_stop_str_in_output, skip_special_tokens, cache_salt, and for chat
add_generation_prompt, chat_template (when trusted) and chat_template_kwargs.

Unknown fields are rejected (HTTP 400 naming the field, as OpenAI's API does), so that a
client never gets an answer that silently ignores what it asked for. Fields a client may
send with their neutral value (``n: 1``, ``presence_penalty: 0``, ``logprobs: false``,
``tools: []``, ...) are declared and accepted with that value only; fields that do not
change the output (``user``, ``metadata``, ``store``, ``service_tier``, ...) are accepted
and ignored.

``null`` means the default for every optional field (as OpenAI's and vLLM's servers treat
it): ``"n": null`` is ``n: 1``, ``"stream": null`` is ``stream: false``. A required field
(``prompt``, ``messages``) still refuses null, and an unknown field is refused whatever its
value.
"""
from __future__ import annotations

import re
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pagedllm.errors import InvalidParameterError
from pagedllm.sampling_params import SamplingParams


def _none_or(*neutral):
    """A predicate: the value is None or equal to one of ``neutral`` (bools never match
    numbers, so ``logprobs: 0`` is not ``false``)."""
    def ok(v) -> bool:
        return v is None or any(type(v) is type(n) and v == n for n in neutral)
    return ok


def _is_zero(v) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """Drop ``null`` for declared optional fields, so that they take their default
        (fields whose default is None accept null as it is); required and unknown fields
        keep it, to be refused by name."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if not (v is None and k in fields and not fields[k].is_required())}


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # accepted and ignored (no obfuscation padding)


class _SamplingFields(_Strict):
    # Declared fields that are only accepted with a neutral value: name -> predicate.
    _NEUTRAL: ClassVar[dict[str, Any]] = {
        "presence_penalty": _is_zero,
        "frequency_penalty": _is_zero,
        "repetition_penalty": lambda v: v is None or (not isinstance(v, bool) and v == 1),
        "logit_bias": lambda v: v is None or v == {},
        "logprobs": _none_or(False),
    }
    _WHY: ClassVar[dict[str, str]] = {
        "presence_penalty": "only 0", "frequency_penalty": "only 0", "repetition_penalty": "only 1",
        "logit_bias": "only an empty object",
        "logprobs": "only false or null: log probabilities are not returned",
    }

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    # accepted with their neutral value only (see _NEUTRAL)
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    logit_bias: Any = None
    logprobs: Any = None
    # accepted and ignored: they do not change the output
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    def check_supported(self) -> None:
        """Raises InvalidParameterError naming a field set to a value we would ignore."""
        for name, ok in self._NEUTRAL.items():
            if not ok(getattr(self, name)):
                why = self._WHY.get(name)
                raise InvalidParameterError(
                    name, f"{name} is not supported{f' ({why})' if why else ''}")

    def requested_max_tokens(self) -> int | None:
        """The output-token limit the client asked for (None: not set)."""
        return self.max_tokens

    def api_param_names(self) -> dict[str, str]:
        """Engine parameter name -> the field of this request that carried it, where they
        differ (the one place OpenAI's names are mapped onto the engine's)."""
        return {}

    def to_api_error(self, e: InvalidParameterError) -> InvalidParameterError:
        """``e`` with its parameter (and the name in its message) as this request spells it."""
        name = self.api_param_names().get(e.param)
        if name is None:
            return e
        return InvalidParameterError(name, str(e).replace(e.param, name))

    def to_sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        """Raises InvalidParameterError naming the engine's parameter (see ``to_api_error``)."""
        self.check_supported()
        max_tokens = self.requested_max_tokens()
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            cache_salt=self.cache_salt,
        )


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. ``max_tokens`` defaults to 16 (OpenAI's default)."""

    _NEUTRAL: ClassVar[dict[str, Any]] = {
        **_SamplingFields._NEUTRAL,
        "echo": _none_or(False),
        "suffix": _none_or(""),
        "best_of": _none_or(1),
    }
    _WHY: ClassVar[dict[str, str]] = {**_SamplingFields._WHY, "best_of": "only 1",
                                     "echo": "only false", "suffix": "only empty"}

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: Any = None
    suffix: Any = None
    best_of: Any = None


class ChatMessage(BaseModel):
    """The JSON shape of one message of ``messages``: a role string and text content (a
    string, an array of content parts, or null). The rules (which roles, when content may
    be null, which parts) are the engine's, checked once for HTTP and offline alike by
    ``normalize_chat_messages``."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. ``max_tokens`` (or ``max_completion_tokens``) defaults
    to what is left of max_model_len. ``chat_template`` is honoured only when the server
    trusts request templates (``--trust-request-chat-template``)."""

    _NEUTRAL: ClassVar[dict[str, Any]] = {
        **_SamplingFields._NEUTRAL,
        "top_logprobs": _is_zero,
        "response_format": lambda v: v is None or v == {"type": "text"},
        "tools": lambda v: v is None or v == [],
        "functions": lambda v: v is None or v == [],
        "tool_choice": _none_or("none"),
        "function_call": _none_or("none"),
        "modalities": lambda v: v is None or v == ["text"],
    }
    _WHY: ClassVar[dict[str, str]] = {
        **_SamplingFields._WHY, "top_logprobs": "only 0: log probabilities are not returned",
        "response_format": 'only {"type": "text"}', "tools": "no tool calling",
        "functions": "no tool calling", "tool_choice": 'only "none"', "function_call": 'only "none"',
        "modalities": 'only ["text"]',
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's current name of max_tokens; wins over it
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (vLLM's field)
    top_logprobs: Any = None
    response_format: Any = None
    tools: Any = None
    functions: Any = None
    tool_choice: Any = None
    function_call: Any = None
    modalities: Any = None
    parallel_tool_calls: bool | None = None  # only meaningful with tools, which are rejected

    def requested_max_tokens(self) -> int | None:
        # OpenAI's current name wins over the deprecated max_tokens, as in vLLM
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens

    def api_param_names(self) -> dict[str, str]:
        names = {"prompt": "messages"}   # the rendered conversation is the engine's prompt
        if self.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        return names


# pydantic marks which member of a union an error belongs to with the member's type in the
# error's location, e.g. ("prompt", "list[int]", 1).
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|(list|dict|tuple|set)\[.*\]|literal\[.*\])$")
_SHAPES = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean",
           "list[str]": "an array of strings", "list[int]": "an array of integers",
           "list[list[int]]": "an array of arrays of integers",
           "list[dict[str,any]]": "an array of content parts"}
# JSON type of a parsed value: (one, several), as error messages name them.
_JSON_TYPES = {type(None): ("null", "null"), bool: ("a boolean", "booleans"),
               int: ("an integer", "integers"), float: ("a number", "numbers"),
               str: ("a string", "strings"), list: ("an array", "arrays"), dict: ("an object", "objects")}


def _loc(error: dict) -> list:
    """An error's location without the leading ``"body"`` that FastAPI adds."""
    loc = list(error.get("loc", ()))
    return loc[1:] if loc and loc[0] == "body" else loc


def describe_validation_error(errors: list[dict]) -> tuple[str, str | None]:
    """A client-facing message and the top-level parameter it names, for the first of
    pydantic's ``errors`` (``ValidationError.errors()``; a leading ``"body"`` in a location,
    as FastAPI adds, is dropped). A value that fits no member of a union type is described
    by the shapes that would fit ("expected a string or an array of strings (got null)")
    rather than by one pydantic message per member. ``param`` is None for the body itself."""
    if not errors:
        return "invalid request", None
    e = errors[0]
    loc = _loc(e)
    kind = e.get("type")
    if kind == "json_invalid":  # its loc is the character position, not a parameter
        detail = (e.get("ctx") or {}).get("error")
        return "the request body is not valid JSON" + (f": {detail}" if detail else ""), None
    if not loc:  # the body as a whole
        if kind == "missing":
            return "the request body is empty; expected a JSON object", None
        return "the request body must be a JSON object, sent with Content-Type: application/json", None
    where = ".".join(str(x) for x in loc)
    param = str(loc[0]) if loc else None
    # A client's own key names appear in these locations: never read them as union tags.
    if kind == "missing":
        return f"missing required parameter: {where}", param
    if kind == "extra_forbidden":
        return f"unrecognized request argument: {where} (this server does not support it)", param
    tag_at = next((i for i, x in enumerate(loc) if isinstance(x, str) and _UNION_TAG.match(x)), None)
    if tag_at is not None:
        path = loc[:tag_at]
        tags = []
        for other in errors:
            o = _loc(other)
            if (other.get("type") not in ("missing", "extra_forbidden") and len(o) > tag_at
                    and o[:tag_at] == path and o[tag_at] not in tags):
                tags.append(o[tag_at])
        where = ".".join(str(x) for x in path)
        shapes = [_SHAPES.get(t, t) for t in tags]
        expected = shapes[0] if len(shapes) == 1 else ", ".join(shapes[:-1]) + " or " + shapes[-1]
        got = _describe_json(e.get("input")) if len(loc) == tag_at + 1 else None
        return (f"invalid value for {where}: expected {expected}" + (f" (got {got})" if got else ""),
                str(path[0]) if path else None)
    msg = str(e.get("msg", "invalid value"))
    msg = msg.removeprefix("Value error, ")
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        msg = f"expected an object (got {_describe_json(e.get('input'))})"
    return f"invalid value for {where}: {msg}", param


def _describe_json(value) -> str:
    """'null', 'an integer', ..., and for an array what its items are ('an array of
    integers and null'), so that a bad item is visible."""
    one = _JSON_TYPES.get(type(value), ("another type",))[0]
    if not isinstance(value, list):
        return one
    if not value:
        return "an empty array"
    items = []
    for v in value:
        k = _JSON_TYPES.get(type(v), ("", "other values"))[1]
        if k not in items:
            items.append(k)
    return "an array of " + (items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1])


def error_body(message: str, param: str | None, code: int = 400,
               type_: str = "invalid_request_error") -> dict:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
