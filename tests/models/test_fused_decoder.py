"""The fused C++ decoder stack (``models/fused_decoder.py``, ``kernels/csrc/decoder_stack.cpp``)
against the per-layer Python path it replaces: bitwise the same greedy tokens and logprobs
(prefills chunked beside decodes, several requests a step, a prefix from the cache), in
every KV-cache dtype the kernels read; used where it applies and said so in the start-up
line, not used (with the reason) where it does not; bad arguments are clear errors."""
from __future__ import annotations

import pytest
import torch
from engine_helpers import model_runner, random_prompts
from model_helpers import tiny_arch_dir

from pagedllm import LLM, SamplingParams
from pagedllm.kernels.cpu import load_cpu_kernels
from pagedllm.layers.quantization.int8 import amx_int8_available, quantize_per_token

pytestmark = pytest.mark.skipif(load_cpu_kernels() is None, reason="no C++ kernels on this machine")

FUSED = "decoder one C++ stack call a step"


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
@pytest.mark.slow
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
def test_tiny_models_fused_equals_per_layer(monkeypatch, tiny_model_dir, arch, method):
    path = tiny_arch_dir(tiny_model_dir, arch)
    path_fused, fused = _run(monkeypatch, True, model=path, quantization=method, vocab=2000)
    _, layers = _run(monkeypatch, False, model=path, quantization=method, vocab=2000)
    assert FUSED in path_fused
    assert fused == layers


@pytest.mark.parametrize("arch,kw,reason", [
    ("qwen3", {"quantization": "q8_0"}, "not the plain Llama layer"),            # q/k norms
    ("llama", {}, "has no C++ stack form"),                                      # dense float32 linears
    ("llama", {"quantization": "q8_0", "attention_backend": "torch"}, "attention not on the C++ kernels"),
])
def test_per_layer_where_the_stack_cannot_apply(monkeypatch, tiny_model_dir, arch, kw, reason):
    path = tiny_arch_dir(tiny_model_dir, arch)
    described, outs = _run(monkeypatch, True, model=path, vocab=2000, **kw)
    assert "decoder per-layer (" in described and reason in described
    assert all(len(ids) == 10 for ids, _ in outs)


@pytest.mark.parametrize("fused", [True, pytest.param(False, marks=pytest.mark.slow)])   # fast-tier budget
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


@pytest.mark.slow
def test_int8_start_up_lines_describe_the_engine_model(monkeypatch, caplog, int8_on_avx2):
    """SmoothQuant's calibration prefills run the model over a cache of their own with the
    linears in float; the start-up lines describe the engine's model, not that pass (the
    "loaded" line had said "decoder per-layer (linear F.linear has no C++ stack form)"
    while the stack ran)."""
    import logging

    monkeypatch.setenv("PAGEDLLM_FUSED_DECODER", "1")
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = LLM(dtype="float32", quantization="int8", max_model_len=128, kv_cache_memory="32MiB",
                  engine_process=False)
        llm.shutdown()
    msgs = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("calibrated ") for m in msgs)
    assert not [m for m in msgs if "F.linear" in m or "decoder per-layer" in m]
    assert [m for m in msgs if m.startswith("decoder layers: ")] == ["decoder layers: one C++ stack call a step"]


@pytest.mark.slow   # ~3 s (fast-tier budget)
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


def _int8_backend(monkeypatch, backend: str) -> None:
    """``--quantization int8`` on the project's ``backend`` kernel ("avx2" or "amx") whatever
    the CPU would pick, or the test skipped where that kernel does not run."""
    import functools

    from pagedllm.layers.quantization import int8_config
    from pagedllm.layers.quantization.int8 import Int8W8A8LinearMethod, amx_int8_available, avx2_int8_available

    if not {"avx2": avx2_int8_available, "amx": amx_int8_available}[backend]("cpu"):
        pytest.skip(f"the {backend} int8 kernel does not run on this CPU")
    monkeypatch.setattr(int8_config, "Int8W8A8LinearMethod", functools.partial(Int8W8A8LinearMethod, backend=backend))


@pytest.fixture
def int8_on_avx2(monkeypatch):
    """``--quantization int8`` on the AVX2 kernel whatever the CPU (the Intel Xeon's default
    is AMX): every AVX2 CPU can run the stack's int8 form through it."""
    _int8_backend(monkeypatch, "avx2")


# (backend, what the start-up line names)
INT8_KERNELS = [("avx2", "AVX2 u8s8"), ("amx", "AMX u8s8")]


@pytest.mark.slow
@pytest.mark.parametrize("backend,kernel", INT8_KERNELS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bundled_int8_fused_equals_per_layer(monkeypatch, backend, kernel, dtype):
    """int8 W8A8 on each of the project's kernels (SmoothQuant rows, the LM head int8 outside
    the stack): the stack quantizes each linear's input and calls the kernel as the
    per-layer path does. The AMX case runs on a CPU with AMX-INT8 only."""
    _int8_backend(monkeypatch, backend)
    kw = dict(quantization="int8", dtype=dtype)
    path_fused, fused = _run(monkeypatch, True, **kw)
    path_layers, layers = _run(monkeypatch, False, **kw)
    assert FUSED in path_fused and kernel in path_fused
    assert "decoder per-layer (PAGEDLLM_FUSED_DECODER=0)" in path_layers
    assert fused == layers
    assert len(fused) == 6 and all(len(ids) == 10 for ids, _ in fused)


def test_tiny_qwen2_int8_fused_equals_per_layer(monkeypatch, tiny_model_dir, int8_on_avx2):
    """A q|k|v bias through the int8 stack form (added by the kernel's epilogue)."""
    path = tiny_arch_dir(tiny_model_dir, "qwen2")
    path_fused, fused = _run(monkeypatch, True, model=path, quantization="int8", vocab=2000)
    _, layers = _run(monkeypatch, False, model=path, quantization="int8", vocab=2000)
    assert FUSED in path_fused
    assert fused == layers


def _bf16_kernel(monkeypatch, kernel: str) -> None:
    """bf16 linears on the project's ``kernel`` ("avx512": VDPBF16PS, "amx": AMX tiles) whatever
    the CPU would pick (an AMX CPU also has AVX512-BF16: PAGEDLLM_AMX=0 selects it), or the
    test skipped where that kernel does not run."""
    from pagedllm.layers.linear import amx_bf16_available, avx512_bf16_available

    if kernel == "amx":
        if not amx_bf16_available("cpu", torch.bfloat16):
            pytest.skip("no AMX-BF16 on this CPU")
        return
    monkeypatch.setenv("PAGEDLLM_AMX", "0")
    if not avx512_bf16_available("cpu", torch.bfloat16):
        pytest.skip("no AVX512-BF16 on this CPU")


# (kernel, what the start-up line names)
BF16_KERNELS = [("avx512", "AVX512-BF16 (C++)"), ("amx", "AMX bf16 (C++)")]


@pytest.mark.parametrize("kernel,name", BF16_KERNELS)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])   # qwen2: a q|k|v bias
def test_tiny_bf16_fused_equals_per_layer(monkeypatch, tiny_model_dir, kernel, name, arch):
    """bfloat16 linears on the tiled C++ kernels run inside the stack with the per-layer
    path's bits (tokens and logprobs), prefix hits and chunked prefills included."""
    _bf16_kernel(monkeypatch, kernel)
    path = tiny_arch_dir(tiny_model_dir, arch)
    path_fused, fused = _run(monkeypatch, True, model=path, dtype="bfloat16", vocab=2000)
    path_layers, layers = _run(monkeypatch, False, model=path, dtype="bfloat16", vocab=2000)
    assert FUSED in path_fused and name in path_fused
    assert "decoder per-layer (PAGEDLLM_FUSED_DECODER=0)" in path_layers
    assert fused == layers


@pytest.mark.slow
@pytest.mark.parametrize("kernel,name", BF16_KERNELS)
def test_bundled_bf16_default_fused_equals_per_layer(monkeypatch, kernel, name):
    """The default configuration on a bf16 CPU (SmolLM2, bfloat16, no quantization): the stack."""
    _bf16_kernel(monkeypatch, kernel)
    path_fused, fused = _run(monkeypatch, True, dtype="bfloat16")
    _, layers = _run(monkeypatch, False, dtype="bfloat16")
    assert FUSED in path_fused and name in path_fused
    assert fused == layers
    assert len(fused) == 6 and all(len(ids) == 10 for ids, _ in fused)


@pytest.mark.parametrize("kernel", ["avx512", "amx"])
@pytest.mark.parametrize("n,k,bias", [(64, 64, False), (48, 96, True), (960, 576, True)])
def test_stack_linear_bf16_tiled_equals_apply(monkeypatch, kernel, n, k, bias):
    """The bf16 StackLinear gives the method's ``apply`` bits for 1, 5 and 70 rows; shapes the
    tiles do not fit (the dense fallback) have no stack form."""
    from pagedllm.layers.linear import ReplicatedLinear, get_linear_method

    _bf16_kernel(monkeypatch, kernel)
    method = get_linear_method("cpu", torch.bfloat16)
    g = torch.Generator().manual_seed(n + k)
    layer = ReplicatedLinear(k, n, bias, torch.bfloat16, torch.device("cpu"), linear_method=method)
    layer.weight.data.copy_(torch.randn(n, k, generator=g) * 0.1)
    if bias:
        layer.bias.data.copy_(torch.randn(n, generator=g))
    method.process_weights_after_loading(layer)
    lin = method.stack_linear(layer, load_cpu_kernels())
    assert lin.kind == f"bf16_{kernel}" and lin.out_features == n
    for rows in (1, 5, 70):
        x = (torch.randn(rows, k, generator=g) * 3).to(torch.bfloat16)
        want = method.apply(layer, x, layer.bias)
        got = lin(x)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), rows
    odd = ReplicatedLinear(40, 24, False, torch.bfloat16, torch.device("cpu"), linear_method=method)
    method.process_weights_after_loading(odd)
    assert method.stack_linear(odd, load_cpu_kernels()) is None


def test_stack_linear_bf16_tiled_argument_errors():
    k = load_cpu_kernels()
    with pytest.raises(ValueError, match="w_packed"):
        k.StackLinear.bf16_tiled(torch.zeros(2, 1, 16, 32), False)
    with pytest.raises(ValueError, match="w_packed"):
        k.StackLinear.bf16_tiled(torch.zeros(2, 1, 16, 16, dtype=torch.bfloat16), False)
    w = torch.zeros(2, 2, 16, 32, dtype=torch.bfloat16)       # N = 32, K = 64
    for amx, have in ((False, k.avx512_bf16_available()), (True, k.amx_bf16_available())):
        if not have:
            with pytest.raises(ValueError, match="not available"):
                k.StackLinear.bf16_tiled(w, amx)
            continue
        with pytest.raises(ValueError, match="bias"):
            k.StackLinear.bf16_tiled(w, amx, torch.zeros(31))
        lin = k.StackLinear.bf16_tiled(w, amx, torch.arange(32.0))
        with pytest.raises(ValueError, match=r"x must be \[T, 64\]"):
            lin(torch.zeros(2, 60, dtype=torch.bfloat16))
        assert torch.equal(lin(torch.ones(3, 64, dtype=torch.bfloat16)),
                           torch.arange(32.0).to(torch.bfloat16).expand(3, 32))


def _int8_layer(n: int, k: int, dtype: torch.dtype, bias: bool, smooth: bool, backend: str = "avx2"):
    """A processed int8 linear layer [n, k] with random weights (and a random SmoothQuant
    calibration when ``smooth``), and its method."""
    from pagedllm.layers.linear import ReplicatedLinear
    from pagedllm.layers.quantization.int8 import Int8W8A8LinearMethod

    g = torch.Generator().manual_seed(n * 7 + k)
    method = Int8W8A8LinearMethod("cpu", backend=backend, smooth_alpha=0.5 if smooth else None)
    layer = ReplicatedLinear(k, n, bias, dtype, torch.device("cpu"), linear_method=method)
    layer.weight.data.copy_(torch.randn(n, k, generator=g) * 0.1)
    if bias:
        layer.bias.data.copy_(torch.randn(n, generator=g))
    if smooth:
        layer.int8_act_amax = torch.rand(k, generator=g) * 10 + 0.1
    method.process_weights_after_loading(layer)
    return layer, method


def _assert_stack_linear_equals_apply(backend: str, kind: str, dtype, n, k, bias, smooth):
    """``method.stack_linear``'s StackLinear (``kind``) against ``apply`` on the ``backend``
    kernel: the same bits for 1, 5 and 70 rows."""
    layer, method = _int8_layer(n, k, dtype, bias, smooth, backend=backend)
    assert layer.int8_backend == backend
    lin = method.stack_linear(layer, load_cpu_kernels())
    assert lin.kind == kind and lin.out_features == n
    g = torch.Generator().manual_seed(1)
    for rows in (1, 5, 70):
        x = (torch.randn(rows, k, generator=g) * 3).to(dtype)
        want = method.apply(layer, x, layer.bias)
        got = lin(x)
        assert got.dtype == dtype and torch.equal(got, want), (rows, (got.float() - want.float()).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,bias,smooth", [(40, 64, False, False), (33, 96, True, True), (16, 576, True, False)])
def test_stack_linear_int8_equals_apply(int8_on_avx2, dtype, n, k, bias, smooth):
    """The int8 StackLinear (quantizer + AVX2 kernel in C++) gives apply's bits, with a
    bias, a smoothing row and N not a multiple of 16."""
    _assert_stack_linear_equals_apply("avx2", "int8_avx2", dtype, n, k, bias, smooth)


@pytest.mark.skipif(not amx_int8_available("cpu"), reason="no AMX-INT8 on this CPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,bias,smooth", [(32, 64, False, False), (48, 128, True, True), (960, 576, True, False)])
def test_stack_linear_int8_amx_equals_apply(dtype, n, k, bias, smooth):
    """The AMX int8 StackLinear (quantizer + AMX kernel in C++) gives apply's bits, with a
    bias and a smoothing row (AMX tiles: N % 16 == 0, K % 64 == 0)."""
    _assert_stack_linear_equals_apply("amx", "int8_amx", dtype, n, k, bias, smooth)


def test_stack_linear_only_where_apply_runs_a_stack_kernel(int8_on_avx2):
    """int8 on the torch reference, and dense float linears, have no stack form."""
    from pagedllm.layers.linear import ReplicatedLinear, UnquantizedLinearMethod

    layer, method = _int8_layer(32, 64, torch.float32, False, False, backend="torch")
    assert method.stack_linear(layer, load_cpu_kernels()) is None
    dense = ReplicatedLinear(64, 32, False, torch.float32, torch.device("cpu"), linear_method=UnquantizedLinearMethod())
    assert dense.linear_method.stack_linear(dense, load_cpu_kernels()) is None


def test_stack_linear_argument_errors():
    k = load_cpu_kernels()
    w = torch.zeros(2, 16, 16, 4, dtype=torch.int8)        # N <= 32, K = 64
    colsum, f32 = torch.zeros(32, dtype=torch.int32), torch.zeros(32)
    ok = dict(w_packed=w, colsum=colsum, compensation=f32, weight_scales=f32, smooth=None, qmax=127,
              zero_point=128, seven_bit_weights=False)
    assert k.StackLinear.int8_avx2(**ok).out_features == 32
    for bad, match in [(dict(w_packed=torch.zeros(2, 16, 16, 4)), "w_packed"),
                       (dict(colsum=torch.zeros(8, dtype=torch.int32)), "colsum has 8 columns"),
                       (dict(compensation=torch.zeros(31)), "compensation"),
                       (dict(qmax=127, zero_point=100), "zero_point"),
                       (dict(smooth=torch.zeros(63)), "smooth"),
                       (dict(bias=torch.zeros(32, dtype=torch.bfloat16)), "bias")]:
        with pytest.raises(ValueError, match=match):
            k.StackLinear.int8_avx2(**{**ok, **bad})
    lin = k.StackLinear.int8_avx2(**ok)
    with pytest.raises(ValueError, match=r"x must be \[T, 64\]"):
        lin(torch.zeros(2, 60))
    with pytest.raises(ValueError, match="weight"):
        k.StackLinear.block(torch.zeros(4, 34), 8)


def test_stack_linear_int8_amx_operands():
    """int8_amx checks its operands where it is built, on any CPU; called, it hands
    amx_int8_linear what that kernel takes: on a CPU with AMX-INT8 the epilogue's values
    (an all-zero weight: (0 - compensation) * scale * row scale + bias), elsewhere the
    kernel's own "no AMX" error, raised after its operand checks passed."""
    k = load_cpu_kernels()
    w = torch.zeros(2, 1, 16, 64, dtype=torch.int8)       # N = 32, K = 64
    comp, scales = torch.full((32,), 128.0), torch.full((32,), 0.5)
    bias = torch.arange(32, dtype=torch.float32)
    ok = dict(w_packed=w, compensation=comp, weight_scales=scales, smooth=None, qmax=127, zero_point=128, bias=bias)
    lin = k.StackLinear.int8_amx(**ok)
    assert lin.kind == "int8_amx" and lin.out_features == 32
    for bad, match in [(dict(w_packed=torch.zeros(2, 1, 16, 4, dtype=torch.int8)), "w_packed"),
                       (dict(w_packed=torch.zeros(2, 1, 16, 64)), "w_packed"),
                       (dict(compensation=torch.zeros(31)), "compensation"),
                       (dict(weight_scales=torch.zeros(32, dtype=torch.float64)), "weight_scales"),
                       (dict(qmax=0), "qmax"),
                       (dict(smooth=torch.zeros(63)), "smooth"),
                       (dict(bias=torch.zeros(32, dtype=torch.bfloat16)), "bias")]:
        with pytest.raises(ValueError, match=match):
            k.StackLinear.int8_amx(**{**ok, **bad})
    with pytest.raises(ValueError, match=r"x must be \[T, 64\]"):
        lin(torch.zeros(2, 60))
    x = torch.randn(3, 64)
    if k.amx_int8_available():      # the kernel's own answer (PAGEDLLM_AMX=0 does not stop a direct call)
        _, row_scale = quantize_per_token(x, 127, 128)
        want = ((torch.zeros(3, 32) - comp) * scales) * row_scale[:, None] + bias
        assert torch.equal(lin(x), want)
    else:
        with pytest.raises(RuntimeError, match="amx_int8_linear: (the kernels were built without AMX-INT8|no AMX tile)"):
            lin(x)


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
    lin = k.StackLinear.block(torch.zeros(128, 2 * 34, dtype=torch.uint8), 8)   # Q8_0: 34 bytes per 32 weights
    with pytest.raises(ValueError, match="key/value caches"):
        stack.add_layer(w, w, lin, lin, lin, lin, torch.zeros(32, 3, 16), torch.zeros(32, 3, 16), 1.0, 1.0)
    narrow = k.StackLinear.block(torch.zeros(96, 2 * 34, dtype=torch.uint8), 8)
    with pytest.raises(ValueError, match="qkv has 96 outputs, expected"):
        stack.add_layer(w, w, narrow, lin, lin, lin, torch.zeros(32, 2, 16), torch.zeros(32, 2, 16), 1.0, 1.0)
    assert stack.num_layers == 0
    stack.add_layer(w, w, lin, lin, lin, lin, torch.zeros(32, 2, 16), torch.zeros(32, 2, 16), 1.0, 1.0)
    assert stack.num_layers == 1
