"""Data parallelism: two engine replicas behind one client give the same greedy tokens as
one engine, share the requests, keep a prompt prefix on the engine that holds it while
the loads allow, sum their statistics; a dead replica fails the client."""
from __future__ import annotations

import os
import signal
import time

import pytest

from engine_helpers import random_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.engine.core_client import DPClient
from pagedllm.errors import EngineDeadError
from pagedllm.messages import SchedulerStats

VOCAB = 512
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
             bos_token_id=1, eos_token_id=2, rope_theta=10000.0)


def _router(n: int, block_size: int = 4) -> DPClient:
    """A DPClient's routing state without engines."""
    from collections import OrderedDict

    c = object.__new__(DPClient)
    c.engines = [None] * n
    c._block_size = block_size
    c._stats = [SchedulerStats() for _ in range(n)]
    c._sent = [0] * n
    c._prefix_owner = OrderedDict()
    c._dead = {}
    c._affinity = True
    return c


def test_routing_takes_the_least_loaded_engine_unless_the_prefix_holder_is_close():
    c = _router(2)
    c._stats = [SchedulerStats(num_running=3), SchedulerStats(num_running=1)]
    a, b = list(range(20)), list(range(100, 120))
    assert c.engine_for(a) == 1                          # least loaded: 1 < 3
    c._sent[1] += 1                                      # loads 3 and 4 * 1 + 1 = 5
    assert c.engine_for(b) == 0                          # a new prefix: the least loaded
    c._sent[0] += 1                                      # loads 4 + 3 = 7 and 5
    assert c.engine_for(b[:16] + [7, 7]) == 0            # b's first 16 tokens: its engine, 7 <= 5 + 64
    c._stats[0] = SchedulerStats(num_waiting=30)         # loads 4 * 31 = 124 and 5: beyond 5 + 64
    assert c.engine_for(b) == 1
    assert c.engine_for(b) == 1                          # and the prefix now lives there
    s = c._sum_stats(SchedulerStats())
    assert (s.num_running, s.num_waiting, s.engines) == (1, 30, [(0, 30, 0.0, True), (1, 0, 0.0, True)])
    c._dead[1] = "killed"                                # a dead engine gets nothing more
    assert c.engine_for(a) == 0 and c._sum_stats(SchedulerStats()).engines[1][3] is False


@pytest.mark.slow
def test_two_replicas_equal_one_and_share_the_load(tiny_model_dir):
    path = tiny_model_dir("llama", std=0.2, **SMALL)
    prompts = random_prompts(8, 5, VOCAB, min_len=4, max_len=40)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    kw = dict(model=path, dtype="float32", kv_cache_memory="16MiB", num_threads=1)
    one = LLM(**kw)
    try:
        ref = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    finally:
        one.shutdown()
    llm = LLM(data_parallel_size=2, **kw)
    client = llm.llm_engine.engine_core
    try:
        assert isinstance(client, DPClient) and len(client.engines) == 2
        out = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == ref
        per_engine = [e.get_scheduler_stats().prefix_cache_queries for e in client.engines]
        assert all(q > 0 for q in per_engine), per_engine      # both engines computed prompts
        stats = llm.stats()
        assert stats.prefix_cache_queries == sum(per_engine) and len(stats.engines) == 2
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_served_replicas_keep_prefixes_and_outlive_one_dead_engine(tiny_model_dir):
    import json
    import threading

    import httpx

    from server_helpers import _Server

    path = tiny_model_dir("llama", std=0.2, **SMALL)
    srv = _Server(engine_kw=dict(model=path, data_parallel_size=2, engine_process=True, kv_cache_memory="16MiB",
                                 max_model_len=512))
    client = srv.engine.engine.engine_core
    url = f"{srv.url}/v1/completions"
    try:
        # the same 80-token prefix twice: the second lands where the first was cached
        prefix = [(7 * i) % 500 + 3 for i in range(80)]
        body = dict(model=srv.engine.model_name, max_tokens=2, temperature=0)
        first = httpx.post(url, json={**body, "prompt": prefix + [5]}, timeout=60).json()
        second = httpx.post(url, json={**body, "prompt": prefix + [9, 9]}, timeout=60).json()
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
        # four long streams over both engines (as the load score places them); engine 1 killed while they run
        results: list = [None] * 4

        def stream(k: int) -> None:
            req = {**body, "prompt": [11 + k, 12, 13, 14], "max_tokens": 300, "ignore_eos": True, "stream": True}
            events = []
            with httpx.stream("POST", url, json=req, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
            results[k] = events

        threads = [threading.Thread(target=stream, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while sum(s.num_running for s in (e.get_scheduler_stats() for e in client.engines)) < 4:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        on_engine_1 = client.engines[1].get_scheduler_stats().num_running
        assert 1 <= on_engine_1 <= 3
        os.kill(client.engines[1].pid, signal.SIGKILL)
        t0 = time.monotonic()
        for t in threads:
            t.join(60)
        errored = [ev for ev in results if "error" in ev[-1]]
        finished = [ev for ev in results if ev[-1].get("choices", [{}])[0].get("finish_reason") == "length"]
        assert (len(errored), len(finished)) == (on_engine_1, 4 - on_engine_1), [ev[-1] for ev in results]
        assert time.monotonic() - t0 < 60
        health = httpx.get(f"{srv.url}/health", timeout=10)
        assert health.status_code == 200
        engines = health.json()["engines"]
        assert [e["alive"] for e in engines] == [True, False] and "died" in engines[1]["error"]
        after = httpx.post(url, json={**body, "prompt": [3, 4, 5]}, timeout=60)
        assert after.status_code == 200
        metrics = httpx.get(f"{srv.url}/metrics", timeout=10).text
        assert 'pagedllm:engine_alive{engine="1"' in metrics and any(
            line.startswith('pagedllm:engine_alive{engine="1"') and line.endswith(" 0.0") for line in metrics.splitlines())
        os.kill(client.engines[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(f"{srv.url}/health", timeout=10).status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        srv.stop()


def test_data_parallel_needs_the_engine_process(tiny_model_dir):
    with pytest.raises(ValueError, match="data_parallel_size > 1 runs each engine in its own process"):
        LLM(model=tiny_model_dir("llama", std=0.2, **SMALL), data_parallel_size=2, engine_process=False)
