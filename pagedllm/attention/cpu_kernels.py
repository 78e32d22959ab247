"""Optional C++ kernels for CPU attention, built on first use with
``torch.utils.cpp_extension.load`` (g++ and ninja; cached under ``$TORCH_EXTENSIONS_DIR``,
default ``~/.cache/torch_extensions``). If the build fails, or ``PAGEDLLM_CPU_KERNELS=0``,
callers fall back to the torch-ops path; results agree to float32 rounding.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading

logger = logging.getLogger("pagedllm")
_lock = threading.Lock()
_module = None
_tried = False


def _cpu_tag() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


def load_cpu_kernels():
    """The compiled module, or None when disabled or unbuildable (logged once)."""
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

            src = os.path.join(os.path.dirname(__file__), "csrc", "paged_attention_cpu.cpp")
            with open(src, "rb") as f:
                digest = hashlib.sha1(f.read()).hexdigest()[:8]
            _module = load(name=f"pagedllm_cpu_attn_{digest}_{_cpu_tag()}", sources=[src],
                           extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                           extra_ldflags=["-fopenmp", "-lmvec"], verbose=False)
        except Exception as e:  # no compiler, no ninja, ...
            logger.warning("CPU attention kernel unavailable (%s); using the torch-ops path", e)
            _module = None
        return _module
