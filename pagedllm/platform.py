"""What the CPU can do: its model name, the ISA flags that decide pagedllm's compute paths,
and torch's own dispatch level, read once per process (``cpu_features()``).

The project's machines have come with one of three CPUs (``shared/design.md`` names the
first two): an AMD EPYC with AVX2 only, where bf16 arithmetic is emulated and bf16 matmuls
run 5-400x slower than fp32; an Intel Xeon with AVX-512, AVX512-BF16 and AMX, where bf16
matmuls run 4-5x faster than fp32; and an AMD EPYC of family 26 with AVX-512,
AVX512-BF16, AVX512-VNNI and AVX-VNNI but no AMX. Code that picks a dtype or a kernel asks here instead of reading /proc/cpuinfo
itself. Sources: the flag names are the Linux kernel's (``arch/x86/include/asm/cpufeatures.h``,
as /proc/cpuinfo and ``lscpu`` print them).

``--dtype auto`` on the CPU is answered here too (``auto_cpu_dtype``): float32 without
bf16 arithmetic, else whichever of bfloat16 and float32 a timed linear layer finds
faster on this machine.
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
    """One CPU's identity and the flags that pick compute paths.

    Attributes:
        model_name: the first ``model name`` of /proc/cpuinfo (what ``lscpu`` prints as
            "Model name"), e.g. "AMD EPYC 7B13"; "unknown" when it cannot be read.
        avx2 ... avx_ne_convert: whether /proc/cpuinfo lists that flag (False when unreadable).
        torch_capability: ``torch.backends.cpu.get_cpu_capability()``, the widest ISA torch's
            own kernels dispatch to ("AVX2", "AVX512", "DEFAULT", ...).
    """

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
        """Parse the text of /proc/cpuinfo (the first processor's ``model name`` and ``flags``
        lines; ``Features`` on ARM). Lines it does not know are ignored; never raises."""
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
        """The CPU has bf16 arithmetic (AVX512-BF16 dot products or AMX-BF16 tiles). Without
        it torch converts bf16 operands to fp32 and bf16 matmuls are pathologically slow."""
        return self.avx512_bf16 or self.amx_bf16

    def present_flags(self) -> list[str]:
        """The flags of ``FLAGS`` this CPU has, in ``FLAGS`` order (cpuinfo spelling)."""
        return [f for f in FLAGS if getattr(self, f)]

    def describe(self) -> str:
        """One short line, e.g. ``"AMD EPYC 7B13 (AVX2 FMA; torch AVX2)"`` or ``"Intel(R)
        Xeon(R) Platinum 8481C (AVX2 FMA AVX-512 AVX512-VNNI AVX512-BF16 AMX-BF16 AMX-INT8;
        torch AVX512)"``; "none" when no listed flag is present."""
        labels = [FLAGS[f] for f in self.present_flags() if FLAGS[f]]
        return f"{self.model_name} ({' '.join(labels) or 'none'}; torch {self.torch_capability})"


def _torch_capability() -> str:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except Exception:   # an old or unusual torch build; not worth failing start-up for
        return "unknown"


@functools.lru_cache(maxsize=1)
def cpu_features() -> CpuFeatures:
    """This machine's ``CpuFeatures``, read from /proc/cpuinfo once per process (cached);
    model "unknown" and no flags when the file cannot be read (another OS, a sandbox).
    Never raises."""
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
    """What ``--dtype auto`` picked on the CPU and why (for the start-up log).

    Attributes:
        dtype: torch.float32 or torch.bfloat16.
        reason: e.g. "no bf16 arithmetic" or "576->1536 linear, 64 rows: bfloat16
            oneDNN-packed 1200 GFLOP/s vs float32 oneDNN-packed 260 GFLOP/s".
    """

    dtype: torch.dtype
    reason: str


# ``(in_features, out_features, rows, dtype) -> (GFLOP/s, method name)``: how one linear
# layer of that shape runs in ``dtype`` (the engine's ``layers.linear.measure_linear_gflops``).
MeasureLinear = Callable[[int, int, int, torch.dtype], tuple[float, str]]


def choose_cpu_dtype(features: CpuFeatures, in_features: int, out_features: int, measure: MeasureLinear,
                     rows: int = AUTO_DTYPE_ROWS, bf16_kernel: str | None = None) -> DtypeChoice:
    """float32 or bfloat16 for a model computing on a CPU with ``features``.

    Without bf16 arithmetic (``features.has_native_bf16`` false) float32, measuring
    nothing: bf16 matmuls are converted there and run 5-400x slower (AVX2-only CPUs).
    With it and ``bf16_kernel`` (the name of the project's own bf16 linear kernel that
    runs here: AMX or AVX512-BF16) bfloat16, measuring nothing: those kernels run 2-5x
    float32 (docs/cpu-kernels.md), and a timing taken while other processes load the
    cores would pick at random. Otherwise one ``in_features`` -> ``out_features`` linear
    of ``rows`` rows is timed in both dtypes by ``measure`` (the caller passes the
    engine's own method, so that this module imports no layer code; tests pass fakes);
    bfloat16 when it reaches ``BF16_MIN_SPEEDUP`` x float32's GFLOP/s. If ``measure``
    raises, float32 (the reason names the error).
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
    """``choose_cpu_dtype`` for this machine's CPU (``cpu_features()``), decided once per
    process and shape (cached: ``measure`` runs only the first time), logging one line
    with the CPU, the choice and why when it decides."""
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
