"""OpenAI API request bodies (pydantic, strict types) and their mapping to SamplingParams,
with vLLM's extensions (docs/api.md lists the fields).

Unknown fields are refused (400 naming the field); fields a client may send only with
their neutral value (``suffix: ""``, ``modalities: ["text"]``) accept only that value.
``null`` means the default for every optional field; a required field (``prompt``,
``messages``) refuses it.
"""
from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pagedllm.errors import InvalidParameterError
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams


def _none_or(*neutral):
    """Predicate: the value is None or equals one of ``neutral`` (bools never match numbers)."""
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
        """Drop ``null`` for declared optional fields so they take their default; required and
        unknown fields keep it, to be refused by name."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if not (v is None and k in fields and not fields[k].is_required())}


class StreamOptions(_Strict):
    """``include_usage``: a last chunk with the request's usage; ``continuous_usage_stats``
    (vLLM's): usage so far in every chunk."""

    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_obfuscation: bool | None = None  # accepted and ignored (no obfuscation padding)


class StructuredOutputsField(_Strict):
    """vLLM's ``structured_outputs`` extra: exactly one of ``json`` (a JSON schema),
    ``regex``, ``choice``, ``grammar`` (EBNF) or ``json_object``."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class JsonSchemaFormat(_Strict):
    # OpenAI's rule for the name: required, a-z A-Z 0-9 _ -, at most 64 characters
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Strict):
    # Declared fields that are only accepted with a neutral value: name -> predicate.
    _NEUTRAL: ClassVar[dict[str, Any]] = {}
    _WHY: ClassVar[dict[str, str]] = {}

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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None   # token id (as a string, OpenAI's) -> bias
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsField | None = None
    # accepted: logged (``user``) or without effect on the output
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    def check_supported(self) -> None:
        """Raises InvalidParameterError naming a field set to a value we would ignore."""
        if self.stream_options is not None and not self.stream:
            # as OpenAI and vLLM: options of a stream on a request that does not stream
            raise InvalidParameterError("stream_options", "stream_options is only allowed when stream is true")
        for name, ok in self._NEUTRAL.items():
            if not ok(getattr(self, name)):
                why = self._WHY.get(name)
                raise InvalidParameterError(
                    name, f"{name} is not supported{f' ({why})' if why else ''}")

    def requested_max_tokens(self) -> int | None:
        """The output-token limit the client asked for (None: not set)."""
        return self.max_tokens

    def api_param_names(self) -> dict[str, str]:
        """Engine parameter name -> this request's field that carried it, where they differ."""
        return {}

    def to_api_error(self, e: InvalidParameterError) -> InvalidParameterError:
        """``e`` with its parameter (and the name in its message) as this request spells it."""
        name = self.api_param_names().get(e.param)
        if name is None:
            return e
        return InvalidParameterError(name, str(e).replace(e.param, name))

    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: top logprobs per generated token (None: none)."""
        return None

    def constraint(self) -> StructuredOutputsParams | None:
        """The structured-output constraint this request asks for (None: none)."""
        so = self.structured_outputs
        if so is None:
            return None
        return StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                       json_object=so.json_object, disable_any_whitespace=so.disable_any_whitespace)

    def to_sampling_params(self, default_max_tokens: int | None,
                           constraint: StructuredOutputsParams | None = None) -> SamplingParams:
        """Raises InvalidParameterError naming the engine's parameter (see ``to_api_error``).

        Args:
            constraint: overrides the request's own (tool_choice's schema)."""
        self.check_supported()
        max_tokens = self.requested_max_tokens()
        bias = None
        if self.logit_bias is not None:
            # ASCII digits only: int() would also take " 1", "1_0" or other scripts' digits
            bad = [k for k in self.logit_bias if re.fullmatch(r"-?[0-9]+", k) is None]
            if bad:
                raise InvalidParameterError("logit_bias", f"logit_bias keys must be token ids (integers written as "
                                                          f"strings), got {bad[0]!r}")
            bias = {}
            for k, v in self.logit_bias.items():
                tok = int(k)
                if tok in bias:   # "1" and "01" (or "-0" and "0"): one token, two biases
                    raise InvalidParameterError("logit_bias", f"logit_bias gives token {tok} twice "
                                                              f"(keys {k!r} and another spelling of it)")
                bias[tok] = v
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
            best_of=getattr(self, "best_of", None),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            logprobs=self.num_logprobs(),
            prompt_logprobs=self.prompt_logprobs,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            structured_outputs=constraint if constraint is not None else self.constraint(),
        )


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. ``max_tokens`` defaults to 16 (OpenAI's default).

    ``logprobs``: top logprobs per token (0-20; 0 = the sampled token's only); ``echo``:
    the prompt is prepended to the text (and to the logprobs, when asked for);
    ``best_of``: null or ``n`` (vLLM V1 has no best_of > n)."""

    _NEUTRAL: ClassVar[dict[str, Any]] = {"suffix": _none_or("")}
    _WHY: ClassVar[dict[str, str]] = {"suffix": "only empty"}

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: Any = None
    best_of: int | None = None

    def num_logprobs(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    """One message of ``messages``: a role string and text content (a string, content parts,
    or null); the rules are ``normalize_chat_messages``'s, shared with offline use."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. ``max_tokens`` (or ``max_completion_tokens``) defaults
    to what is left of max_model_len; ``chat_template`` only under
    ``--trust-request-chat-template``; tool fields are checked by ``tool_calls.request``."""

    _NEUTRAL: ClassVar[dict[str, Any]] = {
        "modalities": lambda v: v is None or v == ["text"],
    }
    _WHY: ClassVar[dict[str, str]] = {"modalities": 'only ["text"]'}
    # a tool's argument schema as this API spells it, in errors (a forced call's grammar)
    TOOL_SCHEMA: ClassVar[str] = "tools[].function.parameters"

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's current name of max_tokens; wins over it
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (vLLM's field)
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: Any = None
    functions: Any = None
    tool_choice: Any = None
    function_call: Any = None
    modalities: Any = None
    parallel_tool_calls: Any = None

    def requested_max_tokens(self) -> int | None:
        # OpenAI's current name wins over the deprecated max_tokens, as in vLLM
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens

    def api_param_names(self) -> dict[str, str]:
        names = {"prompt": "messages"}   # the rendered conversation is the engine's prompt
        if self.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        if self.logprobs:
            names["logprobs"] = "top_logprobs"
        if self.structured_outputs is None and self.response_format is not None:
            names["structured_outputs"] = "response_format"
        return names

    def num_logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise InvalidParameterError("top_logprobs", "top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def constraint(self) -> StructuredOutputsParams | None:
        rf = self.response_format
        if rf is not None and rf.type != "text" and self.structured_outputs is not None:
            raise InvalidParameterError("response_format", "response_format and structured_outputs "
                                                           "cannot both constrain the output")
        if rf is None or rf.type == "text":
            return super().constraint()
        if rf.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise InvalidParameterError("response_format", "response_format of type json_schema needs "
                                                           "json_schema.schema")
        return StructuredOutputsParams(json=rf.json_schema.schema_)


# pydantic marks which member of a union an error belongs to with the member's type in the
# error's location, e.g. ("prompt", "list[int]", 1).
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|(list|dict|tuple|set)\[.*\]|literal\[.*\])$")
_SHAPES = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean",
           "list[str]": "an array of strings", "list[int]": "an array of integers",
           "list[list[int]]": "an array of arrays of integers",
           "list[dict[str,any]]": "an array of content parts", "list[any]": "an array"}
# JSON type of a parsed value: (one, several), as error messages name them.
_JSON_TYPES = {type(None): ("null", "null"), bool: ("a boolean", "booleans"),
               int: ("an integer", "integers"), float: ("a number", "numbers"),
               str: ("a string", "strings"), list: ("an array", "arrays"), dict: ("an object", "objects")}


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (vLLM's): ``prompt`` (text), or ``messages`` rendered as a chat
    request with the same fields would render them. ``add_special_tokens`` applies to
    ``prompt`` only; ``chat_template`` only under ``--trust-request-chat-template``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Any = None


class DetokenizeRequest(_Strict):
    """``POST /detokenize`` (vLLM's): token ids back to text."""

    model: str | None = None
    tokens: list[int]


def _loc(error: dict) -> list:
    """An error's location without the leading ``"body"`` that FastAPI adds."""
    loc = list(error.get("loc", ()))
    return loc[1:] if loc and loc[0] == "body" else loc


def describe_validation_error(errors: list[dict]) -> tuple[str, str | None]:
    """(client-facing message, top-level parameter or None for the body) for the first of
    pydantic's ``errors``; a value that fits no member of a union is described by the shapes
    that would fit ("expected a string or an array of strings (got null)")."""
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
    """'null', 'an integer', ..., and for an array its item kinds ('an array of integers and
    null')."""
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

