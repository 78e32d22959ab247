"""What the CPU can do: its model name, the ISA flags that decide pagedllm's compute paths,
and torch's own dispatch level, read once per process (``cpu_features()``).

The project's machines have come with one of three CPUs (``shared/design.md`` names the
first two): an AMD EPYC with AVX2 only, where bf16 arithmetic is emulated and bf16 matmuls
run 5-400x slower than fp32; an Intel Xeon with AVX-512, AVX512-BF16 and AMX, where bf16
matmuls run 4-5x faster than fp32; and an AMD EPYC of family 26 with AVX-512,
AVX512-BF16, AVX512-VNNI and AVX-VNNI but no AMX. Code that picks a dtype or a kernel asks here instead of reading /proc/cpuinfo
itself. Sources: the flag names are the Linux kernel's (``arch/x86/include/asm/cpufeatures.h``,
as /proc/cpuinfo and ``lscpu`` print them).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

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


__all__ = ["CpuFeatures", "FLAGS", "cpu_features", "describe", "has_native_bf16"]
