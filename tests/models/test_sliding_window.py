"""Sliding windows of Llama-family configs, as transformers applies them: Mistral (and
Mixtral) attend over ``sliding_window`` tokens in every layer, Qwen2 only with
``use_sliding_window`` from ``max_window_layers`` on; Llama ignores the key.

A small random-weight Mistral with a 16-token window against transformers (greedy
continuations of prompts several windows long) and its greedy outputs unchanged by
batching, chunking, prefix caching and preemption, with every block free afterwards.
"""
from __future__ import annotations

import json

import pytest
import torch

from engine_helpers import assert_greedy_invariant, engine_leaks, greedy, random_prompts
from model_helpers import load_hf
from pagedllm.models.arch_config import config_from_hf_dir

WINDOW = 16
VOCAB = 49152   # the bundled tokenizer's, so the directory can carry it


@pytest.fixture(scope="module")
def tiny_mistral(tiny_model_dir):
    # larger-than-init weights (all of them), so logits are far from uniform
    path = tiny_model_dir("mistral", std=0.2, std_1d=0.1,
                          vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          max_position_embeddings=1024, sliding_window=WINDOW, rms_norm_eps=1e-6,
                          bos_token_id=1, eos_token_id=2)
    return path, load_hf(path)


def _prompts(n, seed=1):
    return random_prompts(n, seed, VOCAB)


def _llm(path, **kw):
    from pagedllm import LLM

    base = dict(model=path, dtype="float32", device="cpu", seed=0, engine_process=False,
                max_model_len=256, block_size=4, kv_cache_memory="32MiB")
    return LLM(**{**base, **kw})


def test_mistral_window_read_and_equals_transformers(tiny_mistral):
    path, ref = tiny_mistral
    assert config_from_hf_dir(path).layer_windows() == [WINDOW] * 3
    llm = _llm(path)
    try:
        prompts = _prompts(3)
        outs = llm.generate(prompts, greedy(24), use_tqdm=False)
        for p, o in zip(prompts, outs):
            ids = torch.tensor([p["prompt_token_ids"]])
            with torch.no_grad():
                want = ref.generate(ids, max_new_tokens=24, do_sample=False, min_new_tokens=24)[0, ids.shape[1]:]
            assert list(o.outputs[0].token_ids) == want.tolist()
        # the window matters here: the same weights without it continue differently
        with torch.no_grad():
            ids = torch.tensor([max((p["prompt_token_ids"] for p in prompts), key=len)])
            ref.config.sliding_window = None
            try:
                full = ref.generate(ids, max_new_tokens=24, do_sample=False, min_new_tokens=24)[0, ids.shape[1]:]
            finally:
                ref.config.sliding_window = WINDOW
        longest = max(zip(prompts, outs), key=lambda po: len(po[0]["prompt_token_ids"]))[1]
        assert list(longest.outputs[0].token_ids) != full.tolist()
        assert engine_leaks(llm) == []
    finally:
        llm.shutdown()


def test_mistral_window_invariant_to_batching_chunking_caching_and_preemption(tiny_mistral):
    path, _ = tiny_mistral
    prompts = _prompts(8)
    shared = list(range(100, 140))              # a 40-token shared prefix: past the window
    prompts += [{"prompt_token_ids": shared + p["prompt_token_ids"][:8]} for p in _prompts(3, seed=2)]
    assert_greedy_invariant(lambda **kw: _llm(path, **kw), prompts, greedy(16), {
        "batched": {},
        "chunked": dict(max_num_batched_tokens=24),
        "cached": dict(enable_prefix_caching=True),
        "preempted": dict(num_gpu_blocks_override=25, max_model_len=96, max_num_batched_tokens=16),
        "no-hybrid": dict(disable_hybrid_kv_cache_manager=True),
    })


def _config(tmp_path, **c):
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                vocab_size=100)
    (tmp_path / "config.json").write_text(json.dumps({**base, **c}))
    return config_from_hf_dir(str(tmp_path))


def test_which_configs_have_windows(tmp_path):
    mistral = dict(architectures=["MistralForCausalLM"])
    assert _config(tmp_path, **mistral, sliding_window=None).layer_windows() == [None] * 4
    assert _config(tmp_path, **mistral, sliding_window=4096).layer_windows() == [4096] * 4
    # transformers' Llama ignores the key
    assert _config(tmp_path, architectures=["LlamaForCausalLM"], sliding_window=8).layer_windows() == [None] * 4
    qwen2 = dict(architectures=["Qwen2ForCausalLM"], sliding_window=32)
    assert _config(tmp_path, **qwen2, use_sliding_window=False).layer_windows() == [None] * 4
    assert _config(tmp_path, **qwen2, use_sliding_window=True, max_window_layers=2).layer_windows() == \
        [None, None, 32, 32]
    with pytest.raises(ValueError, match="sliding_window"):
        _config(tmp_path, **mistral, sliding_window=0)
