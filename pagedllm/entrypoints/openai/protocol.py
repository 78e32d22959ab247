"""OpenAI API request bodies (pydantic, strict types) and their mapping to SamplingParams.

Extensions as in vLLM: top_k, min_p, min_tokens, ignore_eos, stop_token_ids,
include_stop_str_in_output, skip_special_tokens, cache_salt.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.errors import InvalidParameterError
from pagedllm.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

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
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: Any = None
    cache_salt: str | None = None
    user: str | None = None

    def to_sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        """Raises InvalidParameterError naming the field."""
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if v not in (None, 0, 0.0):
                raise InvalidParameterError(name, f"{name} is not supported (only 0)")
        if self.logprobs not in (None, False):
            raise InvalidParameterError("logprobs", "logprobs are not supported yet")
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            max_tokens=default_max_tokens if self.max_tokens is None else self.max_tokens,
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

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. ``max_tokens`` (or ``max_completion_tokens``) defaults
    to what is left of max_model_len."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None


def error_body(message: str, param: str | None, code: int = 400,
               type_: str = "invalid_request_error") -> dict:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
