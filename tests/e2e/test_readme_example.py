"""The README's first request, as a new user sends it: "What is the capital of France?"
greedy, answered with Paris in every dtype this CPU computes natively (float32 everywhere;
bfloat16 where it has AVX512-BF16 or AMX), offline and over the server. On an AVX512-BF16
EPYC the bf16 engine once answered "L'Étoile, ..." (logits rounded to bf16 tied the right
first token with a wrong one)."""
from __future__ import annotations

import httpx
import pytest
from server_helpers import _Server

from pagedllm import LLM, SamplingParams
from pagedllm.platform import has_native_bf16

pytestmark = pytest.mark.slow   # the bundled model offline and over the server, in each native dtype

NATIVE_DTYPES = ["float32"] + (["bfloat16"] if has_native_bf16() else [])
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.parametrize("dtype", NATIVE_DTYPES)
def test_readme_chat_example_offline(dtype):
    llm = LLM(dtype=dtype, max_model_len=512, kv_cache_memory="64MiB")
    try:
        out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    finally:
        llm.shutdown()
    assert "Paris" in out[0].outputs[0].text, out[0].outputs[0].text


@pytest.mark.parametrize("dtype", NATIVE_DTYPES)
def test_readme_chat_example_over_the_server(dtype):
    server = _Server(dict(dtype=dtype))
    try:
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
                       json={"messages": QUESTION, "max_tokens": 32, "temperature": 0})
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["message"]["content"]
        assert "Paris" in text, text
    finally:
        server.stop()
