"""Every environment variable pagedllm reads, in one place; names, defaults and meanings:
docs/configuration.md. Each is read when its accessor is called (not at import). A switch
takes ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off`` in any case; any other
value is a ``ValueError`` naming the variable.
"""
from __future__ import annotations

import os


def _get(name: str, default: str) -> str:
    return os.environ.get(name, default)


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _flag(name: str, default: bool) -> bool:
    """A switch variable (unset or empty: ``default``). Raises ValueError, naming it, on
    a value that is not a switch word."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{name} must be 1 or 0 (or true/false, yes/no, on/off), got {os.environ[name]!r}")


LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")


# the other names Python's logging takes for two of them
_LEVEL_ALIASES = {"WARN": "WARNING", "FATAL": "CRITICAL"}


def check_log_level(value: str, name: str) -> str:
    """``value`` upper-cased if it is one of :data:`LOG_LEVELS` (any case; ``warn`` and
    ``fatal`` as logging takes them), else a ValueError naming ``name`` (the flag or variable
    it came from)."""
    level = value.strip().upper()
    level = _LEVEL_ALIASES.get(level, level)
    if level not in LOG_LEVELS:
        raise ValueError(f"{name} must be one of {', '.join(l.lower() for l in LOG_LEVELS)}, got {value!r}")
    return level


def log_level() -> str:
    """``PAGEDLLM_LOG_LEVEL`` (default INFO), upper-cased; ValueError naming it otherwise."""
    return check_log_level(_get("PAGEDLLM_LOG_LEVEL", "INFO") or "INFO", "PAGEDLLM_LOG_LEVEL")


def configure_logging() -> bool:
    """Whether ``LLM``/``AsyncLLM`` may add a stderr handler (``logger.py``)."""
    return _flag("PAGEDLLM_CONFIGURE_LOGGING", True)


def cache_root() -> str:
    return _get("PAGEDLLM_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "pagedllm"))


def cpu_kernels_enabled() -> bool:
    return _flag("PAGEDLLM_CPU_KERNELS", True)


def kernel_build_wait_raw() -> str | None:
    """The raw value (None when unset); ``kernels.cpu.build_wait_s`` parses it."""
    return os.environ.get("PAGEDLLM_KERNEL_BUILD_WAIT_S")


def torch_extensions_dir() -> str:
    """``$TORCH_EXTENSIONS_DIR`` or torch's default ``~/.cache/torch_extensions``."""
    return os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "torch_extensions")


def triton_interpret() -> bool:
    """``TRITON_INTERPRET=1`` (read by Triton itself when a kernel module is imported): Triton
    kernels run in its interpreter on the CPU; the ``triton`` attention backend then accepts
    a CPU device (tests)."""
    return _flag("TRITON_INTERPRET", False)


def onednn_enabled() -> bool:
    return _flag("PAGEDLLM_ONEDNN", True)


def amx_enabled() -> bool:
    """``PAGEDLLM_AMX=0`` turns the AMX kernels off."""
    return _flag("PAGEDLLM_AMX", True)


def avx512_bf16_enabled() -> bool:
    """``PAGEDLLM_AVX512_BF16=0`` turns the AVX512-BF16 kernels off: the linear kernel and
    paged attention's VDPBF16PS q.k scores."""
    return _flag("PAGEDLLM_AVX512_BF16", True)


def avx2_int8_enabled() -> bool:
    """``PAGEDLLM_AVX2_INT8=0`` turns the AVX2 int8 W8A8 kernel off."""
    return _flag("PAGEDLLM_AVX2_INT8", True)


def fused_decoder_enabled() -> bool:
    """``PAGEDLLM_FUSED_DECODER=0`` keeps the per-layer Python path."""
    return _flag("PAGEDLLM_FUSED_DECODER", True)


def batch_invariant_probe_enabled() -> bool:
    return _flag("PAGEDLLM_BATCH_INVARIANT_PROBE", True)


def allow_long_max_model_len() -> bool:
    return _flag("PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN", False)


def profile_steps() -> tuple[int, int]:
    """``PAGEDLLM_PROFILE_STEPS`` as (first step, number of steps). Raises ValueError
    unless two comma-separated integers."""
    raw = _get("PAGEDLLM_PROFILE_STEPS", "5,20")
    try:
        start, num = (int(x) for x in raw.split(","))
    except ValueError:
        raise ValueError(f"PAGEDLLM_PROFILE_STEPS must be 'START,NUM' (two integers), got {raw!r}") from None
    return start, num


def api_key() -> str | None:
    """``PAGEDLLM_API_KEY``, or None when unset or empty."""
    return os.environ.get("PAGEDLLM_API_KEY") or None


def cpu_omp_threads_bind() -> str | None:
    """``PAGEDLLM_CPU_OMP_THREADS_BIND`` (vLLM's ``VLLM_CPU_OMP_THREADS_BIND``): each
    tensor-parallel rank's CPU cores, ranks separated by ``|`` (``0-31|32-63``); None when
    unset (no binding)."""
    return os.environ.get("PAGEDLLM_CPU_OMP_THREADS_BIND") or None


def allow_cpu_oversubscription() -> bool:
    """``PAGEDLLM_ALLOW_CPU_OVERSUBSCRIPTION=1``: start more CPU ranks (tensor x data
    parallel) than the process has cores."""
    return _flag("PAGEDLLM_ALLOW_CPU_OVERSUBSCRIPTION", False)


def cpu_thread_governor() -> bool:
    """``PAGEDLLM_CPU_THREAD_GOVERNOR=0``: keep every CPU thread even while other processes
    take the worker's cores (``worker/cpu_threads.py``)."""
    return _flag("PAGEDLLM_CPU_THREAD_GOVERNOR", True)


def dp_prefix_affinity() -> bool:
    """``PAGEDLLM_DP_PREFIX_AFFINITY=0``: data-parallel routing by load alone (no prompt-prefix
    affinity; for comparing the two)."""
    return _flag("PAGEDLLM_DP_PREFIX_AFFINITY", True)


def shm_allreduce() -> bool:
    """``PAGEDLLM_SHM_ALLREDUCE=0``: CPU tensor-parallel ranks on one machine all-reduce
    through gloo instead of shared memory."""
    return _flag("PAGEDLLM_SHM_ALLREDUCE", True)


def master_addr() -> str | None:
    """``MASTER_ADDR`` (torch.distributed's env:// rendezvous): node 0's address when
    ``--master-addr`` is not given."""
    return os.environ.get("MASTER_ADDR") or None


def master_port() -> int | None:
    """``MASTER_PORT``: node 0's first port when ``--master-port`` is not given.

    Raises:
        ValueError: not an integer (the variable named)."""
    raw = os.environ.get("MASTER_PORT")
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"MASTER_PORT must be an integer port, got {raw!r}") from None
