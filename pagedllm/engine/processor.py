"""Validate and tokenize a prompt into an EngineCoreRequest: the one owner of request
validation (what it accepts, the core can always serve)."""
from __future__ import annotations

import dataclasses
import time

from pagedllm.errors import InvalidParameterError, check_unicode
from pagedllm.messages import EngineCoreRequest
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output import validate_structured_outputs


class Processor:
    """Request validator; without chunked prefill a prompt must fit
    ``max_num_batched_tokens``."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, eos_token_ids: set[int],
                 max_num_batched_tokens: int, enable_chunked_prefill: bool):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = sorted(eos_token_ids)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill

    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        """``prompt``: a string, a list of token ids, or {"prompt": str} / {"prompt_token_ids": [...]}.

        Raises:
            ValueError: empty prompt, ids not ints or outside the vocabulary, wrong type.
        """
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidParameterError("prompt", "prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidParameterError("prompt", "prompt must not be empty")
            check_unicode("prompt", prompt)
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise InvalidParameterError("prompt", "prompt must not be empty")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise InvalidParameterError("prompt", "prompt token ids must be ints")
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidParameterError("prompt", f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
            return None, list(prompt)
        raise InvalidParameterError("prompt", f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Token sequences of each bad word, tokenized as vLLM's (with and without a
        leading space)."""
        out: list[list[int]] = []
        for w in words:
            bare = self.tokenizer.encode(w.lstrip(), add_special_tokens=False)
            if bare:
                out.append(bare)
            spaced = self.tokenizer.encode(" " + w.lstrip(), add_special_tokens=False)
            if spaced and (not bare or (spaced[0] != bare[0] and len(spaced) == len(bare))):
                out.append(spaced)
        return out

    def process(self, request_id: str, prompt, params: SamplingParams | None,
                arrival_time: float | None = None) -> tuple[EngineCoreRequest, str | None]:
        """Build an EngineCoreRequest; returns it and the prompt text (None for ids).

        Raises:
            InvalidParameterError (a ValueError), naming the parameter: bad prompt, prompt
                + max_tokens over max_model_len, prompt over the step budget without
                chunked prefill, min_tokens over the room left, stop ids outside the
                vocabulary, ``params`` not a SamplingParams, a structured output that
                does not parse.
        """
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidParameterError("sampling_params", f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if params.truncate_prompt_tokens is not None and params.truncate_prompt_tokens > self.max_model_len:
            raise InvalidParameterError(  # as vLLM; a huge value also has no msgspec int form
                "truncate_prompt_tokens", f"truncate_prompt_tokens ({params.truncate_prompt_tokens}) is greater "
                                          f"than max_model_len ({self.max_model_len})")
        text, ids = self.tokenize(prompt)
        if params.truncate_prompt_tokens is not None and len(ids) > params.truncate_prompt_tokens:
            ids = ids[-params.truncate_prompt_tokens:]
            text = None   # the prompt the model sees is no longer the text given
        if len(ids) >= self.max_model_len:
            raise InvalidParameterError(
                "prompt", f"prompt ({len(ids)} tokens) leaves no room to generate within "
                f"max_model_len ({self.max_model_len})")
        if not self.enable_chunked_prefill and len(ids) > self.max_num_batched_tokens:
            raise InvalidParameterError(
                "prompt", f"prompt ({len(ids)} tokens) exceeds max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) and chunked prefill is off")
        if params.max_tokens is None:
            room = self.max_model_len - len(ids)
            if params.min_tokens > room:  # the bound is what the prompt leaves, not a max_tokens the caller never set
                raise InvalidParameterError(
                    "min_tokens", f"min_tokens ({params.min_tokens}) exceeds the {room} tokens that "
                    f"max_model_len ({self.max_model_len}) leaves after the prompt ({len(ids)} tokens)")
            params = dataclasses.replace(params, max_tokens=room)
        elif len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidParameterError(
                "max_tokens", f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len}); lower max_tokens")
        for t in params.stop_token_ids:
            if t >= self.vocab_size:
                raise InvalidParameterError("stop_token_ids", f"stop_token_ids contains {t}, outside the "
                                                              f"vocabulary [0, {self.vocab_size})")
        for name, toks in (("logit_bias", params.logit_bias or {}), ("allowed_token_ids", params.allowed_token_ids or [])):
            bad = [t for t in toks if t >= self.vocab_size]
            if bad:
                raise InvalidParameterError(name, f"{name} contains token id {bad[0]}, outside the vocabulary "
                                                  f"[0, {self.vocab_size})")
        if params.bad_words and params.bad_words_token_ids is None:
            params = dataclasses.replace(params, bad_words_token_ids=self.bad_words_token_ids(params.bad_words))
        if params.structured_outputs is not None:
            validate_structured_outputs(params.structured_outputs)
        return EngineCoreRequest(request_id, ids, params, self.eos_token_ids,
                                 time.time() if arrival_time is None else arrival_time), text
