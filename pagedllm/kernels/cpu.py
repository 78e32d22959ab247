"""Optional C++ kernels for the CPU float32 and bfloat16 paths (sources in ``csrc/``), built on
first use with ``torch.utils.cpp_extension.load`` and cached under ``$TORCH_EXTENSIONS_DIR``
(default ``~/.cache/torch_extensions``). If the build fails or ``PAGEDLLM_CPU_KERNELS=0``,
callers fall back to torch ops (results agree to float32 rounding). Concurrent first starts
build once (an ``flock``); a build killed half-way is redone: docs/notes/kernels.md."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import sys
import threading
import time

import torch

from pagedllm import envs

logger = logging.getLogger("pagedllm")
_lock = threading.Lock()
_module = None
_tried = False

# How long a start waits for another process that is building the kernels (seconds)
# before it gives up and uses the torch ops instead ($PAGEDLLM_KERNEL_BUILD_WAIT_S).
DEFAULT_BUILD_WAIT_S = 1200.0

# Process names of a build's toolchain (``/proc/<pid>/comm``, at most 15 characters).
_TOOLCHAIN = ("ninja", "c++", "g++", "gcc", "cc", "cc1plus", "cc1", "as", "ld", "collect2",
              "clang", "clang++", "lto-wrapper")

_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
_SOURCES = ("bindings.cpp", "paged_attention_cpu.cpp", "cpu_ops.cpp", "quant_act.cpp", "block_quant.cpp",
            "amx_linear.cpp", "bf16_linear_avx512.cpp", "int8_linear_avx2.cpp", "sample_ops.cpp", "decoder_stack.cpp")


_NO_TRACE = contextlib.nullcontext()


def trace(name: str):
    """A profiler range ``name`` while torch.profiler records, else a no-op."""
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


def _extensions_root() -> str:
    """``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``."""
    return envs.torch_extensions_dir()


def _module_name() -> str:
    """``pagedllm_cpu_<digest>_<cpu tag>``: the digest covers the sources, torch and Python
    versions and the sources' directory (why: docs/notes/kernels.md)."""
    h = hashlib.sha1()
    for name in sorted(os.listdir(_CSRC)):
        with open(os.path.join(_CSRC, name), "rb") as f:
            h.update(name.encode() + f.read())
    h.update(f"{torch.__version__}|{sys.version_info[:2]}|{os.path.realpath(_CSRC)}".encode())
    return f"pagedllm_cpu_{h.hexdigest()[:8]}_{_cpu_tag()}"


def build_wait_s() -> float:
    """``$PAGEDLLM_KERNEL_BUILD_WAIT_S`` seconds (default 1200); an invalid value is logged
    and replaced by the default."""
    raw = envs.kernel_build_wait_raw()
    if raw is None:
        return DEFAULT_BUILD_WAIT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value >= 0 and value != float("inf")):
        logger.warning("ignoring PAGEDLLM_KERNEL_BUILD_WAIT_S=%r (want seconds, a finite number "
                       ">= 0); using %.0f", raw, DEFAULT_BUILD_WAIT_S)
        return DEFAULT_BUILD_WAIT_S
    return value


def _compilers_in(directory: str) -> list[int]:
    """Pids of toolchain processes whose working directory is ``directory`` (Linux ``/proc``)."""
    target = os.path.realpath(directory)
    pids = []
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{entry}/cwd") != target:
                        continue
                    with open(f"/proc/{entry}/comm") as f:
                        comm = f.read().strip()
                    if comm in _TOOLCHAIN or comm.endswith(("-g++", "-gcc", "-c++", "-as", "-ld")):
                        pids.append(int(entry))
    return pids


def _wait_for(ready, deadline: float, waiting_note: str) -> bool:
    """Poll ``ready()`` every 0.5 s until true (True) or past ``deadline`` (False)."""
    announced = False
    while not ready():
        if time.monotonic() > deadline:
            return False
        if not announced:
            logger.info(waiting_note)
            announced = True
        time.sleep(0.5)
    return True


@contextlib.contextmanager
def _build_lock(build_dir: str, wait_s: float):
    """Hold an exclusive ``flock`` on ``<build_dir>.flock``, then wait for an interrupted
    build's compilers and remove its stale torch ``lock``. Yields None when safe to build, or
    a reason (str) after ``wait_s`` seconds."""
    fd = os.open(build_dir + ".flock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait_s

        def try_flock() -> bool:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                return False

        if not _wait_for(try_flock, deadline,
                         "waiting for another process that is building the CPU kernels"):
            yield f"another process held {build_dir}.flock for {wait_s:.0f} s"
            return
        if not _wait_for(lambda: not _compilers_in(build_dir), deadline,
                         "waiting for the compiler processes of an interrupted kernel build to end"):
            yield (f"compiler processes {_compilers_in(build_dir)} of an interrupted build were "
                   f"still running in {build_dir} after {wait_s:.0f} s")
            return
        stale = os.path.join(build_dir, "lock")
        if os.path.exists(stale):
            logger.warning("removing %s, left by a kernel build that did not finish", stale)
            os.remove(stale)
        try:
            yield None
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


# dtypes the kernels store tensors in (float32 arithmetic inside)
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# dtypes the K/V write and the paged-attention kernel keep the KV cache in, whichever of
# KERNEL_DTYPES the model computes in (fp8: OCP OFP8 E4M3 and E5M2, per-tensor scales)
KV_CACHE_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)


def kernels_for(device: "torch.device | str | None", dtype: torch.dtype,
                kv_cache_dtype: torch.dtype | None = None):
    """The compiled module for ``dtype`` on ``device`` (None: CPU) with a ``kv_cache_dtype``
    cache (None: no cache), where the kernels cover them; else None. Never raises."""
    if ((device is None or torch.device(device).type == "cpu") and dtype in KERNEL_DTYPES
            and (kv_cache_dtype is None or kv_cache_dtype in KV_CACHE_KERNEL_DTYPES)):
        return load_cpu_kernels()
    return None


def compile_module(name: str, sources: list[str], include_dir: str, build_dir: str):
    """Build or load the extension ``name`` with ``-O3 -march=native -ffast-math -fopenmp``.
    Raises what ``torch.utils.cpp_extension.load`` raises."""
    from torch.utils.cpp_extension import load

    # The `ninja` wheel puts its binary next to the interpreter (venv/bin), which is not on
    # PATH when the venv is not activated.
    bindir = os.path.dirname(sys.executable)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    return load(name=name, sources=sources, extra_include_paths=[include_dir],
                extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                extra_ldflags=["-fopenmp", "-lmvec"], build_directory=build_dir, verbose=False)


def load_cpu_kernels():
    """The compiled module, or None when disabled or unbuildable (a warning, logged once).
    Never raises."""
    global _module, _tried
    with _lock:
        if _tried:
            return _module
        _tried = True
        if not envs.cpu_kernels_enabled():
            return None
        try:
            name = _module_name()
            build_dir = os.path.join(_extensions_root(), name)
            os.makedirs(build_dir, exist_ok=True)
            with _build_lock(build_dir, build_wait_s()) as why_not:
                if why_not is not None:
                    raise TimeoutError(why_not)
                if os.path.exists(os.path.join(build_dir, f"{name}.so")):
                    logger.debug("loading the C++ CPU kernels from %s", build_dir)
                else:
                    logger.info("building the C++ CPU kernels in %s (once per checkout on this machine: ~1 min)",
                                build_dir)
                _module = compile_module(name, [os.path.join(_CSRC, s) for s in _SOURCES], _CSRC, build_dir)
        except Exception as e:  # no compiler, no ninja, a build that waited too long, ...
            logger.warning("CPU kernels unavailable (%s); using torch ops",
                           " ".join(str(e).split()))
            _module = None
        return _module


if __name__ == "__main__":
    # ``python -m pagedllm.kernels.cpu``: build (or load) the kernels now, e.g. during
    # ``make install``; exit status 0 when they are usable, 1 when not (logged why).
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    t0 = time.monotonic()
    ok = load_cpu_kernels() is not None
    print(f"C++ CPU kernels {'ready' if ok else 'UNAVAILABLE (torch ops)'} after {time.monotonic() - t0:.1f} s")
    sys.exit(0 if ok else 1)
