"""Per-request sampling and stopping parameters (names as vLLM's and the OpenAI API's)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedllm.errors import InvalidParameterError, check_unicode, check_unicode_json

_INT = (int,)

# Most completions per request (``n``), and most top logprobs per token (vLLM's
# ``--max-logprobs`` default).
MAX_N = 128
MAX_LOGPROBS = 20
# Temperatures below this are greedy (vLLM's _SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-5
# The largest temperature the sampler can hold (the batch keeps temperatures in float32).
MAX_TEMPERATURE = 1e38


def is_greedy(temperature, top_k):
    """Whether a request samples greedily (argmax, first index on ties): ``temperature``
    < ``GREEDY_TEMPERATURE`` or ``top_k == 1``. The single source of the rule. Numbers give a
    bool; numpy arrays / torch tensors of one shape give one elementwise."""
    return (temperature < GREEDY_TEMPERATURE) | (top_k == 1)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    """A finite int or float (bool, NaN and infinities are rejected)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class StructuredOutputsParams:
    """A constraint on the output (vLLM's ``StructuredOutputsParams``, enforced with
    XGrammar, Dong et al. 2024). Exactly one of: ``json`` (schema, str or dict), ``regex``,
    ``choice`` (non-empty list of non-empty strings), ``grammar`` (XGrammar EBNF, rule
    ``root``), ``json_object`` (True). ``disable_any_whitespace``: JSON kinds only.

    Raises:
        InvalidParameterError("structured_outputs"): no kind or several, or a wrong type
            (whether it parses is the Processor's check).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        def bad(msg):
            return InvalidParameterError("structured_outputs", f"structured_outputs: {msg}")

        kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise bad(f"exactly one of json, regex, choice, grammar, json_object must be set, "
                      f"got {kinds or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise bad(f"json must be a JSON schema string or dict, got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise bad(f"{name} must be a non-empty string, got {v!r}")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise bad(f"choice must be a non-empty list of non-empty strings, got {self.choice!r}")
        for field in ("json", "regex", "choice", "grammar"):   # a schema's strings and keys too
            check_unicode_json("structured_outputs", getattr(self, field), f"structured_outputs.{field}")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise bad(f"json_object must be a boolean, got {self.json_object!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise bad(f"disable_any_whitespace must be a boolean, got {self.disable_any_whitespace!r}")

    @property
    def kind(self) -> str:
        """The kind that is set: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(k for k in ("json", "regex", "choice", "grammar", "json_object")
                    if getattr(self, k) not in (None, False))


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop (names and ranges as vLLM's / OpenAI's).

    Attributes (the non-obvious ones):
        temperature: [0, MAX_TEMPERATURE]; below 1e-5 becomes 0 = greedy (``is_greedy``).
        top_k: 0 or -1 disables. min_p: [0, 1], relative to the top probability.
        seed: same seed, same tokens whatever the batch; sequence i of ``n`` uses seed + i.
        max_tokens: >= 1; None = up to max_model_len.
        min_tokens: EOS/stop ids suppressed and stop strings ignored until reached.
        stop: matched string excluded from the text unless ``include_stop_str_in_output``.
        cache_salt: mixed into prefix-cache hashes (different salts never share blocks).
        best_of: None or n (best_of > n is refused, as vLLM V1).
        presence_penalty / frequency_penalty: [-2, 2], OpenAI's formula.
        repetition_penalty: > 0, CTRL's (Keskar et al. 2019); 1 = off.
        logit_bias: token id -> bias in [-100, 100].
        bad_words: each word's token sequence (with and without a leading space) banned.
        logprobs / prompt_logprobs: top-k raw logprobs per token (0 = the token only).

    Raises:
        ValueError: any field out of range or of the wrong type; the message names it.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    bad_words_token_ids: list[list[int]] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise InvalidParameterError("n", f"n must be an int in [1, {MAX_N}], got {self.n!r}")
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of != self.n):
            raise InvalidParameterError(
                "best_of", f"best_of must be null or equal to n ({self.n}), got {self.best_of!r}: as in "
                           "vLLM V1, best_of > n is not supported")
        if not _is_num(self.temperature) or self.temperature < 0:
            raise InvalidParameterError("temperature", f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature > MAX_TEMPERATURE:
            raise InvalidParameterError("temperature", f"temperature must be at most {MAX_TEMPERATURE:g} (it is "
                                                       f"kept in float32), got {self.temperature!r}")
        if self.temperature < GREEDY_TEMPERATURE:
            # 1/T overflows float32 from T ~ 3e-39 (and bf16 long before): as vLLM, a
            # temperature this small is greedy
            self.temperature = 0.0
        if not _is_num(self.top_p) or not (0 < self.top_p <= 1):
            raise InvalidParameterError("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or (self.top_k < 0 and self.top_k != -1) or self.top_k >= 2**31:
            raise InvalidParameterError("top_k", f"top_k must be an int from 0 to 2**31 - 1 (0 or -1 disables it), got {self.top_k!r}")
        if not _is_num(self.min_p) or not (0 <= self.min_p <= 1):
            raise InvalidParameterError("min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not (-2**63 <= self.seed < 2**63)):
            raise InvalidParameterError("seed", f"seed must be an int in [-2**63, 2**63), got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise InvalidParameterError("max_tokens", f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise InvalidParameterError("min_tokens", f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParameterError("min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise InvalidParameterError("stop", f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        check_unicode_json("stop", stop)     # names the item: stop[1]
        self._stop_list = stop
        ids = self.stop_token_ids or []
        if not isinstance(ids, list) or not all(_is_int(t) and t >= 0 for t in ids):
            raise InvalidParameterError("stop_token_ids", f"stop_token_ids must be a list of token ids (ints >= 0, below the vocabulary size), got {self.stop_token_ids!r}")
        self.stop_token_ids = ids
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise InvalidParameterError("cache_salt", f"cache_salt must be a non-empty string, got {self.cache_salt!r}")
        if self.cache_salt is not None:
            check_unicode("cache_salt", self.cache_salt)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParameterError(name, f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise InvalidParameterError("structured_outputs", f"structured_outputs must be a StructuredOutputsParams, "
                                                              f"got {type(self.structured_outputs).__name__}")
        if self.top_k == -1:
            self.top_k = 0
        self._check_processing()

    def _check_processing(self) -> None:
        """Penalties, biases, token masks, logprobs and truncation (ranges as vLLM's)."""
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not -2 <= v <= 2:
                raise InvalidParameterError(name, f"{name} must be a number in [-2, 2], got {v!r}")
        if not _is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidParameterError("repetition_penalty",
                                        f"repetition_penalty must be a number > 0, got {self.repetition_penalty!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    _is_int(k) and k >= 0 and _is_num(v) for k, v in self.logit_bias.items()):
                raise InvalidParameterError("logit_bias", "logit_bias must map token ids (ints >= 0) to numbers, "
                                                          f"got {self.logit_bias!r}")
            bad = [v for v in self.logit_bias.values() if not -100 <= v <= 100]
            if bad:
                raise InvalidParameterError("logit_bias", f"logit_bias values must be in [-100, 100], got {bad[0]!r}")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids
                or not all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)):
            raise InvalidParameterError("allowed_token_ids", "allowed_token_ids must be a non-empty list of "
                                                             f"token ids (ints >= 0), got {self.allowed_token_ids!r}")
        if self.bad_words is not None and (not isinstance(self.bad_words, list) or not all(
                isinstance(w, str) and w.strip() for w in self.bad_words)):
            raise InvalidParameterError("bad_words", f"bad_words must be a list of non-blank strings, got {self.bad_words!r}")
        check_unicode_json("bad_words", self.bad_words)
        if self.bad_words_token_ids is not None and (not isinstance(self.bad_words_token_ids, list) or not all(
                isinstance(w, list) and w and all(_is_int(t) and t >= 0 for t in w) for w in self.bad_words_token_ids)):
            raise InvalidParameterError("bad_words", "bad_words_token_ids must be a list of non-empty token-id lists")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise InvalidParameterError(name, f"{name} must be null or an int in [0, {MAX_LOGPROBS}], got {v!r}")
        t = self.truncate_prompt_tokens
        if t is not None and (not _is_int(t) or t < 1):
            raise InvalidParameterError("truncate_prompt_tokens",
                                        f"truncate_prompt_tokens must be null or an int >= 1, got {t!r}")

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def greedy(self) -> bool:
        """Whether this request samples greedily (``is_greedy``)."""
        return bool(is_greedy(self.temperature, self.top_k))
