"""CPU feature detection (pagedllm/platform.py)."""
from __future__ import annotations

import pytest
import torch

from pagedllm import platform
from pagedllm.benchmarks.machine import machine_info

AMD = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse sse2 avx f16c fma bmi2 avx2 sha_ni vaes
processor\t: 1
model name\t: something else
flags\t\t: avx512f avx512_bf16
"""
INTEL = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu avx avx2 fma avx512f avx512dq avx512bw avx512vl avx512_vnni avx_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
"""


def test_parses_the_first_processor_and_describes_it():
    amd = platform.CpuFeatures.from_cpuinfo(AMD, "AVX2")
    assert (amd.model_name, amd.avx2, amd.fma, amd.avx512f, amd.avx512_bf16) == ("AMD EPYC 7B13", True, True,
                                                                                  False, False)
    assert not amd.has_native_bf16
    assert amd.present_flags() == ["avx2", "fma"]
    assert amd.describe() == "AMD EPYC 7B13 (AVX2 FMA; torch AVX2)"
    intel = platform.CpuFeatures.from_cpuinfo(INTEL, "AVX512")
    assert intel.has_native_bf16 and intel.amx_tile and intel.avx512bw and not intel.avx_ne_convert
    assert intel.describe() == ("Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz (AVX2 FMA AVX-512 AVX512-VNNI "
                                "AVX-VNNI AVX512-BF16 AMX-BF16 AMX-INT8; torch AVX512)")
    # AMX alone (no avx512_bf16 flag) also counts as bf16 arithmetic
    assert platform.CpuFeatures(amx_bf16=True).has_native_bf16


def test_unreadable_cpuinfo_gives_no_flags(monkeypatch, tmp_path):
    monkeypatch.setattr(platform, "CPUINFO_PATH", str(tmp_path / "missing"))
    platform.cpu_features.cache_clear()
    try:
        f = platform.cpu_features()
        assert (f.model_name, f.present_flags(), f.has_native_bf16) == ("unknown", [], False)
        assert f.torch_capability == torch.backends.cpu.get_cpu_capability()
        assert f.describe() == f"unknown (none; torch {f.torch_capability})"
        assert platform.CpuFeatures.from_cpuinfo("garbage\n: :\n") == platform.CpuFeatures()
    finally:
        platform.cpu_features.cache_clear()


def test_machine_info_reads_platform():
    info = machine_info()
    assert set(info) == {"cpu", "isa", "cores", "torch_threads", "torch"}
    f = platform.cpu_features()
    assert info["cpu"] == f.model_name
    assert info["isa"] == [x for x in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16",
                                       "amx_int8") if getattr(f, x)]
