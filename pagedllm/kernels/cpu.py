"""Optional C++ kernels for the CPU float32 path, built on first use with
``torch.utils.cpp_extension.load`` (g++ and ninja; cached under ``$TORCH_EXTENSIONS_DIR``,
default ``~/.cache/torch_extensions``): paged decode attention, writing K/V into the
paged cache, SiLU-and-mul, fused residual-add + RMSNorm and RoPE (sources in ``csrc/``).
If the build fails, or ``PAGEDLLM_CPU_KERNELS=0``, callers fall back to torch ops;
results agree to float32 rounding.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading

import torch

logger = logging.getLogger("pagedllm")
_lock = threading.Lock()
_module = None
_tried = False

_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
_SOURCES = ("bindings.cpp", "paged_attention_cpu.cpp", "cpu_ops.cpp")


_NO_TRACE = contextlib.nullcontext()


def trace(name: str):
    """A profiler range called ``name`` while torch.profiler records, else a no-op
    (~0.3 us), so that the C++ kernels, which are not aten ops, appear in traces."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return _NO_TRACE


def _cpu_tag() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


def load_cpu_kernels():
    """The compiled module, or None when disabled or unbuildable (logged once).

    The module name carries a digest of the sources and of the CPU's flags, so an edited
    source or another CPU builds afresh instead of loading a stale binary."""
    global _module, _tried
    with _lock:
        if _tried:
            return _module
        _tried = True
        if os.environ.get("PAGEDLLM_CPU_KERNELS", "1") == "0":
            return None
        try:
            import sys

            from torch.utils.cpp_extension import load

            # The `ninja` wheel puts its binary next to the interpreter (venv/bin), which
            # is not on PATH when the venv is not activated.
            bindir = os.path.dirname(sys.executable)
            if bindir not in os.environ.get("PATH", "").split(os.pathsep):
                os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")

            logger.info("loading the C++ CPU kernels (the first start compiles them: ~1-3 min)")
            h = hashlib.sha1()
            for name in sorted(os.listdir(_CSRC)):
                with open(os.path.join(_CSRC, name), "rb") as f:
                    h.update(name.encode() + f.read())
            _module = load(name=f"pagedllm_cpu_{h.hexdigest()[:8]}_{_cpu_tag()}",
                           sources=[os.path.join(_CSRC, s) for s in _SOURCES],
                           extra_include_paths=[_CSRC],
                           extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                           extra_ldflags=["-fopenmp", "-lmvec"], verbose=False)
        except Exception as e:  # no compiler, no ninja, ...
            logger.warning("CPU kernels unavailable (%s); using torch ops", e)
            _module = None
        return _module
