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
    return c


def test_routing_takes_the_least_loaded_engine_unless_the_prefix_holder_is_close():
    c = _router(2)
    c._stats = [SchedulerStats(num_running=3), SchedulerStats(num_running=1)]
    a, b = list(range(20)), list(range(100, 120))
    assert c.engine_for(a) == 1                          # least loaded: 1 < 3
    c._sent[1] += 1                                      # loads 3 and 4 * 1 + 1 = 5
    assert c.engine_for(b) == 0                          # a new prefix: the least loaded
    c._sent[0] += 1                                      # loads 4 + 3 = 7 and 5
    assert c.engine_for(b[:16] + [7, 7]) == 0            # b's first 16 tokens: its engine, 7 <= 5 + 4
    c._stats[0] = SchedulerStats(num_waiting=3)          # loads 4 * 4 = 16 and 5: beyond the slack
    assert c.engine_for(b) == 1
    assert c.engine_for(b) == 1                          # and the prefix now lives there
    s = c._sum_stats(SchedulerStats())
    assert (s.num_running, s.num_waiting, s.engines) == (1, 3, [(0, 3, 0.0), (1, 0, 0.0)])


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
        stats = llm.get_scheduler_stats() if hasattr(llm, "get_scheduler_stats") else client.get_scheduler_stats()
        assert stats.prefix_cache_queries == sum(per_engine) and len(stats.engines) == 2
        # one engine's death fails the client
        os.kill(client.engines[1].pid, signal.SIGKILL)
        t = time.monotonic()
        with pytest.raises(EngineDeadError):
            for _ in range(50):
                llm.generate(prompts[:2], params, use_tqdm=False)
                time.sleep(0.1)
        assert time.monotonic() - t < 10
    finally:
        llm.shutdown()


def test_data_parallel_needs_the_engine_process(tiny_model_dir):
    with pytest.raises(ValueError, match="data_parallel_size > 1 runs each engine in its own process"):
        LLM(model=tiny_model_dir("llama", std=0.2, **SMALL), data_parallel_size=2, engine_process=False)
