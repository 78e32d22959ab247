"""Every environment variable pagedllm reads, in one place.

Each is read when its accessor is called (not at import), so a test or a launcher can set
it before the engine starts. A switch (default ``1`` or ``0`` below) takes ``1``/``true``/
``yes``/``on`` or ``0``/``false``/``no``/``off`` in any case, and any other value is a
``ValueError`` naming the variable. Names, defaults and meanings:

| variable | default | meaning |
|---|---|---|
| ``PAGEDLLM_LOG_LEVEL`` | ``INFO`` | log level of the ``pagedllm`` command, and of ``LLM``/``AsyncLLM`` where the application sets none |
| ``PAGEDLLM_CONFIGURE_LOGGING`` | ``1`` | ``0``: ``LLM``/``AsyncLLM`` leave logging alone (no stderr handler on the ``pagedllm`` logger when the application configured none; ``logger.py``) |
| ``PAGEDLLM_CACHE`` | ``~/.cache/pagedllm`` | converted tokenizers |
| ``PAGEDLLM_CPU_KERNELS`` | ``1`` | ``0``: never build or load the C++ CPU kernels |
| ``PAGEDLLM_KERNEL_BUILD_WAIT_S`` | ``1200`` | seconds to wait for another process's kernel build |
| ``TORCH_EXTENSIONS_DIR`` | ``~/.cache/torch_extensions`` | where the kernels are built (torch's own variable) |
| ``PAGEDLLM_ONEDNN`` | ``1`` | ``0``: CPU float32 linear layers use ``F.linear`` instead of oneDNN-packed weights |
| ``PAGEDLLM_AMX`` | ``1`` | ``0``: the AMX kernels are not used: CPU bfloat16 linear layers and ``--quantization int8``'s matmuls go to oneDNN (int8: to the AVX2 kernel where oneDNN is off too), and bf16 paged attention computes its q.k scores with vector FMAs |
| ``PAGEDLLM_AVX2_INT8`` | ``1`` | ``0``: the project's AVX2 int8 kernel is not used: ``--quantization int8`` where AMX-INT8 does not run multiplies through oneDNN (7-bit weights without VNNI) |
| ``PAGEDLLM_FUSED_DECODER`` | ``1`` | ``0``: a Llama-family model whose linears have a C++ stack form (GGUF blocks, int8 W8A8 on AVX2 or AMX) runs its decoder layers one Python module call at a time instead of as one C++ call a step (``models/fused_decoder.py``; the same kernels and bits) |
| ``PAGEDLLM_BATCH_INVARIANT_PROBE`` | ``1`` | ``0``: skip the load-time check that each linear layer's rows are independent of the batch size (and the row-chunk wrapping of layers whose are not; ``layers/batch_invariance.py``) |
| ``PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN`` | ``0`` | ``1``: allow ``max_model_len`` past the model's context |
| ``PAGEDLLM_PROFILE_STEPS`` | ``5,20`` | ``START,NUM``: engine steps the torch.profiler trace covers |
| ``PAGEDLLM_API_KEY`` | unset | the server's API key when ``--api-key`` is not given (Bearer auth) |
| ``PAGEDLLM_CPU_OMP_THREADS_BIND`` | unset | each tensor-parallel rank's CPU cores, ranks split by a bar: ``0-31\\|32-63`` (vLLM's ``VLLM_CPU_OMP_THREADS_BIND``) |
"""
from __future__ import annotations

import os


def _get(name: str, default: str) -> str:
    return os.environ.get(name, default)


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _flag(name: str, default: bool) -> bool:
    """A switch variable: ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off`` (any
    case, surrounding spaces ignored); unset or empty: ``default``.

    Raises:
        ValueError: any other value, naming the variable (a typo must not leave a kernel
        silently on or off).
    """
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{name} must be 1 or 0 (or true/false, yes/no, on/off), got {os.environ[name]!r}")


def log_level() -> str:
    return _get("PAGEDLLM_LOG_LEVEL", "INFO")


def configure_logging() -> bool:
    """``PAGEDLLM_CONFIGURE_LOGGING`` (default 1): whether ``LLM``/``AsyncLLM`` give the
    ``pagedllm`` logger a stderr handler when the application has configured none
    (``pagedllm/logger.py``)."""
    return _flag("PAGEDLLM_CONFIGURE_LOGGING", True)


def cache_root() -> str:
    return _get("PAGEDLLM_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "pagedllm"))


def cpu_kernels_enabled() -> bool:
    return _flag("PAGEDLLM_CPU_KERNELS", True)


def kernel_build_wait_raw() -> str | None:
    """The raw ``PAGEDLLM_KERNEL_BUILD_WAIT_S`` (None when unset); ``kernels.cpu.build_wait_s``
    parses it, logging and replacing a bad value."""
    return os.environ.get("PAGEDLLM_KERNEL_BUILD_WAIT_S")


def torch_extensions_dir() -> str:
    """``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions`` (torch.utils.cpp_extension's default)."""
    return os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "torch_extensions")


def onednn_enabled() -> bool:
    return _flag("PAGEDLLM_ONEDNN", True)


def amx_enabled() -> bool:
    """``PAGEDLLM_AMX=0`` turns the AMX kernels off (bf16 linears and int8 W8A8: oneDNN computes instead;
    bf16 paged attention: q.k scores by vector FMAs)."""
    return _flag("PAGEDLLM_AMX", True)


def avx512_bf16_enabled() -> bool:
    """``PAGEDLLM_AVX512_BF16=0`` turns the AVX512-BF16 bf16 linear kernel off (oneDNN computes instead)."""
    return _flag("PAGEDLLM_AVX512_BF16", True)


def avx2_int8_enabled() -> bool:
    """``PAGEDLLM_AVX2_INT8=0`` turns the AVX2 int8 W8A8 kernel off (oneDNN computes instead)."""
    return _flag("PAGEDLLM_AVX2_INT8", True)


def fused_decoder_enabled() -> bool:
    """``PAGEDLLM_FUSED_DECODER=0`` keeps the per-layer Python path for models the fused
    C++ decoder stack could run."""
    return _flag("PAGEDLLM_FUSED_DECODER", True)


def batch_invariant_probe_enabled() -> bool:
    return _flag("PAGEDLLM_BATCH_INVARIANT_PROBE", True)


def allow_long_max_model_len() -> bool:
    return _flag("PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN", False)


def profile_steps() -> tuple[int, int]:
    """``PAGEDLLM_PROFILE_STEPS`` as (first step, number of steps) of the torch.profiler trace.

    Raises:
        ValueError: not two integers separated by a comma (the variable is named).
    """
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
