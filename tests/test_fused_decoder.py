"""The fused C++ decoder stack (``models/fused_decoder.py``, ``kernels/csrc/decoder_stack.cpp``)
against the per-layer Python path it replaces: bitwise the same greedy tokens and logprobs
(prefills chunked beside decodes, several requests a step, a prefix from the cache), in
every KV-cache dtype the kernels read; used where it applies and said so in the start-up
line, not used (with the reason) where it does not; bad arguments are clear errors."""
from __future__ import annotations

import pytest
import torch
from engine_helpers import model_runner, random_prompts
from test_models_hf import _save_tiny

from pagedllm import LLM, SamplingParams
from pagedllm.kernels.cpu import load_cpu_kernels

pytestmark = pytest.mark.skipif(load_cpu_kernels() is None, reason="no C++ kernels on this machine")

FUSED = "decoder one C++ stack call a step"


@pytest.fixture(scope="module")
def tok():
    from pagedllm.tokenizer import get_tokenizer

    return get_tokenizer()


def _run(monkeypatch, fused: bool, **llm_kw):
    """(describe_compute_path, [(token ids, [[(token, logprob)...] per position]) per prompt])
    for a mixed workload: 6 prompts sharing a 40-token prefix, 48-token prefill chunks."""
    monkeypatch.setenv("PAGEDLLM_FUSED_DECODER", "1" if fused else "0")
    vocab = llm_kw.pop("vocab", 49152)
    dtype = llm_kw.pop("dtype", "float32")
    prompts = random_prompts(6, seed=11, vocab=vocab, min_len=5, max_len=90)
    shared = prompts[0]["prompt_token_ids"][:5] * 8
    prompts = [{"prompt_token_ids": shared + p["prompt_token_ids"]} for p in prompts]
    llm = LLM(dtype=dtype, max_model_len=256, kv_cache_memory="64MiB", engine_process=False,
              max_num_batched_tokens=48, enable_prefix_caching=True, **llm_kw)
    try:
        sp = SamplingParams(temperature=0, max_tokens=10, logprobs=3, ignore_eos=True)
        llm.generate(prompts[:1], sp, use_tqdm=False)            # puts the shared prefix in the cache
        outs = llm.generate(prompts, sp, use_tqdm=False)
        got = [(list(o.outputs[0].token_ids),
                [sorted((t, lp.logprob) for t, lp in d.items()) for d in o.outputs[0].logprobs]) for o in outs]
        return model_runner(llm.llm_engine).describe_compute_path(), got
    finally:
        llm.shutdown()


# bfloat16 activations too (every CPU can compare the two paths in it; the kernels widen to float32)
@pytest.mark.parametrize("dtype,kv_cache_dtype", [("float32", "auto"), ("float32", "bfloat16"),
                                                  ("float32", "fp8_e4m3"), ("bfloat16", "auto")])
def test_bundled_gguf_fused_equals_per_layer(monkeypatch, dtype, kv_cache_dtype):
    kw = dict(quantization="gguf", kv_cache_dtype=kv_cache_dtype, dtype=dtype)
    path_fused, fused = _run(monkeypatch, True, **kw)
    path_layers, layers = _run(monkeypatch, False, **kw)
    assert FUSED in path_fused
    assert "decoder per-layer (PAGEDLLM_FUSED_DECODER=0)" in path_layers
    assert fused == layers
    assert len(fused) == 6 and all(len(ids) == 10 for ids, _ in fused)


@pytest.mark.parametrize("arch,method", [("llama", "q8_0"), ("qwen2", "q4_1")])   # qwen2: a q|k|v bias
def test_tiny_models_fused_equals_per_layer(monkeypatch, tmp_path, tok, arch, method):
    path, _ = _save_tiny(tmp_path, arch, tok)
    path_fused, fused = _run(monkeypatch, True, model=path, quantization=method, vocab=2000)
    _, layers = _run(monkeypatch, False, model=path, quantization=method, vocab=2000)
    assert FUSED in path_fused
    assert fused == layers


@pytest.mark.parametrize("arch,kw,reason", [
    ("qwen3", {"quantization": "q8_0"}, "not the plain Llama layer"),            # q/k norms
    ("llama", {}, "has no C++ stack form"),                                      # dense float32 linears
    ("llama", {"quantization": "q8_0", "attention_backend": "torch"}, "attention not on the C++ kernels"),
])
def test_per_layer_where_the_stack_cannot_apply(monkeypatch, tmp_path, tok, arch, kw, reason):
    path, _ = _save_tiny(tmp_path, arch, tok)
    described, outs = _run(monkeypatch, True, model=path, vocab=2000, **kw)
    assert "decoder per-layer (" in described and reason in described
    assert all(len(ids) == 10 for ids, _ in outs)


@pytest.mark.parametrize("fused", [True, False])
def test_start_up_log_says_how_the_decoder_runs(monkeypatch, caplog, fused):
    import logging

    monkeypatch.setenv("PAGEDLLM_FUSED_DECODER", "1" if fused else "0")
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = LLM(dtype="float32", quantization="gguf", max_model_len=128, kv_cache_memory="32MiB",
                  engine_process=False)
        llm.shutdown()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decoder layers: ")]
    assert lines == ["decoder layers: " + ("one C++ stack call a step" if fused else
                                           "per-layer (PAGEDLLM_FUSED_DECODER=0)")]


def test_profiler_sees_the_stack_and_its_kernels(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_FUSED_DECODER", "1")
    llm = LLM(dtype="float32", quantization="gguf", max_model_len=128, kv_cache_memory="32MiB",
              engine_process=False)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        names = {e.name for e in prof.events()}
    finally:
        llm.shutdown()
    for name in ("pagedllm::decoder_stack", "pagedllm::paged_attention", "block_quant_linear",
                 "pagedllm::fused_add_rms_norm"):
        assert name in names, name


def test_decoder_stack_argument_errors():
    k = load_cpu_kernels()
    with pytest.raises(ValueError, match="num_kv_heads"):
        k.DecoderStack(9, 2, 64, 1e-5, 0.125)
    stack = k.DecoderStack(4, 2, 16, 1e-5, 0.25)
    with pytest.raises(ValueError, match="no layers"):
        stack.forward(torch.zeros(1, 64), torch.zeros(1, 64), torch.zeros(1, 8), torch.zeros(1, 8),
                      torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.int32),
                      torch.tensor([0, 1], dtype=torch.int32), torch.ones(1, dtype=torch.int32), 16, 0)
    w = torch.zeros(64)
    blocks = torch.zeros(128, 2 * 34, dtype=torch.uint8)   # Q8_0: 34 bytes per 32 weights
    with pytest.raises(ValueError, match="key/value caches"):
        stack.add_layer(w, w, blocks, 8, None, blocks, 8, blocks, 8, blocks, 8,
                        torch.zeros(32, 3, 16), torch.zeros(32, 3, 16), 1.0, 1.0)
    assert stack.num_layers == 0
