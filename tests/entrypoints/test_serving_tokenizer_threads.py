"""The serving code never calls the engine's own tokenizer, which the engine's output
thread (``pagedllm-engine``) uses to detokenize: a HF fast tokenizer must not be used by
two threads at once (engine/async_llm.py). Prompt text, the echoed prompt's tokens and
the tokenizer routes go through AsyncLLM's tokenizer threads, each with its own copy.

The engine's tokenizer is wrapped so that a call from any other thread is recorded, then
completions (echo, logprobs, a prompt of token ids; whole and streamed), chat with
logprobs and the tokenizer routes are served."""
from __future__ import annotations

import copy
import json
import threading

import httpx
import pytest
from server_helpers import _Server


class _OwnedTokenizer:
    """A tokenizer whose method calls from a thread other than ``OWNER`` are recorded in
    ``off_thread`` as (method, thread name); ``on_thread`` counts the owner's. Reading a
    plain attribute (``chat_template``, a string) is not a call. A deep copy
    (``LLMEngine.tokenizer_copy``, for a tokenizer thread) is a copy of the tokenizer
    itself."""

    OWNER = "pagedllm-engine"

    def __init__(self, inner):
        self._inner = inner
        self.off_thread: list[tuple[str, str]] = []
        self.on_thread = 0

    def __getattr__(self, name):
        value = getattr(self._inner, name)
        if not callable(value):
            return value

        def call(*args, **kwargs):
            thread = threading.current_thread().name
            if thread == self.OWNER:
                self.on_thread += 1
            else:
                self.off_thread.append((name, thread))
            return value(*args, **kwargs)
        return call

    def __deepcopy__(self, memo):
        return copy.deepcopy(self._inner, memo)


@pytest.fixture(scope="module")
def server(tiny_dir):  # noqa: F811 (fixture)
    s = _Server(engine_kw=dict(model=tiny_dir, max_model_len=256))
    eng = s.engine.engine
    # the engine's tokenizer, as the engine and its output processor (the output thread) hold it
    s.owned = eng.tokenizer = eng.output_processor.tokenizer = _OwnedTokenizer(eng.tokenizer)
    yield s
    s.stop()


def _sse(resp: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in resp.text.splitlines()
            if line.startswith("data: {")]


def test_serving_never_calls_the_engines_tokenizer_off_its_thread(server):
    u = server.url
    ids = [504, 3120, 314, 4649, 30, 7815]
    prompt_text = httpx.post(f"{u}/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"]
    first_token = httpx.post(f"{u}/detokenize", json={"tokens": ids[:1]}, timeout=60).json()["prompt"]
    body = {"prompt": ids, "echo": True, "logprobs": 2, "max_tokens": 3, "temperature": 0}

    whole = httpx.post(f"{u}/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert whole["text"].startswith(prompt_text)
    assert whole["logprobs"]["tokens"][0] == first_token and whole["logprobs"]["token_logprobs"][0] is None
    assert len(whole["logprobs"]["tokens"]) == len(ids) + 3

    streamed = _sse(httpx.post(f"{u}/v1/completions", json={**body, "stream": True}, timeout=60))
    assert "".join(c["choices"][0]["text"] for c in streamed) == whole["text"]
    assert streamed[0]["choices"][0]["logprobs"]["tokens"][0] == first_token

    text = httpx.post(f"{u}/v1/completions", json={**body, "prompt": "The capital of France is"},
                      timeout=60).json()["choices"][0]
    assert text["text"].startswith("The capital of France is") and text["logprobs"]["token_logprobs"][0] is None

    chat = {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 3, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    r = httpx.post(f"{u}/v1/chat/completions", json=chat, timeout=60).json()
    assert len(r["choices"][0]["logprobs"]["content"]) == 3
    streamed = _sse(httpx.post(f"{u}/v1/chat/completions", json={**chat, "stream": True}, timeout=60))
    assert sum(len((c["choices"][0].get("logprobs") or {}).get("content") or []) for c in streamed) == 3

    assert httpx.post(f"{u}/tokenize", json={"prompt": "Hello"}, timeout=60).json()["count"] > 0
    assert httpx.post(f"{u}/tokenize", json={"messages": chat["messages"]}, timeout=60).json()["count"] > 3

    assert server.owned.off_thread == []
    assert server.owned.on_thread > 0   # the wrapper is the tokenizer the engine thread uses
