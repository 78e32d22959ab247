"""SamplingParams validation: every bad value raises a ValueError that names the field."""
from __future__ import annotations

import math

import pytest

from pagedllm.sampling_params import SamplingParams

BAD = [
    # (field, value)
    ("max_tokens", -1),
    ("max_tokens", 0),
    ("max_tokens", 1.5),
    ("max_tokens", "16"),
    ("max_tokens", True),
    ("temperature", -0.1),
    ("temperature", -1),
    ("temperature", "0.7"),
    ("temperature", None),
    ("temperature", math.nan),
    ("top_p", 0),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", -0.5),
    ("top_p", "0.9"),
    ("top_p", math.nan),
    ("top_k", -2),
    ("top_k", 1.0),
    ("top_k", "5"),
    ("min_p", -0.1),
    ("min_p", 1.5),
    ("min_p", "0.1"),
    ("min_p", math.nan),
    ("seed", 1.0),
    ("seed", "42"),
    ("min_tokens", -1),
    ("min_tokens", 2.0),
    ("n", 0),
    ("n", 129),
    ("n", "1"),
    ("best_of", 3),
    ("presence_penalty", 2.5),
    ("presence_penalty", "1"),
    ("frequency_penalty", -2.1),
    ("repetition_penalty", 0),
    ("repetition_penalty", math.inf),
    ("logit_bias", {5: 101}),
    ("logit_bias", {"5": 1.0}),
    ("logit_bias", [1]),
    ("allowed_token_ids", []),
    ("allowed_token_ids", [-1]),
    ("bad_words", ["  "]),
    ("bad_words", "word"),
    ("logprobs", 21),
    ("logprobs", -1),
    ("logprobs", True),
    ("prompt_logprobs", 1.0),
    ("truncate_prompt_tokens", 0),
    ("stop", ""),
    ("stop", 5),
    ("stop", ["ok", ""]),
    ("stop", ["ok", 3]),
    ("stop", ("a", "b")),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1.0]),
    ("stop_token_ids", 5),
    ("stop_token_ids", ["2"]),
    ("ignore_eos", "yes"),
    ("ignore_eos", 1),
    ("include_stop_str_in_output", None),
    ("skip_special_tokens", 0),
    ("cache_salt", ""),
    ("cache_salt", 123),
]


@pytest.mark.parametrize("field,value", BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_bad_value_raises_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field) as ei:
        SamplingParams(**{field: value})
    # The server maps the error to its parameter: when the error carries one, it is right.
    assert getattr(ei.value, "param", field) == field


def test_min_tokens_over_max_tokens():
    with pytest.raises(ValueError, match="min_tokens") as ei:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert getattr(ei.value, "param", "min_tokens") == "min_tokens"
    SamplingParams(max_tokens=4, min_tokens=4)
    SamplingParams(max_tokens=None, min_tokens=100)


def test_defaults_and_normalisation():
    sp = SamplingParams()
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (sp.max_tokens, sp.min_tokens, sp.seed) == (16, 0, None)
    assert sp.stop_strings == [] and sp.stop_token_ids == []
    assert not sp.ignore_eos and sp.skip_special_tokens and not sp.greedy
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="###").stop_strings == ["###"]
    assert SamplingParams(stop=["a", "bc"]).stop_strings == ["a", "bc"]
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.0, top_p=1, min_p=1, top_k=1).top_p == 1


@pytest.mark.parametrize("temperature,top_k,greedy", [
    (0, 0, True), (5e-6, 0, True), (1e-5, 0, False), (0.7, 0, False), (0.7, 1, True), (0.7, 2, False),
    (0, 50, True)])
def test_greedy_is_one_rule(temperature, top_k, greedy):
    """``SamplingParams.greedy`` and ``is_greedy`` over the runner's float32 / int64 rows
    and the samplers' tensors agree: temperature below 1e-5 (the README's rule) or top_k 1."""
    import numpy as np
    import torch

    from pagedllm.sampling_params import is_greedy

    assert SamplingParams(temperature=temperature, top_k=top_k).greedy is greedy
    sp = SamplingParams(temperature=temperature, top_k=top_k)
    rows = np.array([sp.temperature], dtype=np.float32), np.array([sp.top_k], dtype=np.int64)
    assert is_greedy(*rows).tolist() == [greedy]
    assert is_greedy(*(torch.from_numpy(a) for a in rows)).tolist() == [greedy]


@pytest.mark.parametrize("kw", [
    dict(temperature=0), dict(temperature=2), dict(top_p=1e-9), dict(top_p=1), dict(min_p=0),
    dict(min_p=1), dict(top_k=0), dict(top_k=50), dict(seed=0), dict(seed=-5), dict(max_tokens=1),
    dict(max_tokens=None), dict(stop_token_ids=[0, 2]), dict(cache_salt="s"), dict(ignore_eos=True),
])
def test_boundary_values_are_accepted(kw):
    SamplingParams(**kw)


@pytest.mark.parametrize("kw, message", [
    (dict(top_k=2**31), "top_k must be an int from 0 to 2**31 - 1 (0 or -1 disables it), got 2147483648"),
    (dict(top_k=-2), "top_k must be an int from 0 to 2**31 - 1 (0 or -1 disables it), got -2"),
    (dict(seed=2**63), "seed must be an int in [-2**63, 2**63), got 9223372036854775808"),
    (dict(seed=-2**63 - 1), "seed must be an int in [-2**63, 2**63), got -9223372036854775809"),
    (dict(temperature=math.inf), "temperature must be a finite number >= 0, got inf"),
    (dict(temperature=1e300), "temperature must be at most 1e+38 (it is kept in float32), got 1e+300"),
    (dict(max_tokens=0), "max_tokens must be an int >= 1, got 0"),
    (dict(min_tokens=-1), "min_tokens must be an int >= 0, got -1"),
    (dict(max_tokens=4, min_tokens=5), "min_tokens (5) must not exceed max_tokens (4)"),
    (dict(stop_token_ids=[-1]),
     "stop_token_ids must be a list of token ids (ints >= 0, below the vocabulary size), got [-1]"),
])
def test_out_of_range_messages_state_the_real_bound(kw, message):
    """A refused number is refused with the limit that refused it (top_k >= 2**31 was
    refused as if it had to be >= 0)."""
    with pytest.raises(ValueError) as ei:
        SamplingParams(**kw)
    assert str(ei.value) == message
    SamplingParams(top_k=2**31 - 1), SamplingParams(seed=2**63 - 1), SamplingParams(seed=-2**63)


class _Tok:
    def encode(self, text):
        return [ord(c) % 100 for c in text]


@pytest.mark.parametrize("kw, param, message", [
    (dict(stop_token_ids=[100]), "stop_token_ids", "stop_token_ids contains 100, outside the vocabulary [0, 100)"),
    (dict(stop_token_ids=[2**70]), "stop_token_ids",
     f"stop_token_ids contains {2**70}, outside the vocabulary [0, 100)"),
    (dict(max_tokens=28), "max_tokens",
     "prompt (5 tokens) + max_tokens (28) exceeds max_model_len (32); lower max_tokens"),
    # max_tokens not set: the limit is what the prompt leaves, not a max_tokens never sent
    (dict(max_tokens=None, min_tokens=28), "min_tokens",
     "min_tokens (28) exceeds the 27 tokens that max_model_len (32) leaves after the prompt (5 tokens)"),
])
def test_engine_bounds_are_stated(kw, param, message):
    from pagedllm.engine.processor import Processor

    p = Processor(_Tok(), vocab_size=100, max_model_len=32, eos_token_ids={2},
                  max_num_batched_tokens=16, enable_chunked_prefill=True)
    with pytest.raises(ValueError) as ei:
        p.process("x", "hello", SamplingParams(**kw))
    assert (ei.value.param, str(ei.value)) == (param, message)
    assert p.process("x", "hello", SamplingParams(max_tokens=None, min_tokens=27))[0].sampling_params.max_tokens == 27
