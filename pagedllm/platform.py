"""What the CPU can do: its model name, the ISA flags that decide pagedllm's compute paths,
and torch's own dispatch level, read once per process (``cpu_features()``); code that
picks a dtype or kernel asks here, not /proc/cpuinfo. Flag names are the Linux kernel's
(``arch/x86/include/asm/cpufeatures.h``). Also answers ``--dtype auto`` on the CPU
(``auto_cpu_dtype``). The CPUs seen and how bf16 fares on each: docs/notes/config.md.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger("pagedllm")

CPUINFO_PATH = "/proc/cpuinfo"

# The cpuinfo flags that matter here, in the order ``describe`` lists them, with its labels
# (None: implied by another flag's label, so left out of the one-line description).
FLAGS: dict[str, str | None] = {
    "avx2": "AVX2", "fma": "FMA",
    "avx512f": "AVX-512", "avx512bw": None, "avx512vl": None,
    "avx512_vnni": "AVX512-VNNI", "avx_vnni": "AVX-VNNI", "avx512_bf16": "AVX512-BF16",
    "amx_tile": None, "amx_bf16": "AMX-BF16", "amx_int8": "AMX-INT8",
    "avx_ne_convert": "AVX-NE-CONVERT",
}


@dataclass(frozen=True)
class CpuFeatures:
    """One CPU's identity and flags. ``model_name``: /proc/cpuinfo's first ``model name``
    ("unknown" if unreadable); flag fields False when unreadable; ``torch_capability``:
    ``torch.backends.cpu.get_cpu_capability()`` ("AVX2", "AVX512", "DEFAULT", ...)."""

    model_name: str = "unknown"
    avx2: bool = False
    fma: bool = False
    avx512f: bool = False
    avx512bw: bool = False
    avx512vl: bool = False
    avx512_vnni: bool = False
    avx_vnni: bool = False
    avx512_bf16: bool = False
    amx_tile: bool = False
    amx_bf16: bool = False
    amx_int8: bool = False
    avx_ne_convert: bool = False
    torch_capability: str = "unknown"

    @classmethod
    def from_cpuinfo(cls, text: str, torch_capability: str = "unknown") -> CpuFeatures:
        """Parse /proc/cpuinfo text (first processor; ``Features`` on ARM). Never raises."""
        model, flags = "unknown", None
        for line in text.splitlines():
            key, sep, value = line.partition(":")
            if not sep:
                continue
            key = key.strip()
            if key == "model name" and model == "unknown":
                model = value.strip() or "unknown"
            elif key in ("flags", "Features") and flags is None:
                flags = set(value.split())
        flags = flags or set()
        return cls(model_name=model, torch_capability=torch_capability, **{f: f in flags for f in FLAGS})

    @property
    def has_native_bf16(self) -> bool:
        """The CPU has bf16 arithmetic (AVX512-BF16 or AMX-BF16)."""
        return self.avx512_bf16 or self.amx_bf16

    def present_flags(self) -> list[str]:
        """The flags of ``FLAGS`` this CPU has, in ``FLAGS`` order (cpuinfo spelling)."""
        return [f for f in FLAGS if getattr(self, f)]

    def describe(self) -> str:
        """One line, e.g. ``"AMD EPYC 7B13 (AVX2 FMA; torch AVX2)"``."""
        labels = [FLAGS[f] for f in self.present_flags() if FLAGS[f]]
        return f"{self.model_name} ({' '.join(labels) or 'none'}; torch {self.torch_capability})"


def _torch_capability() -> str:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except Exception:   # an old or unusual torch build; not worth failing start-up for
        return "unknown"


@functools.lru_cache(maxsize=1)
def cpu_features() -> CpuFeatures:
    """This machine's ``CpuFeatures``, cached per process ("unknown", no flags when
    /proc/cpuinfo cannot be read). Never raises."""
    try:
        with open(CPUINFO_PATH, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        text = ""
    return CpuFeatures.from_cpuinfo(text, _torch_capability())


def has_native_bf16() -> bool:
    """Whether this CPU computes in bf16 natively (``cpu_features().has_native_bf16``)."""
    return cpu_features().has_native_bf16


def describe() -> str:
    """This CPU in one line (``cpu_features().describe()``), for start-up logs."""
    return cpu_features().describe()


# ``--dtype auto`` on a CPU with bf16 arithmetic picks bfloat16 when its linear layers run
# at least this much faster than in float32 (below it, float32's precision wins).
BF16_MIN_SPEEDUP = 1.2
AUTO_DTYPE_ROWS = 64                  # rows of the timed linear (a mid-sized decode batch)


@dataclass(frozen=True)
class DtypeChoice:
    """``--dtype auto``'s CPU choice (torch.float32 or torch.bfloat16) and a one-line
    ``reason`` for the start-up log."""

    dtype: torch.dtype
    reason: str


# ``(in_features, out_features, rows, dtype) -> (GFLOP/s, method name)``: how one linear
# layer of that shape runs in ``dtype`` (the engine's ``layers.linear.measure_linear_gflops``).
MeasureLinear = Callable[[int, int, int, torch.dtype], tuple[float, str]]


def choose_cpu_dtype(features: CpuFeatures, in_features: int, out_features: int, measure: MeasureLinear,
                     rows: int = AUTO_DTYPE_ROWS, bf16_kernel: str | None = None) -> DtypeChoice:
    """float32 or bfloat16 for a CPU with ``features``: float32 without bf16 arithmetic;
    bfloat16 when ``bf16_kernel`` (the project's own bf16 linear kernel) runs here;
    otherwise time an ``in_features`` -> ``out_features`` linear of ``rows`` rows with
    ``measure`` and pick bfloat16 at >= ``BF16_MIN_SPEEDUP`` x float32's GFLOP/s (float32
    if ``measure`` raises). Why untimed in the first two cases: docs/notes/config.md.
    """
    if not features.has_native_bf16:
        return DtypeChoice(torch.float32, "no bf16 arithmetic")
    if bf16_kernel is not None:
        return DtypeChoice(torch.bfloat16, f"bf16 linears on the {bf16_kernel} kernel")
    try:
        bf16, bf16_method = measure(in_features, out_features, rows, torch.bfloat16)
        fp32, fp32_method = measure(in_features, out_features, rows, torch.float32)
    except Exception as e:   # a torch/oneDNN failure in bf16 must not stop start-up
        return DtypeChoice(torch.float32, f"bf16 timing failed: {type(e).__name__}: {e}")
    pick = torch.bfloat16 if bf16 >= BF16_MIN_SPEEDUP * fp32 else torch.float32
    return DtypeChoice(pick, f"{in_features}->{out_features} linear, {rows} rows: bfloat16 {bf16_method} "
                             f"{bf16:.0f} GFLOP/s vs float32 {fp32_method} {fp32:.0f} GFLOP/s")


_AUTO_CPU_DTYPE: dict[tuple[int, int], DtypeChoice] = {}


def auto_cpu_dtype(in_features: int, out_features: int, measure: MeasureLinear,
                   bf16_kernel: str | None = None) -> DtypeChoice:
    """``choose_cpu_dtype`` for this CPU, cached per process and shape; logs the choice."""
    key = (in_features, out_features)
    if key not in _AUTO_CPU_DTYPE:
        features = cpu_features()
        choice = choose_cpu_dtype(features, in_features, out_features, measure, bf16_kernel=bf16_kernel)
        _AUTO_CPU_DTYPE[key] = choice
        logger.info("dtype auto on %s: %s (%s)", features.describe(), str(choice.dtype).replace("torch.", ""),
                    choice.reason)
    return _AUTO_CPU_DTYPE[key]


__all__ = ["BF16_MIN_SPEEDUP", "CpuFeatures", "DtypeChoice", "FLAGS", "auto_cpu_dtype", "choose_cpu_dtype",
           "cpu_features", "describe", "has_native_bf16"]


def usable_cores() -> int:
    """CPU cores this process may use: its affinity mask (``os.cpu_count()`` where the OS has
    none), capped by a cgroup CPU quota, rounded up, where one is set (v2 ``cpu.max``, or
    v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``)."""
    import math
    import os

    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_quota()
    return min(n, max(1, math.ceil(quota))) if quota is not None else n


def _cgroup_quota() -> float | None:
    """The cgroup CPU quota in cores, or None (none set, or no cgroup files)."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") as f:
            quota = int(f.read())
        with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as f:
            period = int(f.read())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None
