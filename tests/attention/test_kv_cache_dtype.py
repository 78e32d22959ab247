"""``--kv-cache-dtype``: a KV cache in float32, bfloat16 or fp8 (E4M3, E5M2) whatever the
model's dtype.

- Writes: the C++ K/V write (``reshape_and_cache``) and the torch backend's
  ``quantize_kv`` store the same codes as torch's own conversion
  (``(x / scale).clamp(-max, max).to(dtype)``), which in turn is checked against a
  brute-force nearest-even rounding over every fp8 value (OCP OFP8 spec): midpoints,
  subnormals, saturation, a scale that is not a power of two (true division).
- Reads: the C++ kernel widens every fp8 code to its exact value; its attention over a
  cache of each dtype agrees with the torch backend on the same cache, for float32 and
  bfloat16 models, with k/v scales other than 1.
- Config: names, errors, block counts; checkpoint scales reach the layers.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from attention_helpers import _batch, _naive

from pagedllm.attention.backend import CommonAttentionMetadata
from pagedllm.attention.registry import get_attention_backend
from pagedllm.attention.torch_backend import dequantize_kv, quantize_kv, write_kv
from pagedllm.benchmarks.accuracy import greedy_agreement
from pagedllm.kernels.cpu import load_cpu_kernels

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = (E4M3, E5M2)
CACHE_DTYPES = (torch.float32, torch.bfloat16, E4M3, E5M2)


@pytest.fixture(scope="module")
def ops():
    m = load_cpu_kernels()
    assert m is not None, "the C++ CPU kernels did not build"
    return m


def _finite_codes(dtype: torch.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(codes, float64 values) of every finite, non-negative fp8 code of ``dtype``, by value."""
    codes = torch.arange(128, dtype=torch.uint8)
    vals = codes.view(dtype).double().numpy()
    keep = np.isfinite(vals)
    order = np.argsort(vals[keep], kind="stable")
    return codes.numpy()[keep][order], vals[keep][order]


def _nearest_even(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Brute-force reference: the fp8 code nearest to each float64 ``x`` (ties to the even
    code, i.e. even mantissa), finite values beyond the largest finite one and infinities
    saturated; NaN -> 0x7f | sign. OCP OFP8 rev. 1.0 round-to-nearest-even with
    saturation."""
    codes, vals = _finite_codes(dtype)
    out = np.empty(x.shape, dtype=np.uint8)
    a = np.abs(x)
    sign = np.where(np.signbit(x), 0x80, 0).astype(np.uint8)
    nan = np.isnan(x)
    a = np.where(nan, 0, np.minimum(a, vals[-1]))
    hi = np.clip(np.searchsorted(vals, a, side="left"), 0, len(vals) - 1)   # first >= a
    lo = np.clip(hi - 1, 0, None)
    d_lo, d_hi = a - vals[lo], vals[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (codes[hi] % 2 == 0))
    pick_hi |= vals[hi] == a
    out[:] = np.where(pick_hi, codes[hi], codes[lo])
    out |= sign
    out[nan] = 0x7f | sign[nan]
    return out


def _edge_values(dtype: torch.dtype) -> torch.Tensor:
    """float32 values that probe a format: every finite value, the midpoints between
    neighbours and their float32 neighbours, subnormals and half the least one, values
    around and far past the largest finite one, infinities, float32 subnormals, zeros,
    and random values over the format's range; all with both signs."""
    if dtype in FP8:
        _, vals = _finite_codes(dtype)
        v = torch.tensor(vals, dtype=torch.float32)
        mid = (v[1:] + v[:-1]) / 2              # exact in float32 (fp8 has 2-3 mantissa bits)
        mx = torch.finfo(dtype).max
        parts = [v, mid, torch.nextafter(mid, torch.tensor(np.inf)), torch.nextafter(mid, torch.tensor(-np.inf)),
                 v[1:2] / 2, v[1:2] / 4, v[1:2] * 0.75,
                 torch.tensor([mx * 1.03, mx * 1.07, mx * 1.0625, mx * 1.2, mx * 64, 1e30, float("inf")])]
    else:
        parts = [torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, 3e38, 1e-40, 65504.0, float("inf")])]
    g = torch.Generator().manual_seed(0)
    mx = float(torch.finfo(dtype).max) if dtype in FP8 else 1e4
    parts += [torch.tensor([0.0, 1e-45, 1e-39]),
              torch.randn(3000, generator=g) * torch.logspace(-12, np.log2(mx), 3000, base=2)]
    x = torch.cat(parts).float()
    return torch.cat([x, -x])


def _torch_ref(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """What the cache should hold: torch's conversion of x / scale, saturated for fp8."""
    y = x.float() / scale
    if dtype in FP8:
        y = y.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max)
    return y.to(dtype)


def _codes(t: torch.Tensor) -> torch.Tensor:
    """The stored bits, comparable with torch.equal (NaN codes included)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16 if t.element_size() == 2
                                                                        else torch.int32)


@pytest.mark.parametrize("dtype", FP8)
def test_torch_fp8_conversion_is_nearest_even_with_saturation(dtype):
    """The reference itself: torch's conversion after clamping equals a brute-force
    nearest-even rounding over every fp8 value, and no finite input gives NaN or inf."""
    x = _edge_values(dtype)
    got = _torch_ref(x, dtype).view(torch.uint8).numpy()
    want = _nearest_even(x.double().numpy(), dtype)
    bad = np.flatnonzero(got != want)
    assert not len(bad), f"{len(bad)} differ, e.g. x={x[bad[0]].item()!r}: {got[bad[0]]:#x} vs {want[bad[0]]:#x}"
    finite = torch.isfinite(x)
    assert torch.isfinite(_torch_ref(x, dtype)[finite].float()).all()


def _write_with(backend_name: str, x: torch.Tensor, dtype: torch.dtype, model_dtype: torch.dtype,
                scale: float, ops=None) -> torch.Tensor:
    """Write ``x`` (as K and as V rows of 8 kv heads x 8 dims, in ``model_dtype``) into
    fresh caches of ``dtype`` through the C++ op or the torch backend's helpers; returns
    the K cache (rows in x's order), after checking V got the same codes."""
    n = -(-x.numel() // 64) * 64
    xp = torch.zeros(n)
    xp[:x.numel()] = x
    k = xp.view(-1, 8, 8).to(model_dtype)
    T = k.shape[0]
    slots = torch.randperm(T + 5, generator=torch.Generator().manual_seed(1))[:T]
    kc = torch.zeros(T + 5, 8, 8, dtype=dtype)
    vc = torch.zeros(T + 5, 8, 8, dtype=dtype)
    if backend_name == "cpu_kernel":
        ops.reshape_and_cache(k, k, kc, vc, slots, scale, scale)
    else:
        write_kv(kc, slots, quantize_kv(k, dtype, scale))
        write_kv(vc, slots, quantize_kv(k, dtype, scale))
    assert torch.equal(_codes(kc), _codes(vc))
    return kc[slots].reshape(-1)[:x.numel()]


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize("backend_name", ["cpu_kernel", "torch"])
@pytest.mark.parametrize("scale", [1.0, 0.37, 4.0])
def test_write_stores_torch_codes(ops, backend_name, dtype, model_dtype, scale):
    """K/V writes into a cache of each dtype store exactly torch's codes for x / scale
    (rounded to the model dtype first, as the model hands it over); NaN stays NaN.
    scale 0.37 also probes true division: values whose quotient lies within a few ulps
    of an fp8 rounding midpoint (x / s and x * (1 / s) differ there)."""
    x = _edge_values(dtype)
    if scale != 1.0 and dtype in FP8:
        _, vals = _finite_codes(dtype)
        mid = torch.tensor((vals[1:] + vals[:-1]) / 2, dtype=torch.float32)
        near = (mid * scale).float()
        for _ in range(3):
            near = torch.cat([near, torch.nextafter(near, torch.tensor(np.inf)),
                              torch.nextafter(near, torch.tensor(-np.inf))])
        x = torch.cat([x, near, -near])
    x = torch.cat([x, torch.tensor([float("nan")])])
    x = x.to(model_dtype).float()
    got = _write_with(backend_name, x, dtype, model_dtype, scale, ops)
    want = _torch_ref(x, dtype, scale)
    nan = torch.isnan(want.float())
    assert torch.equal(_codes(got)[~nan], _codes(want)[~nan])
    # NaN stays NaN (its bits differ between torch's own bfloat16 conversions: 0x7fc0 or 0xffff)
    assert torch.isnan(got.float()[nan]).all() and nan.any()
    if dtype in FP8:
        assert torch.isfinite(got.float()[torch.isfinite(x)]).all(), "a finite input became NaN or inf"


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("hd", [64, 32])
def test_kernel_reads_every_fp8_code_exactly(ops, dtype, model_dtype, hd):
    """Every finite code, read by the attention kernel (AVX2 path: head_dim 64; generic:
    32), comes out as its exact value: one-token contexts, so each output row is the V
    row (softmax weight exactly 1), times v_scale (a power of two: exact)."""
    codes = torch.arange(256, dtype=torch.uint8)
    vals = codes.view(dtype).float()
    codes = codes[torch.isfinite(vals)]
    nkv = nh = -(-codes.numel() // hd)
    v_rows = torch.zeros(nkv * hd, dtype=torch.uint8)
    v_rows[:codes.numel()] = codes
    kc = torch.zeros(16, nkv, hd, dtype=dtype)
    vc = torch.zeros(16, nkv, hd, dtype=dtype)
    vc.view(torch.uint8)[3] = v_rows.view(nkv, hd)              # block 0, slot 3
    q = torch.randn(1, nh, hd).to(model_dtype)
    out = torch.empty_like(q)
    qsl, sl = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    # a one-token context is slot 0 of its first block: point the block table past slot 3
    # by using block size 1 (block 3 = slot 3)
    bt = torch.tensor([[3]], dtype=torch.int32)
    ops.paged_attention(out, q, kc, vc, bt, qsl, sl, 1, 0.125, 1.0, 0.5)
    want = (v_rows.view(dtype).float() * 0.5).view(1, nh, hd)
    assert torch.equal(out.float()[0].reshape(-1)[:codes.numel()], want.reshape(-1)[:codes.numel()])


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize("hd", [64, 24])
def test_kernel_matches_torch_backend_on_the_same_cache(dtype, model_dtype, hd):
    """The C++ kernel and the torch backend, given the same cache of each dtype (k_scale
    0.37 and v_scale 2.5 for fp8), write the same codes and agree on the attention output
    (decodes, chunks over cached context, a fresh prompt); both agree with the naive
    float32 reference over the dequantized cache."""
    c, layer_cache, q, k, v, info = _batch(seed=2, nh=9 if hd == 64 else 6, nkv=3, hd=hd)
    ks, vs = (0.37, 2.5) if dtype in FP8 else (1.0, 1.0)
    q, k, v = q.to(model_dtype), k.to(model_dtype), v.to(model_dtype)
    cache = torch.stack([quantize_kv(layer_cache[0], dtype, ks), quantize_kv(layer_cache[1], dtype, vs)])
    outs, caches = {}, {}
    for name in ("torch", "cpu_kernel"):
        backend = get_attention_backend(name, torch.device("cpu"), model_dtype, dtype)
        if name == "cpu_kernel":
            assert backend.kernels is not None and "C++" in backend.describe()
        cc = cache.clone()
        outs[name] = backend.forward(q, k, v, cc, backend.build_metadata(c), hd ** -0.5, ks, vs).float()
        caches[name] = cc
    assert torch.equal(_codes(caches["torch"]), _codes(caches["cpu_kernel"]))
    deq = torch.stack([dequantize_kv(caches["torch"][0], torch.float32, ks),
                       dequantize_kv(caches["torch"][1], torch.float32, vs)])
    # the reference attends over what the cache holds, the new tokens included
    kq = dequantize_kv(quantize_kv(k, dtype, ks), torch.float32, ks)
    vq = dequantize_kv(quantize_kv(v, dtype, vs), torch.float32, vs)
    ref, _ = _naive(deq, q.float(), kq, vq, c, info, hd ** -0.5)
    tol = 1e-5 if model_dtype == torch.float32 else 2e-2
    assert (outs["cpu_kernel"] - outs["torch"]).abs().max().item() < tol
    assert (outs["cpu_kernel"] - ref).abs().max().item() < tol


@pytest.mark.parametrize("dtype", [E4M3, E5M2, torch.bfloat16])
def test_kernel_fp8_cache_is_batch_and_chunk_invariant(dtype):
    """With a quantized cache too, a decode alone equals the same decode in a batch, and a
    prompt chunk computed one query at a time equals the whole chunk, bit for bit."""
    from attention_helpers import _one_request

    c, layer_cache, q, k, v, info = _batch()
    cache = torch.stack([quantize_kv(layer_cache[0], dtype, 0.5), quantize_kv(layer_cache[1], dtype, 0.5)])
    backend = get_attention_backend("cpu_kernel", torch.device("cpu"), torch.float32, dtype)
    full = backend.forward(q, k, v, cache.clone(), backend.build_metadata(c), 0.125, 0.5, 0.5)
    bt, seq, ctx, qlens, qsl, bs = info
    one = _one_request(c, info, 3, 0, 1)
    alone = backend.forward(q[3:4], k[3:4], v[3:4], cache.clone(), backend.build_metadata(one), 0.125, 0.5, 0.5)
    assert torch.equal(alone[0], full[3])
    i, t0 = 8, qsl[8]
    cc, parts = cache.clone(), []
    for a in range(qlens[i]):
        md = backend.build_metadata(_one_request(c, info, i, a, a + 1))
        parts.append(backend.forward(q[t0 + a:t0 + a + 1], k[t0 + a:t0 + a + 1], v[t0 + a:t0 + a + 1], cc, md,
                                     0.125, 0.5, 0.5))
    assert torch.equal(torch.cat(parts), full[qsl[i]:qsl[i + 1]])


def test_torch_backend_prompt_reads_its_own_keys_as_cached():
    """The torch backend's fresh prompt attends over its K/V as the fp8 cache holds them:
    the same prompt split into a cached chunk and a second chunk gives the same output."""
    T, nh, nkv, hd, bs = 12, 4, 2, 16, 4
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(T, n, hd, generator=g) for n in (nh, nkv, nkv))
    backend = get_attention_backend("torch", torch.device("cpu"), torch.float32, E4M3)

    def md(q0, q1):
        n, bt = q1 - q0, np.array([[0, 1, 2]], dtype=np.int32)
        pos = np.arange(q0, q1)
        slot = torch.from_numpy(bt[0, pos // bs].astype(np.int64) * bs + pos % bs)
        return backend.build_metadata(CommonAttentionMetadata(
            1, n, int(n == 1), torch.tensor([0, n], dtype=torch.int32), torch.tensor([q1], dtype=torch.int32),
            torch.tensor([q0], dtype=torch.int32), torch.from_numpy(bt), slot, bs, np.array([0, n]),
            np.array([q1]), np.array([q0]), bt))

    cache = torch.zeros(2, 3 * bs, nkv, hd, dtype=E4M3)
    whole = backend.forward(q, k, v, cache.clone(), md(0, T), 0.25, 0.5, 0.5)
    first = backend.forward(q[:5], k[:5], v[:5], cache, md(0, 5), 0.25, 0.5, 0.5)
    rest = backend.forward(q[5:], k[5:], v[5:], cache, md(5, T), 0.25, 0.5, 0.5)
    torch.testing.assert_close(torch.cat([first, rest]), whole, rtol=1e-6, atol=1e-6)


def test_kernel_rejects_bad_scales(ops):
    c, layer_cache, q, k, v, info = _batch()
    backend = get_attention_backend("cpu_kernel", torch.device("cpu"), torch.float32, E4M3)
    cache = layer_cache.to(E4M3)
    for ks in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(RuntimeError, match="k_scale and v_scale"):
            backend.forward(q, k, v, cache.clone(), backend.build_metadata(c), 0.125, ks, 1.0)


# --------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------
def test_kv_cache_dtype_names():
    from pagedllm.config import resolve_kv_cache_dtype

    cpu = torch.device("cpu")
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, cpu) == torch.bfloat16
    assert resolve_kv_cache_dtype("auto", torch.float32, cpu) == torch.float32
    assert resolve_kv_cache_dtype("fp8", torch.float32, cpu) == E4M3
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16, cpu) == E4M3
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.float32, cpu) == E5M2
    assert resolve_kv_cache_dtype("bfloat16", torch.float32, cpu) == torch.bfloat16
    assert resolve_kv_cache_dtype("float32", torch.bfloat16, cpu, "torch") == torch.float32
    for bad in ("fp16", "int8", "FP8", ""):
        with pytest.raises(ValueError, match="kv_cache_dtype") as e:
            resolve_kv_cache_dtype(bad, torch.float32, cpu)
        assert e.value.param == "kv_cache_dtype"


def test_backend_that_cannot_read_the_cache_is_refused(monkeypatch):
    from pagedllm.attention.torch_backend import TorchAttentionBackend
    from pagedllm.config import resolve_kv_cache_dtype

    monkeypatch.setattr(TorchAttentionBackend, "kv_cache_dtypes", (torch.float32, torch.bfloat16))
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8_e5m2' .*'torch' attention backend"):
        resolve_kv_cache_dtype("fp8_e5m2", torch.float32, torch.device("cpu"), "torch")
    with pytest.raises(ValueError, match="not supported by the 'torch'"):
        get_attention_backend("torch", torch.device("cpu"), torch.float32, E5M2)


def test_engine_args_and_cli():
    import argparse

    from pagedllm.config import EngineArgs

    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(kv_cache_dtype="fp4").validate()
    EngineArgs(kv_cache_dtype="fp8").validate()
    p = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(p.parse_args(["--kv-cache-dtype", "fp8_e5m2"])).kv_cache_dtype == "fp8_e5m2"
    assert EngineArgs.from_cli_args(p.parse_args([])).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-cache-dtype", "int4"])
    from pagedllm.entrypoints.cli import build_parser

    for cmd in (["serve"], ["generate", "hi"], ["bench", "throughput"]):
        args = build_parser().parse_args(cmd + ["--kv-cache-dtype", "fp8"])
        assert EngineArgs.from_cli_args(args).kv_cache_dtype == "fp8"


@pytest.fixture(scope="module")
def scaled_tiny_dir(tiny_model_dir, tmp_path_factory):
    """A tiny random Llama (2 layers) whose checkpoint carries KV-cache scales in vLLM's
    names: layer 0 as llm-compressor writes them, layer 1 as ModelOpt does."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("tiny-scaled") / "hf"     # a copy: the factory's directory is shared
    shutil.copytree(tiny_model_dir("llama", std=None, max_position_embeddings=512), path)
    f = path / "model.safetensors"
    w = load_file(str(f))
    w["model.layers.0.self_attn.k_scale"] = torch.tensor(0.25)
    w["model.layers.0.self_attn.v_scale"] = torch.tensor(0.125)
    w["model.layers.1.self_attn.k_proj.k_scale"] = torch.tensor([0.5])
    w["model.layers.1.self_attn.v_proj.v_scale"] = torch.tensor(2.0)
    save_file(w, str(f), metadata={"format": "pt"})
    return str(path)


def test_checkpoint_scales_reach_the_layers(scaled_tiny_dir):
    """k_scale / v_scale tensors of the checkpoint are loaded into their layers and used
    with an fp8 cache only; the start-up line names them; an fp8 cache holds 4x the
    blocks of a float32 one in the same memory, a bfloat16 cache 2x."""
    from engine_helpers import engine_core, model_runner

    from pagedllm import LLM, SamplingParams
    from pagedllm.layers.attention import Attention

    blocks = {}
    for kv in ("auto", "bfloat16", "fp8_e4m3"):
        llm = LLM(model=scaled_tiny_dir, dtype="float32", device="cpu", kv_cache_memory="8MiB",
                  max_model_len=256, kv_cache_dtype=kv, engine_process=False)
        try:
            runner = model_runner(llm.llm_engine)
            layers = [m for m in runner.model.modules() if isinstance(m, Attention)]
            assert [(m.k_scale, m.v_scale) for m in layers] == [(0.25, 0.125), (0.5, 2.0)]
            fp8 = kv.startswith("fp8")
            assert [m._scales for m in layers] == ([(0.25, 0.125), (0.5, 2.0)] if fp8 else [(1.0, 1.0)] * 2)
            assert runner.kv_cache.dtype == {"auto": torch.float32, "bfloat16": torch.bfloat16,
                                             "fp8_e4m3": E4M3}[kv]
            if fp8:
                assert "k_scale 0.25-0.5, v_scale 0.125-2 (checkpoint)" in runner.describe_compute_path()
            blocks[kv] = engine_core(llm.llm_engine).kv.num_blocks
            out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                               use_tqdm=False)
            assert len(out[0].outputs[0].token_ids) == 4
        finally:
            llm.shutdown()
    # 8 MiB / (K and V x 2 layers x 16 tokens x 2 kv heads x 64 dims x element size)
    assert blocks == {"auto": 256, "bfloat16": 512, "fp8_e4m3": 1024}


def test_bad_checkpoint_scale_is_an_error(tmp_path):
    from pagedllm.layers.attention import Attention, kv_scale_target

    assert kv_scale_target("model.layers.3.self_attn.k_scale") == ("model.layers.3.self_attn.attn", ("k_scale",))
    assert kv_scale_target("model.layers.3.self_attn.v_proj.v_scale") == ("model.layers.3.self_attn.attn",
                                                                          ("v_scale",))
    assert kv_scale_target("model.layers.3.self_attn.attn.k_scale") == ("model.layers.3.self_attn.attn",
                                                                        ("k_scale",))
    assert kv_scale_target("model.layers.3.self_attn.kv_scale") == ("model.layers.3.self_attn.attn",
                                                                    ("k_scale", "v_scale"))
    assert kv_scale_target("model.layers.3.self_attn.k_proj.weight_scale") is None
    a = Attention(4, 64, 0.125, 2, 0, torch.float32, torch.device("cpu"))
    for bad in (torch.tensor(0.0), torch.tensor(-1.0), torch.tensor(float("nan")), torch.ones(2)):
        with pytest.raises(ValueError, match="w.k_scale"):
            a.set_kv_scale("k_scale", bad, "w.k_scale")
    a.set_kv_scale("v_scale", torch.tensor(3.0, dtype=torch.bfloat16), "w.v_scale")
    assert a.v_scale == 3.0


# --------------------------------------------------------------------------------------
# The bundled model with narrower caches
# --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_bundled_model_greedy_text_with_narrower_caches(make_llm, mixed_prompts):
    """SmolLM2-135M in float32, greedy, 48 tokens on 8 prompts, KV cache in bfloat16 and
    fp8 E4M3 (scale 1.0: its K/V reach |k| <= ~19, |v| <= ~11 on these prompts, far
    inside E4M3's 448) against the float32 cache.

    bfloat16 rounds K/V by at most 2^-9 relative, which moves logits by ~1e-3: greedy
    paths split only where two tokens are that close. Measured: all 8 continuations
    identical over all 48 tokens; asserted: every prompt identical for 32 tokens.
    E4M3 rounds by up to 2^-4 relative: continuations split at the first close call.
    Measured leading agreement: 48, 5, 19, 48, 16, 1, 20, 33 tokens; asserted: at least
    half the prompts keep 16 tokens and 6 of 8 the first token (a wrong scale or a
    misread format gives unrelated text from the first token on)."""
    from engine_helpers import greedy

    prompts = mixed_prompts[:8]
    kw = dict(max_model_len=1024, kv_cache_memory="512MiB")
    ref = [o.outputs[0].token_ids for o in make_llm(**kw).generate(prompts, greedy(48), use_tqdm=False)]
    agree = {}
    for kv in ("bfloat16", "fp8_e4m3"):
        outs = make_llm(**kw, kv_cache_dtype=kv).generate(prompts, greedy(48), use_tqdm=False)
        agree[kv] = [greedy_agreement(r, o.outputs[0].token_ids) for r, o in zip(ref, outs)]
    print(f"leading tokens equal to the float32 cache's: {agree}")
    assert min(agree["bfloat16"]) >= 32, agree
    assert sum(n >= 16 for n in agree["fp8_e4m3"]) >= 4, agree
    assert sum(n >= 1 for n in agree["fp8_e4m3"]) >= 6, agree
