"""The engine on a CUDA device: the same code as on the CPU (torch attention backend,
torch linears), checked against HF transformers on the same weights and for greedy
invariance, in float32 and bfloat16, with each KV-cache dtype and quantization method, and
with CUDA graphs on and off (``enforce_eager``; the CPU never captures, so there the two agree
trivially).

Skipped where torch sees no CUDA device (every CI machine of this project), so these run
only when a GPU is lent (docs/gpu.md: scripts/gpu_check.sh runs them). Nothing here needs
the bundled model or a hub: the test trains a byte-level BPE tokenizer on a fixed text and
builds a tiny random-weight Llama (head_dim 64). ``PAGEDLLM_TEST_DEVICE=cpu`` runs the
same checks on the CPU (to check the tests themselves on a machine without a GPU).
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from engine_helpers import engine_core, model_runner  # noqa: E402

DEVICE = os.environ.get("PAGEDLLM_TEST_DEVICE", "cuda")
pytestmark = [pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="no CUDA device"),
              pytest.mark.slow]   # HF-reference and invariance suites

VOCAB = 1024
TEXT = ("The history of the city goes back more than two thousand years, when a small settlement "
        "grew up around a river crossing used by traders who carried salt, wine and pottery between "
        "the coast and the mountains. ") * 8


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dir):
    """A directory holding a tiny random Llama (2 layers, 4 q / 2 kv heads x 64) in
    float32 safetensors and a BPE tokenizer with a 1024-token vocabulary."""
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<eos>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    return tiny_model_dir("llama", tokenizer=fast, vocab_size=VOCAB, eos_token_id=0, bos_token_id=0)


def _prompts(n: int, seed: int, prefix_len: int = 40) -> list[list[int]]:
    """n prompts of random tokens: one shared prefix, then 5..40 tokens each."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(1, VOCAB, prefix_len).tolist()
    return [prefix + rng.integers(1, VOCAB, int(rng.integers(5, 40))).tolist() for _ in range(n)]


def _llm(path: str, dtype: str, **kw):
    from pagedllm import LLM

    # a fixed cache (8192 tokens): on CUDA --kv-cache-memory does not apply and each engine
    # would take 90 % of the GPU in turn, millions of blocks
    kw = {"kv_cache_memory": "256MiB", "num_gpu_blocks_override": 512, "max_model_len": 512, **kw}
    return LLM(model=path, dtype=dtype, device=DEVICE, seed=0, engine_process=False, **kw)


def _greedy(llm, prompts, max_tokens: int = 16) -> list[list[int]]:
    from pagedllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(autouse=True)
def _exact_float32_matmuls():
    """No TF32 in the float32 checks (torch's default for matmuls is already off; cuDNN
    convolutions are not used)."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def test_engine_runs_on_the_device(tiny_dir):
    llm = _llm(tiny_dir, "float32")
    try:
        assert llm.llm_engine.config.device.type == DEVICE
        out = _greedy(llm, _prompts(2, seed=0), max_tokens=4)
        assert all(len(o) == 4 for o in out)
    finally:
        llm.shutdown()


def test_greedy_and_logprobs_match_transformers_float32(tiny_dir):
    """Greedy tokens equal HF ``generate`` on the same weights on the same device, and the
    prompt logprobs agree with HF's log-softmax of its logits to 1e-4."""
    from transformers import AutoModelForCausalLM

    from pagedllm import SamplingParams

    prompts = _prompts(6, seed=1)
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).to(DEVICE).eval()
    ref, ref_lp = [], []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=DEVICE)
            g = hf.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16,
                            attention_mask=torch.ones_like(ids), pad_token_id=0)
            ref.append(g[0, len(p):].tolist())
            lp = torch.log_softmax(hf(ids).logits[0].float(), -1)
            ref_lp.append([lp[i - 1, p[i]].item() for i in range(1, len(p))])
    llm = _llm(tiny_dir, "float32")
    try:
        assert _greedy(llm, prompts) == ref
        sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        for o, p, want in zip(outs, prompts, ref_lp):
            got = [o.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))]
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("dtype,kv_cache_dtype", [("float32", "auto"), ("bfloat16", "auto"),
                                                  ("bfloat16", "fp8_e4m3"), ("float32", "fp8_e5m2")])
def test_greedy_invariant_to_batching_chunking_caching(tiny_dir, dtype, kv_cache_dtype):
    """The same greedy tokens alone, batched, with a 13-token prefill budget, from the
    prefix cache, and preempted under a cache of a few blocks."""
    prompts = _prompts(8, seed=2)
    llm = _llm(tiny_dir, dtype, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)
    try:
        alone = [_greedy(llm, [p])[0] for p in prompts]
        assert len({tuple(a) for a in alone}) > len(prompts) // 2
        assert _greedy(llm, prompts) == alone, "batched"
    finally:
        llm.shutdown()
    for label, kw in [("chunked", dict(max_num_batched_tokens=13, enable_prefix_caching=False)),
                      ("prefix cache", dict(enable_prefix_caching=True)),
                      ("preemption", dict(enable_prefix_caching=False, num_gpu_blocks_override=12,
                                          max_model_len=96))]:
        llm = _llm(tiny_dir, dtype, kv_cache_dtype=kv_cache_dtype, **kw)
        try:
            if label == "prefix cache":
                _greedy(llm, prompts[:1], 1)
            before = llm.stats().num_preemptions_total
            assert _greedy(llm, prompts) == alone, label
            if label == "preemption":
                assert llm.stats().num_preemptions_total > before
            if label == "prefix cache":
                assert llm.stats().prefix_cache_hits > 0
        finally:
            llm.shutdown()


def _prompt_logprobs(llm, prompts) -> list[list[float]]:
    from pagedllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [[o.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))] for o, p in zip(outs, prompts)]


@pytest.mark.parametrize("method", ["int8", "q8_0", "q4_0", "q4_1"])
def test_quantization_methods_on_the_device(tiny_dir, method):
    """Each HF-checkpoint method either refuses the device with a ValueError naming
    --quantization, or runs there: its prompt logprobs within 2e-3 of the same method on
    the CPU (the CPU's C++ kernels, tested against dequantize-then-matmul references, and
    the device's torch path on the same quantized weights), and its greedy tokens the
    same batched as alone."""
    from pagedllm import LLM

    prompts = _prompts(4, seed=3)
    try:
        llm = _llm(tiny_dir, "float32", quantization=method)
    except ValueError as e:
        assert "quantization" in str(e)
        pytest.skip(f"{method} refused on {DEVICE}: {e}")
    try:
        got = _prompt_logprobs(llm, prompts)
        batched = _greedy(llm, prompts, 8)
        assert [_greedy(llm, [p], 8)[0] for p in prompts] == batched, "batched vs alone"
    finally:
        llm.shutdown()
    cpu = LLM(model=tiny_dir, dtype="float32", device="cpu", seed=0, engine_process=False,
              kv_cache_memory="64MiB", max_model_len=512, quantization=method)
    try:
        want = _prompt_logprobs(cpu, prompts)
    finally:
        cpu.shutdown()
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=2e-3, rtol=0)


def test_greedy_same_with_and_without_cuda_graphs(tiny_dir):
    """bfloat16: the same greedy tokens with CUDA graphs (``enforce_eager=False``) as
    without, alone and batched; requests stop after 5..16 tokens, so the decode batch
    shrinks through sizes that are padded to a captured one."""
    from pagedllm import SamplingParams

    prompts = _prompts(8, seed=4)
    params = [SamplingParams(temperature=0, max_tokens=16 - 11 * i // 7, ignore_eos=True) for i in range(8)]
    got = {}
    for eager in (True, False):
        llm = _llm(tiny_dir, "bfloat16", enforce_eager=eager, enable_prefix_caching=False)
        try:
            if DEVICE == "cuda":    # the graphs are really there (and really absent when eager)
                decoder = model_runner(llm.llm_engine).describe_decoder()
                assert ("eager (--enforce-eager)" if eager else "CUDA graphs for decode batches") in decoder
            alone = [_greedy(llm, [p])[0] for p in prompts]
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            batched = [list(o.outputs[0].token_ids) for o in outs]
        finally:
            llm.shutdown()
        assert batched == [a[:sp.max_tokens] for a, sp in zip(alone, params)], f"batched, enforce_eager={eager}"
        got[eager] = alone
    assert len({tuple(a) for a in got[True]}) > len(prompts) // 2
    assert got[False] == got[True], "CUDA graphs changed greedy tokens"


@pytest.mark.skipif(DEVICE != "cuda", reason="--gpu-memory-utilization applies on CUDA only")
def test_kv_cache_sized_from_gpu_memory_utilization(tiny_dir, caplog):
    """No block override: the profiling step runs, the log gives each figure, and the cache
    gets blocks from what --gpu-memory-utilization leaves; a smaller share, fewer blocks."""
    import logging

    from pagedllm import LLM

    blocks = []
    for util in (0.3, 0.15):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="pagedllm"):
            llm = LLM(model=tiny_dir, dtype="bfloat16", device=DEVICE, engine_process=False, max_model_len=512,
                      gpu_memory_utilization=util)
        try:
            assert any("GPU memory:" in r.getMessage() and "activation peak" in r.getMessage()
                       for r in caplog.records)
            blocks.append(engine_core(llm.llm_engine).kv.num_blocks)
            assert _greedy(llm, _prompts(2, seed=5), 4)
        finally:
            llm.shutdown()
    assert blocks[0] > blocks[1] > 0


@pytest.mark.skipif(DEVICE != "cuda", reason="the Triton interpreter tests cover this on the CPU "
                                               "(tests/attention/test_triton_attention.py)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("split_kv", [False, True])
@pytest.mark.parametrize("window", [None, 24])
def test_triton_backend_matches_torch_backend_on_the_device(dtype, split_kv, window):
    """The Triton kernels against the torch backend on the GPU, in bf16 too (which the
    interpreter cannot check): a mixed batch of decodes (one long), a prompt chunk over a
    cached prefix, a spec-verify span and a fresh prompt, GQA 8/2, head_dim 128."""
    from pagedllm.attention.backend import build_common_metadata
    from pagedllm.attention.registry import get_attention_backend
    from pagedllm.attention.torch_backend import TorchAttentionBackend

    dev, bs, nh, nkv, hd = torch.device(DEVICE), 16, 8, 2, 128
    ctx = np.array([300, 7, 40, 33, 0], dtype=np.int64)
    qlens = np.array([1, 1, 20, 4, 29], dtype=np.int64)
    nblk = -(-(ctx + qlens) // bs)
    rng = np.random.default_rng(0)
    perm = rng.permutation(int(nblk.sum()) + 2)
    bt = np.zeros((len(qlens), int(nblk.max())), dtype=np.int32)
    starts = np.concatenate([[0], np.cumsum(nblk)])
    for i in range(len(qlens)):
        bt[i, :nblk[i]] = perm[starts[i]:starts[i + 1]]
    common, _, _ = build_common_metadata(ctx, qlens, bt, bs, dev)
    g = torch.Generator(device=dev).manual_seed(0)
    T = int(qlens.sum())
    cache = torch.randn(2, len(perm) * bs, nkv, hd, generator=g, device=dev).to(dtype)
    q, k, v = (torch.randn(T, n, hd, generator=g, device=dev).to(dtype) for n in (nh, nkv, nkv))
    outs = []
    for backend in (TorchAttentionBackend(dev, dtype), get_attention_backend("triton", dev, dtype)):
        md = backend.build_metadata(common, window)
        if backend.name == "triton":
            md.split_kv = split_kv
        c = cache.clone()
        outs.append((backend.forward(q, k, v, c, md, hd ** -0.5).float(), c))
    (want, want_cache), (got, got_cache) = outs
    assert torch.equal(got_cache, want_cache), "K/V written differently"
    tol = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
