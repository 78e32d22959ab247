"""KV-cache sizing on CUDA (``worker/memory_profile.py``): the budget's arithmetic, and the
profiling step run on the CPU (it must run any model and leave it unbound)."""
from __future__ import annotations

import pytest
import torch
from engine_helpers import model_runner

from pagedllm import SamplingParams
from pagedllm.worker.memory_profile import MemoryProfile, profile_step

GiB = 2 ** 30


def test_budget_is_what_utilization_leaves():
    p = MemoryProfile(total=80 * GiB, weights=16 * GiB, activation_peak=2 * GiB, non_torch=GiB // 2)
    # 80 x 0.9 = 72; 72 - 16 - 2 - 0.5 = 53.5 GiB
    assert p.kv_cache_budget(0.9) == int(53.5 * GiB)
    assert p.kv_cache_budget(0.2) == int(80 * GiB * 0.2) - int(18.5 * GiB) < 0
    line = p.describe(0.9)
    assert "80.00 GiB x 0.9 = 72.00 GiB" in line and "weights 16.00 GiB" in line and "KV cache 53.50 GiB" in line
    assert "KV cache 0.00 GiB" in p.describe(0.2)


@pytest.mark.parametrize("num_tokens", [1, 40, 300])   # 300 > max_model_len 256: two requests
def test_profiling_step_runs_and_leaves_the_model_unbound(make_llm, num_tokens):
    from pagedllm.layers.attention import Attention

    llm = make_llm(max_model_len=256, kv_cache_memory="64MiB")
    runner = model_runner(llm.llm_engine)
    kv_bytes = profile_step(runner, num_tokens)
    per_token = runner.kv_bytes_per_block() / runner.block_size
    assert kv_bytes >= num_tokens * per_token
    assert all(m.kv_cache is None for m in runner.model.modules() if isinstance(m, Attention))
    # the engine's own cache is bound again for the next step (the runner binds it at init;
    # tests rebind it here, as the profiling runs before the KV cache exists in an engine)
    from pagedllm.layers import bind_kv_cache
    bind_kv_cache(runner.model, runner.kv_cache, runner.attn, runner.layer_cache_slot, runner.layer_attn_group)
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_num_tokens_must_be_positive(make_llm):
    runner = model_runner(make_llm(max_model_len=256, kv_cache_memory="64MiB").llm_engine)
    with pytest.raises(ValueError, match="num_tokens"):
        profile_step(runner, 0)
    assert torch.is_tensor(runner.kv_cache)
