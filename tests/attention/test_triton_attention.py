"""The Triton attention backend (``triton``) against the torch backend, on the CPU in the
Triton interpreter: the same cache and metadata in, the same cache bytes and (to rounding)
the same outputs out, for decodes (2D and split-K), prompts, prompt chunks over a cached
prefix, chunked prefill, mixed batches, speculative verification, GQA, sliding windows,
head sizes 64/80 (128/256 slow), fp8 caches with scales, and CUDA-graph padding.

``@triton.jit`` picks the interpreter when a function is defined (triton 3.9 reads
``TRITON_INTERPRET`` at decoration), Triton's own helpers (``tl.zeros``, ``tl.max``) included
when triton is imported: so this module sets the variable before importing triton (it stays
set for the process), and where triton was imported earlier without it, the tests run here
are skipped and ``test_in_a_fresh_process`` runs this file in a new process. No bfloat16:
the interpreter's bf16 ``tl.dot`` is wrong (triton issue 11584)."""
from __future__ import annotations

import importlib
import os
import pathlib
import subprocess
import sys

if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"        # before triton's own @jit helpers are defined

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import pagedllm  # noqa: E402
from pagedllm.attention.backend import build_common_metadata  # noqa: E402
from pagedllm.attention.registry import get_attention_backend  # noqa: E402
from pagedllm.attention.torch_backend import TorchAttentionBackend, quantize_kv, write_kv  # noqa: E402
from pagedllm.attention.triton_backend import TritonAttentionBackend  # noqa: E402,F401  (registers "triton")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CPU = torch.device("cpu")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}
# float16 repeats of the float32 cases run in the full suite only (the interpreter is slow)
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16", marks=pytest.mark.slow)]


# whether Triton runs interpreted in this process (False: triton was imported before)
IN_PROCESS = isinstance(tl.zeros, InterpretedFunction)


@pytest.fixture(scope="module")
def ops():
    """The kernel module, its kernels interpreted (reloaded if imported before)."""
    from pagedllm.kernels import triton_attention
    if not isinstance(triton_attention._attention_kernel, InterpretedFunction):
        importlib.reload(triton_attention)
    return triton_attention


@pytest.fixture(autouse=True)
def _interpreted(request):
    if request.node.originalname == "test_in_a_fresh_process":
        return
    if not IN_PROCESS:
        pytest.skip("triton was imported without TRITON_INTERPRET=1: test_in_a_fresh_process runs these")
    request.getfixturevalue("ops")


def test_in_a_fresh_process(request):
    """Where triton was imported without the interpreter, this file in a new process."""
    if IN_PROCESS:
        pytest.skip("Triton is interpreted in this process: the tests ran here")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
           "-k", "not test_in_a_fresh_process"]
    if request.config.getoption("markexpr"):
        cmd += ["-m", request.config.getoption("markexpr")]
    r = subprocess.run(cmd, env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True,
                       timeout=900, cwd=pathlib.Path(__file__).parents[2])
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]


def _batch(ctx, qlens, nh=4, nkv=2, hd=64, bs=16, dtype=torch.float32, kv_dtype=None, seed=0):
    """One batch as the runner builds it (blocks scattered over the cache; decodes first
    is the caller's order): (common metadata, layer cache [2, slots, nkv, hd], q, k, v with
    q/k/v strided views of one fused qkv tensor, as the model's projections give)."""
    rng = np.random.default_rng(seed)
    ctx, qlens = np.array(ctx, dtype=np.int64), np.array(qlens, dtype=np.int64)
    nblk = -(-(ctx + qlens) // bs)
    num_blocks = int(nblk.sum()) + 3
    perm = rng.permutation(num_blocks)
    bt = np.zeros((len(qlens), int(nblk.max())), dtype=np.int32)
    starts = np.concatenate([[0], np.cumsum(nblk)])
    for i in range(len(qlens)):
        bt[i, :nblk[i]] = perm[starts[i]:starts[i + 1]]
    common, _, _ = build_common_metadata(ctx, qlens, bt, bs, CPU)
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, num_blocks * bs, nkv, hd, generator=g)
    cache = quantize_kv(cache, kv_dtype or dtype)            # what a cache of that dtype holds
    T = int(qlens.sum())
    qkv = torch.randn(T, (nh + 2 * nkv) * hd, generator=g).to(dtype)
    q = qkv[:, :nh * hd].view(T, nh, hd)
    k = qkv[:, nh * hd:(nh + nkv) * hd].view(T, nkv, hd)
    v = qkv[:, (nh + nkv) * hd:].view(T, nkv, hd)
    return common, cache, q, k, v


def _bits(t):
    return t.view(torch.uint8)


def _run_both(common, cache, q, k, v, window=None, split_kv=None, k_scale=1.0, v_scale=1.0):
    """(torch backend's output and cache, Triton backend's output and cache) for one step."""
    dtype, kv_dtype = q.dtype, cache.dtype
    hd = q.shape[2]
    ref_backend = TorchAttentionBackend(CPU, dtype, kv_dtype)
    backend = get_attention_backend("triton", CPU, dtype, kv_dtype)
    ref_cache, tri_cache = cache.clone(), cache.clone()
    ref = ref_backend.forward(q, k, v, ref_cache, ref_backend.build_metadata(common, window), hd ** -0.5,
                              k_scale, v_scale)
    md = backend.build_metadata(common, window)
    md.split_kv = split_kv
    out = backend.forward(q, k, v, tri_cache, md, hd ** -0.5, k_scale, v_scale)
    return ref, ref_cache, out, tri_cache


def _check(common, cache, q, k, v, **kw):
    ref, ref_cache, out, tri_cache = _run_both(common, cache, q, k, v, **kw)
    assert out.dtype == q.dtype and out.shape == (q.shape[0], q.shape[1] * q.shape[2])
    assert torch.equal(_bits(tri_cache), _bits(ref_cache))     # K/V written exactly as torch's
    torch.testing.assert_close(out, ref, **TOL[q.dtype])
    return out


MIXED = dict(ctx=[5, 40, 17, 20, 0], qlens=[1, 1, 1, 7, 33])       # decodes, chunk on a prefix, prompt
CASES = {
    "decodes_2d": (dict(ctx=[5, 40, 17, 70], qlens=[1, 1, 1, 1]), dict(split_kv=False)),
    "decodes_split_k": (dict(ctx=[5, 40, 70], qlens=[1, 1, 1]), dict(split_kv=True)),
    "prefill_no_context": (dict(ctx=[0], qlens=[37]), {}),
    "prefill_chunk_over_prefix": (dict(ctx=[35], qlens=[20]), {}),
    "mixed": (MIXED, {}),
    "mixed_split_k": (MIXED, dict(split_kv=True)),          # forced: the kernel takes any batch
    "spec_verify": (dict(ctx=[30, 9, 50], qlens=[3, 5, 4]), {}),
    "gqa_8_1": (dict(MIXED, nh=8, nkv=1), {}),
    "gqa_6_2": (dict(MIXED, nh=6, nkv=2), {}),              # 3 query heads per KV head
    "sliding_window": (dict(ctx=[50, 40, 20, 0], qlens=[1, 1, 7, 33]), dict(window=8)),
    "sliding_window_split_k": (dict(ctx=[50, 9, 33], qlens=[1, 1, 1]), dict(window=20, split_kv=True)),
    "head_dim_80": (dict(MIXED, hd=80), {}),
    "block_size_32": (dict(MIXED, bs=32), {}),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_torch_backend(case, dtype):
    batch, kw = CASES[case]
    _check(*_batch(**batch, dtype=dtype), **kw)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("hd", [128, 256])
def test_large_head_dims(hd, dtype):
    _check(*_batch(**MIXED, hd=hd, dtype=dtype))
    _check(*_batch(ctx=[5, 40, 70], qlens=[1, 1, 1], hd=hd, dtype=dtype), split_kv=True)


@pytest.mark.slow
def test_long_decode_takes_split_k_by_the_heuristic(ops):
    common, *rest = _batch(ctx=[300], qlens=[1], nh=8, nkv=1)
    assert ops.use_split_kv(1, int(common.seq_lens_np.max()))
    _check(common, *rest)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_fp8_cache_with_scales(kv_dtype, dtype):
    """Bytes equal to quantize_kv's (checked in _check), outputs close to the torch
    backend's over the same bytes; split-K over an fp8 cache too."""
    _check(*_batch(**MIXED, dtype=dtype, kv_dtype=kv_dtype), k_scale=0.37, v_scale=2.3)
    _check(*_batch(ctx=[5, 40, 70], qlens=[1, 1, 1], dtype=dtype, kv_dtype=kv_dtype),
           split_kv=True, k_scale=0.37, v_scale=2.3)


def test_chunked_prefill_across_steps():
    """A 45-token prompt in chunks of 16, 16 and 13 (each step over the K/V the earlier
    wrote) gives the whole prompt's outputs and cache."""
    common, cache, q, k, v = _batch(ctx=[0], qlens=[45])
    ref, ref_cache, _, _ = _run_both(common, cache, q, k, v)
    backend = get_attention_backend("triton", CPU, torch.float32)
    bt = common.block_table_np
    tri_cache, parts = cache.clone(), []
    for a, b in [(0, 16), (16, 32), (32, 45)]:
        c, _, _ = build_common_metadata(np.array([a]), np.array([b - a]), bt, 16, CPU)
        parts.append(backend.forward(q[a:b], k[a:b], v[a:b], tri_cache, backend.build_metadata(c), 64 ** -0.5))
    torch.testing.assert_close(torch.cat(parts), ref, **TOL[torch.float32])
    assert torch.equal(tri_cache, ref_cache)


def _pad(common, q, k, v, extra_tokens):
    """The batch padded as a CUDA graph pads it: ``extra_tokens`` more tokens (slot -1) and
    one more request with no queries (query_start_loc repeats, seq_len 0, block row 0)."""
    md = get_attention_backend("triton", CPU, q.dtype).build_metadata(common)
    T = q.shape[0]
    pad = lambda x: torch.cat([x, torch.randn(extra_tokens, *x.shape[1:]).to(x.dtype)])  # noqa: E731
    md.slot_mapping = torch.cat([md.slot_mapping, torch.full((extra_tokens,), -1, dtype=torch.int64)])
    md.query_start_loc = torch.cat([md.query_start_loc, md.query_start_loc[-1:]])
    md.seq_lens = torch.cat([md.seq_lens, torch.zeros(1, dtype=torch.int32)])
    md.block_table = torch.cat([md.block_table, torch.zeros_like(md.block_table[:1])])
    return md, pad(q), pad(k), pad(v), T


@pytest.mark.parametrize("split_kv", [False, True], ids=["2d", "split_k"])
def test_padding_tokens_and_requests_are_skipped(split_kv):
    """Padding tokens (slot -1) write nothing; the real tokens' outputs are unchanged."""
    common, cache, q, k, v = _batch(ctx=[5, 40, 70], qlens=[1, 1, 1])
    ref, ref_cache, _, _ = _run_both(common, cache, q, k, v)
    md, qp, kp, vp, T = _pad(common, q, k, v, extra_tokens=3)
    md.split_kv = split_kv
    backend = get_attention_backend("triton", CPU, torch.float32)
    tri_cache = cache.clone()
    out = backend.forward(qp, kp, vp, tri_cache, md, 64 ** -0.5)
    assert torch.equal(tri_cache, ref_cache)
    torch.testing.assert_close(out[:T], ref, **TOL[torch.float32])


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")   # to fp16: inf, as torch
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2, "same", "other"])
@pytest.mark.parametrize("scale", [1.0, 0.37, 3.3])
def test_reshape_and_cache_bytes_equal_quantize_kv(ops, kv_dtype, dtype, scale):
    """The K/V write stores quantize_kv's codes bit for bit: fp8 midpoints between codes and
    their float32 neighbours, subnormals, saturation, +-inf, NaN, -0.0, random values over
    the range; strided rows; slot -1 skipped and other slots untouched."""
    kv_dtype = {"same": dtype, "other": torch.float16 if dtype == torch.float32 else torch.float32}.get(
        kv_dtype, kv_dtype)
    x = _edge_values(kv_dtype if kv_dtype in (E4M3, E5M2) else E5M2).to(dtype).float() * scale
    nkv, hd = 2, 64
    T = -(-x.numel() // (nkv * hd))
    rows = torch.zeros(T * nkv * hd)
    rows[:x.numel()] = x
    kv = torch.stack([rows, -rows], 1).view(T, nkv, hd, 2).to(dtype)    # k, v interleaved: strided
    key, value = kv[..., 0], kv[..., 1]
    slots = torch.randperm(T + 4, generator=torch.Generator().manual_seed(1))[:T].to(torch.int64)
    slots[::7] = -1
    fill = torch.randn(T + 4, nkv, hd).to(kv_dtype)
    kc, vc = fill.clone(), fill.clone()
    ops.reshape_and_cache(key, value, kc, vc, slots, scale, scale)
    rk, rv = fill.clone(), fill.clone()
    keep = slots >= 0
    write_kv(rk, slots[keep], quantize_kv(key[keep], kv_dtype, scale))
    write_kv(rv, slots[keep], quantize_kv(value[keep], kv_dtype, scale))
    assert torch.equal(_bits(kc), _bits(rk)) and torch.equal(_bits(vc), _bits(rv))


def _edge_values(fp8: torch.dtype) -> torch.Tensor:
    """float32 values probing an fp8 format (both signs): every code's value, midpoints and
    their neighbours, half the least subnormal, past the max, inf, NaN, zeros, random."""
    v = torch.arange(128, dtype=torch.uint8).view(fp8).float()
    v = v[torch.isfinite(v)].sort().values
    mid = (v[1:] + v[:-1]) / 2
    mx = torch.finfo(fp8).max
    g = torch.Generator().manual_seed(0)
    x = torch.cat([v, mid, torch.nextafter(mid, torch.tensor(np.inf)), torch.nextafter(mid, torch.tensor(-np.inf)),
                   torch.tensor([v[1] / 2, v[1] * 0.75, mx * 1.03, mx * 1.0625, mx * 64, 1e30, float("inf"),
                                 float("nan"), 0.0, 1e-39]),
                   torch.randn(1000, generator=g) * torch.logspace(-20, np.log2(mx), 1000, base=2)])
    return torch.cat([x, -x])


_FORBIDDEN = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero"}


@pytest.mark.parametrize("split_kv", [False, True], ids=["2d", "split_k"])
def test_forward_reads_no_device_value_on_the_host(split_kv):
    """CUDA-graph capturable: build_metadata passes the runner's tensors through (no new
    copies), and forward (K/V write and attention launches) never brings a device value to
    the host: no item/tolist/cpu/bool/int of a tensor, no transfer to the CPU, from any
    pagedllm frame (the interpreter's own copies are not ours)."""
    from torch.overrides import TorchFunctionMode

    root = str(pathlib.Path(pagedllm.__file__).parent)

    class HostReads(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.found = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            caller = sys._getframe(1).f_code
            name = getattr(func, "__name__", "")
            to_host = name in ("to", "copy_") and any(
                isinstance(a, (torch.device, str)) for a in (*args[1:], *kwargs.values()))
            if caller.co_filename.startswith(root) and (name in _FORBIDDEN or to_host):
                self.found.append(f"{name} in {caller.co_name} ({caller.co_filename}:{sys._getframe(1).f_lineno})")
            return func(*args, **kwargs)

    common, cache, q, k, v = _batch(**MIXED) if not split_kv else _batch(ctx=[5, 40, 70], qlens=[1, 1, 1])
    backend = get_attention_backend("triton", CPU, torch.float32)
    md = backend.build_metadata(common)
    assert md.slot_mapping is common.slot_mapping and md.block_table is common.block_table
    assert md.query_start_loc is common.query_start_loc and md.seq_lens is common.seq_lens
    md.split_kv = split_kv
    ref, *_ = _run_both(common, cache, q, k, v, split_kv=split_kv)
    with HostReads() as mode:
        out = backend.forward(q, k, v, cache.clone(), md, 64 ** -0.5)
    assert not mode.found, mode.found
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_preallocated_scratch_gives_the_same_result(ops):
    """Persistent split-K scratch (larger than the batch, as a CUDA graph's) gives the same
    bits as scratch allocated per call; scratch of the wrong shape is a ValueError."""
    common, cache, q, k, v = _batch(ctx=[5, 40, 70], qlens=[1, 1, 1])
    kc, vc = cache[0], cache[1]
    args = (common.query_start_loc, common.seq_lens, common.block_table, 16, 0.125)
    a, b = torch.empty_like(q), torch.empty_like(q)
    ops.unified_attention(q, kc, vc, a, *args, split_kv=True, num_segments=4)
    scratch = ops.split_kv_scratch(8, 4, 64, CPU, num_segments=4)
    ops.unified_attention(q, kc, vc, b, *args, split_kv=True, num_segments=4, scratch=scratch)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="scratch"):
        ops.unified_attention(q, kc, vc, b, *args, split_kv=True, scratch=scratch)   # 16 segments wanted


def test_split_k_heuristic(ops):
    """The decodes' launch splits when its longest sequence is long; never with a
    multi-token query or an unknown length; the batch size does not enter."""
    assert ops.use_split_kv(1, 4096) and ops.use_split_kv(1, ops.SPLIT_KV_MIN_SEQ_LEN)
    assert not ops.use_split_kv(2, 4096)                 # a prefill or spec tokens
    assert not ops.use_split_kv(1, ops.SPLIT_KV_MIN_SEQ_LEN - 1)
    assert not ops.use_split_kv(1, None)


def _alone_and_batched(ops, dtype, ctx, qlens, pick, split_kv=None, graph=False):
    """(request ``pick``'s output computed alone, the same in the batch ``ctx``/``qlens``):
    the same cache, keys and queries; ``graph``: the batch's metadata as a captured decode
    step builds it (``build_graph_metadata``)."""
    common, cache, q, k, v = _batch(ctx, qlens, nh=8, nkv=2, dtype=dtype)
    backend = get_attention_backend("triton", CPU, dtype)
    qsl = common.query_start_loc_np
    s, e = int(qsl[pick]), int(qsl[pick + 1])
    bt = common.block_table_np[pick:pick + 1]
    alone_common, _, _ = build_common_metadata(common.context_lens_np[pick:pick + 1].astype(np.int64),
                                               np.array([e - s]), bt, common.block_size, CPU)
    outs = []
    for c, rows, build in ((alone_common, slice(s, e), backend.build_metadata),
                           (common, slice(None), backend.build_graph_metadata if graph else backend.build_metadata)):
        md = build(c, None)
        if split_kv is not None:
            md.split_kv = split_kv
        cc = cache.clone()
        out = backend.forward(q[rows], k[rows], v[rows], cc, md, 0.125).view(-1, 8, 64)
        outs.append(out if rows == slice(s, e) else out[s:e])
    return outs


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_request_does_not_depend_on_its_batch(ops, dtype):
    """Bitwise: a short decode alone and beside a long one (which makes the decodes' launch
    split); a decode beside a prompt chunk; a prompt chunk beside decodes; a short decode in a
    captured step's metadata against eager."""
    alone, batched = _alone_and_batched(ops, dtype, [30, 400], [1, 1], 0)
    assert torch.equal(alone, batched), "short decode beside a long one"
    alone, batched = _alone_and_batched(ops, dtype, [400, 30], [1, 1], 0)
    assert torch.equal(alone, batched), "long decode beside a short one"
    alone, batched = _alone_and_batched(ops, dtype, [30, 20], [1, 24], 0)
    assert torch.equal(alone, batched), "decode beside a prompt chunk"
    alone, batched = _alone_and_batched(ops, dtype, [30, 20], [1, 24], 1)
    assert torch.equal(alone, batched), "prompt chunk beside a decode"
    alone, batched = _alone_and_batched(ops, dtype, [30, 12], [1, 1], 0, graph=True)
    assert torch.equal(alone, batched), "eager against a captured step's metadata"


def test_backend_contract(monkeypatch):
    """The torch backend's cache layout; the dtypes it takes; what the start-up log says;
    a CPU device refused without the interpreter, naming the option."""
    backend = get_attention_backend("triton", CPU, torch.float16, E4M3)
    args = (2, 10, 16, 4, 64)
    assert backend.kv_cache_shape(*args) == TorchAttentionBackend.kv_cache_shape(*args)
    kv = torch.zeros(backend.kv_cache_shape(*args))
    assert torch.equal(backend.layer_cache(kv, 1), TorchAttentionBackend.layer_cache(kv, 1))
    assert set(backend.kv_cache_dtypes) == set(TorchAttentionBackend.kv_cache_dtypes)
    assert backend.describe() == ("triton (unified paged attention, split-K decodes, float8_e4m3fn KV cache, "
                                  "Triton interpreter)")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="attention_backend 'triton'"):
        get_attention_backend("triton", CPU, torch.float32)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))   # an A100
    with pytest.raises(ValueError, match="fp8_e4m3 .* compute capability 8.9"):
        get_attention_backend("triton", torch.device("cuda"), torch.float16, E4M3)


_COMPILE_SM90 = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagedllm.kernels import triton_attention as ta

def compile_(fn, ptrs, **consts):
    sig = {a: "constexpr" if a in consts else ptrs.get(a, "*fp32") if a.endswith("_ptr")
           else "fp32" if "scale" in a else "i32" for a in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert k.metadata.shared <= 228 * 1024, k.metadata.shared

for q, cache, hd, group, block_q, tile, nseg in [("fp16", "fp16", 80, 4, 4, 32, 1), ("bf16", "fp8e4nv", 128, 8, 1, 16, 16),
                                                  ("fp16", "fp8e5", 256, 1, 16, 32, 1), ("fp32", "fp32", 64, 2, 8, 32, 1)]:
    compile_(ta._attention_kernel, dict(q_ptr="*" + q, out_ptr="*" + q, key_cache_ptr="*" + cache,
             value_cache_ptr="*" + cache, qsl_ptr="*i32", seq_lens_ptr="*i32", block_table_ptr="*i32"),
             NUM_HEADS=2 * group, GROUP=group, HEAD_DIM=hd, BLOCK_D=triton.next_power_of_2(hd), BLOCK_SIZE=16,
             BLOCK_Q=block_q, BLOCK_M=max(16, group), TILE_N=tile, NUM_SEGMENTS=nseg, FP8=cache.startswith("fp8"),
             DOT_PRECISION="ieee" if q == "fp32" else "tf32", num_reqs=1)   # an int of 1 is specialised
compile_(ta._reduce_segments_kernel, dict(out_ptr="*bf16", qsl_ptr="*i32"), NUM_HEADS=8, HEAD_DIM=80, BLOCK_D=128,
         NUM_SEGMENTS=16)
for q, cache, fp8 in [("bf16", "u8", (3, 7, 448.0, 0x7F)), ("fp16", "fp16", None)]:
    mant, bias, fmax, nan = fp8 or (0, 0, 0.0, 0)
    compile_(ta._reshape_and_cache_kernel, dict(key_ptr="*" + q, value_ptr="*" + q, key_cache_ptr="*" + cache,
             value_cache_ptr="*" + cache, slot_ptr="*i64"), NUM_KV_HEADS=8, HEAD_DIM=80, BLOCK_H=8, BLOCK_D=128,
             SCALED=fp8 is not None, FP8=fp8 is not None, MANT=mant, BIAS=bias, FMAX=fmax, NAN_CODE=nan)
'''


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    """What the interpreter cannot check: the kernels compile for an H100 (TTIR to cubin
    through Triton's own ptxas, no GPU needed) in bf16/fp16/fp32, over fp8 caches, with
    head sizes 80-256, and fit its shared memory. In a new process: here Triton is
    interpreted."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE_SM90], env=dict(env, TRITON_DEFAULT_FP_FUSION="1"),
                       capture_output=True, text=True, timeout=600, cwd=pathlib.Path(__file__).parents[2])
    if "ptxas" in r.stderr and "not found" in r.stderr.lower():
        pytest.skip("no ptxas with this Triton")
    assert r.returncode == 0, r.stderr[-4000:]


def test_interpreter_refuses_bfloat16():
    """The interpreter's bf16 tl.dot is wrong (triton issue 11584): refused, not garbage."""
    with pytest.raises(ValueError, match="bfloat16"):
        get_attention_backend("triton", CPU, torch.bfloat16)
