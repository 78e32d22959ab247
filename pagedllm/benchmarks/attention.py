"""``pagedllm bench attention``: decode attention time per step with the KV cache in each
``--kv-cache-dtype``, in one run (dtypes interleaved round by round). Reported per dtype:
median ms per layer, ms per decode step, K/V bytes a layer reads and the implied GB/s.

``--against REV``: the C++ kernel against itself at git revision REV, taking turns call by
call on the same caches; reports both medians, their ratio and bitwise equality.

Method: docs/notes/benchmarks.md.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import time

import numpy as np
import torch

from pagedllm.benchmarks.report import output_file, save_json
from pagedllm.benchmarks.serve_options import positive_int

# --kv-cache-dtype names this benchmark accepts -> how the model's dtype names them
_MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _decode_metadata(num_requests: int, context_len: int, block_size: int, seed: int,
                     contiguous: bool = False):
    """A decode batch of ``num_requests`` x (``context_len`` cached + 1 new) tokens over
    blocks scattered at random (``contiguous``: request after request). Returns (common
    metadata, number of blocks in the cache)."""
    from pagedllm.attention.backend import CommonAttentionMetadata

    seq = context_len + 1
    per_req = -(-seq // block_size)
    num_blocks = num_requests * per_req
    rng = np.random.default_rng(seed)
    order = np.arange(num_blocks) if contiguous else rng.permutation(num_blocks)
    bt = order.astype(np.int32).reshape(num_requests, per_req)
    qsl = np.arange(num_requests + 1, dtype=np.int64)
    seq_lens = np.full(num_requests, seq, dtype=np.int64)
    ctx = seq_lens - 1
    slot = bt[:, context_len // block_size].astype(np.int64) * block_size + context_len % block_size
    common = CommonAttentionMetadata(
        num_requests, num_requests, num_requests, torch.from_numpy(qsl.astype(np.int32)),
        torch.from_numpy(seq_lens.astype(np.int32)), torch.from_numpy(ctx.astype(np.int32)),
        torch.from_numpy(bt), torch.from_numpy(slot), block_size, qsl, seq_lens, ctx, bt)
    return common, num_blocks


class _Case:
    """One KV-cache dtype's backend, caches and inputs, ready to time (``_Case.time``)."""

    def __init__(self, kv_cache_dtype: str, model_dtype: torch.dtype, num_requests: int, context_len: int,
                 num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, cache_layers: int,
                 backend: str, seed: int, contiguous: bool = False):
        from pagedllm.attention.registry import get_attention_backend
        from pagedllm.attention.torch_backend import quantize_kv
        from pagedllm.config import resolve_kv_cache_dtype

        cpu = torch.device("cpu")
        kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, model_dtype, cpu, backend)
        self.attn = get_attention_backend(backend, cpu, model_dtype, kv_dtype)
        common, num_blocks = _decode_metadata(num_requests, context_len, block_size, seed, contiguous)
        self.md = self.attn.build_metadata(common)
        g = torch.Generator().manual_seed(seed)
        slots = num_blocks * block_size
        # one tensor for all layers, as the engine allocates it: [layers, 2, slots, kv_heads, head_dim]
        cache = torch.empty(self.attn.kv_cache_shape(cache_layers, num_blocks, block_size, num_kv_heads, head_dim),
                            dtype=kv_dtype)
        for layer in range(cache_layers):
            for kv in range(2):
                cache[layer, kv] = quantize_kv(torch.randn(slots, num_kv_heads, head_dim, generator=g), kv_dtype)
        self.layers = [self.attn.layer_cache(cache, i) for i in range(cache_layers)]
        self.q = torch.randn(num_requests, num_heads, head_dim, generator=g).to(model_dtype)
        self.k = torch.randn(num_requests, num_kv_heads, head_dim, generator=g).to(model_dtype)
        self.v = torch.randn(num_requests, num_kv_heads, head_dim, generator=g).to(model_dtype)
        self.scale = head_dim ** -0.5
        self.name = str(kv_dtype).removeprefix("torch.")
        self.kv_bytes = 2 * num_requests * (context_len + 1) * num_kv_heads * head_dim * cache.element_size()
        self.layout = (head_dim, block_size)
        self.times: list[float] = []

    def time(self) -> None:
        """One call per layer cache, each timed (seconds, appended to ``times``)."""
        for lc in self.layers:
            t = time.perf_counter()
            self.attn.forward(self.q, self.k, self.v, lc, self.md, self.scale)
            self.times.append(time.perf_counter() - t)

    def result(self) -> dict:
        ms = 1000 * statistics.median(self.times)
        return {"kv_cache_dtype": self.name, "backend": self.attn.describe(*self.layout), "layer_ms": round(ms, 3),
                "layer_ms_min": round(1000 * min(self.times), 3), "kv_bytes_per_layer": self.kv_bytes,
                "gb_per_s": round(self.kv_bytes / ms / 1e6, 2)}


def measure(kv_cache_dtypes: list[str], model_dtype: str = "float32", num_requests: int = 64,
            context_len: int = 1000, num_heads: int = 9, num_kv_heads: int = 3, head_dim: int = 64,
            block_size: int = 16, cache_layers: int = 4, iters: int = 5, backend: str = "cpu_kernel",
            seed: int = 0, contiguous: bool = False) -> list[dict]:
    """Time one layer's decode attention with a cache of each of ``kv_cache_dtypes``
    (``auto`` = ``model_dtype``), interleaved round by round.

    Returns:
        one dict per dtype: ``{"kv_cache_dtype", "backend", "layer_ms" (median),
        "layer_ms_min", "kv_bytes_per_layer", "gb_per_s"}``.

    Raises:
        ValueError: an unknown dtype name.
    """
    if model_dtype not in _MODEL_DTYPES:
        raise ValueError(f"model_dtype must be one of {', '.join(_MODEL_DTYPES)}, got {model_dtype!r}")
    cases = [_Case(name, _MODEL_DTYPES[model_dtype], num_requests, context_len, num_heads, num_kv_heads,
                   head_dim, block_size, cache_layers, backend, seed, contiguous) for name in kv_cache_dtypes]
    for c in cases:                         # warm-up: page faults, thread pool, code
        c.time()
        c.times.clear()
    for _ in range(iters):
        for c in cases:
            c.time()
    return [c.result() for c in cases]


def register(subparsers: "argparse._SubParsersAction") -> None:
    from pagedllm.config import KV_CACHE_DTYPES

    p = subparsers.add_parser("attention", help="decode attention time per step for each KV-cache dtype",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kv-cache-dtypes", default="float32,bfloat16,fp8_e4m3",
                   help=f"comma-separated, from: {', '.join(KV_CACHE_DTYPES)}")
    p.add_argument("--dtype", default="float32", choices=list(_MODEL_DTYPES), help="the model's dtype (q, k, v)")
    p.add_argument("--num-requests", type=positive_int, default=64)
    p.add_argument("--context-len", type=positive_int, default=1000, help="cached tokens per request")
    p.add_argument("--num-heads", type=positive_int, default=9)
    p.add_argument("--num-kv-heads", type=positive_int, default=3)
    p.add_argument("--head-dim", type=positive_int, default=64)
    p.add_argument("--num-layers", type=positive_int, default=30, help="layers in a model step (per-step time)")
    p.add_argument("--cache-layers", type=positive_int, default=4,
                   help="distinct layer caches timed in turn (memory: this many layers of KV)")
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--blocks", choices=["scattered", "contiguous"], default="scattered",
                   help="where each request's blocks lie: at random over the cache (an engine that has run a "
                        "while) or one after another (a fresh engine)")
    p.add_argument("--iters", type=positive_int, default=5, help="rounds over the cache layers")
    p.add_argument("--attention-backend", default="cpu_kernel")
    p.add_argument("--num-threads", type=positive_int, default=None)
    p.add_argument("--against", default=None, metavar="REV",
                   help="A/B this tree's C++ kernel against the one at git revision REV (built apart; "
                        "the two take turns call by call)")
    p.add_argument("--output-json", default=None, type=output_file)
    p.set_defaults(func=main)


# the files the paged-attention kernel is built from, and a binding of it alone
_KERNEL_FILES = ("paged_attention_cpu.cpp", "ops.h", "vec.h")
# built with it where the revision has them: the AMX tile helpers its q.k scores call
_KERNEL_FILES_SINCE = ("amx_linear.cpp",)
_BINDING = """#include <torch/extension.h>
#include "ops.h"
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, py::call_guard<py::gil_scoped_release>());
}
"""


def kernel_at_revision(rev: str):
    """The C++ paged-attention kernel (and its headers, and ``amx_linear.cpp`` where present)
    as of git revision ``rev`` of this checkout, compiled with the package's flags
    (``kernels.cpu.compile_module``, cached per revision and CPU): a module with
    ``paged_attention``.

    Raises:
        ValueError: no git checkout, ``rev`` lacks those files, or they do not compile.
    """
    from pagedllm.kernels.cpu import _cpu_tag, _extensions_root, compile_module

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    texts = {}
    for name in _KERNEL_FILES + _KERNEL_FILES_SINCE:
        try:
            r = subprocess.run(["git", "-C", root, "show", f"{rev}:pagedllm/kernels/csrc/{name}"],
                               capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ValueError(f"--against {rev!r}: cannot run git in {root} ({e})") from None
        if r.returncode != 0:
            if name in _KERNEL_FILES_SINCE:
                continue                # a revision from before the kernel needed it
            raise ValueError(f"--against {rev!r}: git cannot read pagedllm/kernels/csrc/{name} at that "
                             f"revision: {' '.join(r.stderr.split())}")
        texts[name] = r.stdout
    digest = hashlib.sha1("".join(texts[n] for n in texts).encode() + torch.__version__.encode())
    name = f"pagedllm_attn_ab_{digest.hexdigest()[:10]}_{_cpu_tag()}"
    build_dir = os.path.join(_extensions_root(), name)
    os.makedirs(build_dir, exist_ok=True)
    for fname, text in [*texts.items(), ("binding.cpp", _BINDING)]:
        path = os.path.join(build_dir, fname)
        if os.path.exists(path):
            with open(path) as f:
                if f.read() == text:
                    continue            # unchanged: the build is reused
        with open(path, "w") as f:
            f.write(text)
    if not os.path.exists(os.path.join(build_dir, f"{name}.so")):
        print(f"building the paged-attention kernel at {rev} in {build_dir} (once: ~30 s)", flush=True)
    try:
        sources = ["binding.cpp"] + [n for n in texts if n.endswith(".cpp")]
        return compile_module(name, [os.path.join(build_dir, n) for n in sources], build_dir, build_dir)
    except Exception as e:   # a compile error: cpp_extension's message carries the compiler output
        first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise ValueError(f"--against {rev!r}: the kernel at that revision does not build here ({first}; "
                         f"compiler output in {build_dir})") from None


def measure_against(reference, reference_name: str, kv_cache_dtypes: list[str], model_dtype: str = "float32",
                    num_requests: int = 64, context_len: int = 1000, num_heads: int = 9, num_kv_heads: int = 3,
                    head_dim: int = 64, block_size: int = 16, cache_layers: int = 4, iters: int = 5,
                    seed: int = 0, contiguous: bool = False) -> list[dict]:
    """A/B of this tree's C++ paged attention against ``reference`` (a module with the same
    ``paged_attention``) per dtype, on ``measure``'s batch: both kernels take turns over the
    layer-cache rotation (attention only, no K/V write).

    Returns:
        one dict per dtype: ``{"kv_cache_dtype", "layer_ms", "reference",
        "reference_layer_ms", "speedup" (reference / this tree), "bitwise_equal"}``.

    Raises:
        ValueError: an unknown or uncovered dtype, or a ``paged_attention`` with other
            arguments.
    """
    if model_dtype not in _MODEL_DTYPES:
        raise ValueError(f"model_dtype must be one of {', '.join(_MODEL_DTYPES)}, got {model_dtype!r}")
    results = []
    for kv_name in kv_cache_dtypes:
        c = _Case(kv_name, _MODEL_DTYPES[model_dtype], num_requests, context_len, num_heads, num_kv_heads,
                  head_dim, block_size, cache_layers, "cpu_kernel", seed, contiguous)
        ours = getattr(c.attn, "kernels", None)
        if ours is None:
            raise ValueError(f"--against: no C++ kernel here for a {c.name} cache ({c.attn.describe()})")
        md = c.md
        kernels = {"this tree": ours, reference_name: reference}
        outs = {k: torch.empty_like(c.q) for k in kernels}

        def call(kernel, layer, out):
            lc = c.layers[layer % len(c.layers)]
            kernel.paged_attention(out, c.q, lc[0], lc[1], md.block_table, md.query_start_loc, md.seq_lens,
                                   md.block_size, c.scale, 1.0, 1.0, 0)

        try:
            for k, m in kernels.items():
                call(m, 0, outs[k])
        except TypeError as e:   # pybind lists every argument after its first line
            raise ValueError(f"--against {reference_name}: its paged_attention takes other arguments than this "
                             f"tree's ({str(e).splitlines()[0]})") from None
        equal = torch.equal(outs["this tree"], outs[reference_name])
        times: dict[str, list[float]] = {k: [] for k in kernels}
        order = list(kernels.items())
        layer = 0
        for r in range(iters + 1):
            for _ in range(cache_layers):
                for k, m in (order if (r + layer) % 2 == 0 else order[::-1]):
                    t = time.perf_counter()
                    call(m, layer, outs[k])
                    if r > 0:                   # round 0 warms up
                        times[k].append(time.perf_counter() - t)
                    layer += 1
        ms = {k: 1000 * statistics.median(v) for k, v in times.items()}
        results.append({"kv_cache_dtype": c.name, "layer_ms": round(ms["this tree"], 3),
                        "reference": reference_name, "reference_layer_ms": round(ms[reference_name], 3),
                        "speedup": round(ms[reference_name] / ms["this tree"], 3), "bitwise_equal": equal})
    return results


def main(args) -> int:
    """Print the machine, then one line per KV-cache dtype: ms per layer, ms per step."""
    from pagedllm.benchmarks.machine import machine_info
    from pagedllm.config import KV_CACHE_DTYPES

    names = [n.strip() for n in args.kv_cache_dtypes.split(",") if n.strip()]
    unknown = [n for n in names if n not in KV_CACHE_DTYPES]
    if not names or unknown:
        raise ValueError(f"--kv-cache-dtypes: unknown {unknown or names}; choose from {', '.join(KV_CACHE_DTYPES)}")
    # names of one cache type (fp8 = fp8_e4m3; auto = the model's dtype) run once, as the first
    from pagedllm.config import resolve_kv_cache_dtype

    seen: dict[torch.dtype, str] = {}
    for n in names:
        seen.setdefault(resolve_kv_cache_dtype(n, _MODEL_DTYPES[args.dtype]), n)
    if len(seen) < len(names):
        dropped = [n for n in names if n not in seen.values()]
        print(f"--kv-cache-dtypes: {', '.join(dropped)} name a cache type already listed; run once")
        names = list(seen.values())
    if args.against is not None and not args.against.strip():
        raise ValueError("--against needs a git revision (e.g. HEAD~1), got an empty one")
    if args.against is not None and args.attention_backend != "cpu_kernel":
        raise ValueError(f"--against compares two builds of the C++ kernel; --attention-backend "
                         f"{args.attention_backend!r} does not apply to it")
    if args.num_heads % args.num_kv_heads:
        raise ValueError("--num-heads must be a multiple of --num-kv-heads")
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    machine = machine_info()
    print(json.dumps(machine))
    print(f"decode attention, {args.num_requests} requests x {args.context_len} cached tokens, "
          f"{args.num_heads} q / {args.num_kv_heads} kv heads x {args.head_dim}, block {args.block_size} "
          f"({args.blocks}), "
          f"{args.dtype} model, {torch.get_num_threads()} threads:")
    if args.against:
        runs = measure_against(kernel_at_revision(args.against), args.against, names, args.dtype,
                               args.num_requests, args.context_len, args.num_heads, args.num_kv_heads,
                               args.head_dim, args.block_size, args.cache_layers, args.iters,
                               contiguous=args.blocks == "contiguous")
        for r in runs:
            print(f"  {r['kv_cache_dtype']:>14} cache: this tree {r['layer_ms']:7.3f} ms/layer, {args.against} "
                  f"{r['reference_layer_ms']:7.3f} ms/layer: {r['speedup']:.2f}x, outputs "
                  f"{'bitwise equal' if r['bitwise_equal'] else 'DIFFER'}")
    else:
        runs = measure(names, args.dtype, args.num_requests, args.context_len, args.num_heads, args.num_kv_heads,
                       args.head_dim, args.block_size, args.cache_layers, args.iters, args.attention_backend,
                       contiguous=args.blocks == "contiguous")
        for r in runs:
            r["step_ms"] = round(r["layer_ms"] * args.num_layers, 2)
            print(f"  {r['kv_cache_dtype']:>14} cache: {r['layer_ms']:7.3f} ms/layer (min {r['layer_ms_min']:.3f}), "
                  f"{r['step_ms']:8.2f} ms/step x{args.num_layers}, K/V {r['kv_bytes_per_layer'] / 1e6:6.{1 if r['kv_bytes_per_layer'] >= 1e6 else 3}f} "
                  f"MB/layer = {r['gb_per_s']:.1f} GB/s  [{r['backend']}]")
    if args.output_json:
        save_json({"machine": machine, "args": {k: v for k, v in vars(args).items() if k != "func"},
                   "runs": runs}, args.output_json)
    return 0
