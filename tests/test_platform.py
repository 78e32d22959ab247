"""CPU feature detection (pagedllm/platform.py), ``--dtype auto`` on the CPU (measured,
platform.choose_cpu_dtype, asked by config.resolve_dtype) and oneDNN bf16 weight packing where the CPU supports it."""
from __future__ import annotations

import logging

import pytest
import torch

from pagedllm import config, platform
from pagedllm.benchmarks.machine import machine_info
from pagedllm.layers import linear
from pagedllm.models.arch_config import ModelArchConfig

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


# --------------------------------------------------------------------------------------
# --dtype auto on the CPU
# --------------------------------------------------------------------------------------

def _fake_measure(gflops: dict, calls: list):
    def measure(fin, fout, rows, dtype):
        calls.append((fin, fout, rows, dtype))
        return gflops[dtype], "fake-method"
    return measure


INTEL_F = platform.CpuFeatures.from_cpuinfo(INTEL, "AVX512")
AMD_F = platform.CpuFeatures.from_cpuinfo(AMD, "AVX2")


def test_no_bf16_arithmetic_picks_float32_without_measuring():
    calls = []
    choice = platform.choose_cpu_dtype(AMD_F, 576, 1536, measure=_fake_measure({}, calls))
    assert (choice.dtype, choice.reason, calls) == (torch.float32, "no bf16 arithmetic", [])


@pytest.mark.parametrize("bf16, fp32, expected", [(1200.0, 260.0, torch.bfloat16),   # the Intel Xeon
                                                   (312.0, 260.0, torch.bfloat16),    # exactly 1.2x
                                                   (300.0, 260.0, torch.float32),     # 1.15x: not enough
                                                   (15.0, 100.0, torch.float32)])
def test_native_bf16_measures_both_dtypes_at_the_model_shape(bf16, fp32, expected):
    calls = []
    choice = platform.choose_cpu_dtype(INTEL_F, 576, 1536,
                                       measure=_fake_measure({torch.bfloat16: bf16, torch.float32: fp32}, calls))
    assert choice.dtype == expected
    assert sorted(calls, key=str) == [(576, 1536, 64, torch.bfloat16), (576, 1536, 64, torch.float32)]
    assert choice.reason == (f"576->1536 linear, 64 rows: bfloat16 fake-method {bf16:.0f} GFLOP/s "
                             f"vs float32 fake-method {fp32:.0f} GFLOP/s")


def test_the_projects_bf16_kernel_picks_bfloat16_without_measuring():
    """A timing taken while other processes load the cores picks at random; where the
    project's AMX or AVX512-BF16 kernel runs, bf16 is chosen from that fact alone."""
    calls = []
    choice = platform.choose_cpu_dtype(INTEL_F, 576, 1536, measure=_fake_measure({}, calls),
                                       bf16_kernel="AVX512-BF16 (C++)")
    assert (choice.dtype, choice.reason, calls) == (torch.bfloat16, "bf16 linears on the AVX512-BF16 (C++) kernel",
                                                     [])
    assert platform.choose_cpu_dtype(AMD_F, 576, 1536, measure=_fake_measure({}, calls),
                                     bf16_kernel="x").dtype == torch.float32      # no bf16 arithmetic


def test_bf16_kernel_name_is_what_get_linear_method_picks():
    name = linear.bf16_kernel_name("cpu")
    assert name in (None, "AMX bf16 (C++)", "AVX512-BF16 (C++)")
    assert (name is None) == (linear.get_linear_method("cpu", torch.bfloat16).name not in
                              ("AMX bf16 (C++)", "AVX512-BF16 (C++)"))


def test_a_failing_measurement_falls_back_to_float32():
    def boom(*a):
        raise RuntimeError("oneDNN says no")
    choice = platform.choose_cpu_dtype(INTEL_F, 64, 128, measure=boom)
    assert choice.dtype == torch.float32 and choice.reason == "bf16 timing failed: RuntimeError: oneDNN says no"


@pytest.fixture
def fresh_auto_cache(monkeypatch):
    monkeypatch.setattr(platform, "_AUTO_CPU_DTYPE", {})


def test_resolve_dtype_auto_uses_the_arch_shape_once_and_logs_one_line(monkeypatch, fresh_auto_cache, caplog):
    calls = []
    monkeypatch.setattr(platform, "cpu_features", lambda: INTEL_F)
    monkeypatch.setattr(linear, "bf16_kernel_name", lambda device: None)    # oneDNN's bf16: timed
    monkeypatch.setattr(linear, "measure_linear_gflops",
                        _fake_measure({torch.bfloat16: 1000.0, torch.float32: 250.0}, calls))
    arch = ModelArchConfig(architecture="LlamaForCausalLM", hidden_size=96, intermediate_size=256,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=48,
                           vocab_size=10)
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        for _ in range(3):
            assert config.resolve_dtype("auto", torch.device("cpu"), arch) == torch.bfloat16
    assert [c[:3] for c in calls] == [(96, 256, 64)] * 2             # measured once: cached
    lines = [r.getMessage() for r in caplog.records if "dtype auto" in r.getMessage()]
    assert lines == [f"dtype auto on {INTEL_F.describe()}: bfloat16 (96->256 linear, 64 rows: bfloat16 "
                     "fake-method 1000 GFLOP/s vs float32 fake-method 250 GFLOP/s)"]
    assert config.resolve_dtype("bfloat16", torch.device("cpu"), arch) == torch.bfloat16   # explicit: as asked


@pytest.mark.skipif(platform.has_native_bf16(), reason="this CPU has bf16 arithmetic")
def test_auto_is_float32_here_without_measuring(monkeypatch, fresh_auto_cache, caplog):
    def must_not_run(*a):
        raise AssertionError("measured on a CPU without bf16 arithmetic")
    monkeypatch.setattr(linear, "measure_linear_gflops", must_not_run)
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        assert config.resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert f"dtype auto on {platform.describe()}: float32 (no bf16 arithmetic)" in caplog.text


def test_measure_linear_gflops_times_the_engines_method():
    gflops, method = linear.measure_linear_gflops(64, 96, 8, torch.float32, reps=2)
    assert gflops > 0
    assert method == linear.get_linear_method("cpu", torch.float32).name
    # the weight is capped for big shapes: a 4096 x 1M linear must not allocate 16 GiB
    gflops, _ = linear.measure_linear_gflops(4096, 1 << 20, 1, torch.float32, reps=1, max_weight_elements=1 << 16)
    assert gflops > 0


# --------------------------------------------------------------------------------------
# oneDNN packing in bf16
# --------------------------------------------------------------------------------------

def test_bf16_packing_follows_the_probe(monkeypatch):
    works = linear.onednn_bf16_packing_works()
    assert linear.onednn_packing_available("cpu", torch.bfloat16) == (works and torch.backends.mkldnn.is_available())
    assert not linear.onednn_packing_available("cpu", torch.float16)
    monkeypatch.setenv("PAGEDLLM_ONEDNN", "0")
    assert not linear.onednn_packing_available("cpu", torch.bfloat16)
    assert not linear.onednn_packing_available("cpu", torch.float32)


@pytest.mark.skipif(platform.cpu_features().avx512bw or platform.cpu_features().avx_ne_convert,
                    reason="oneDNN can reorder bf16 weights on this CPU")
def test_bf16_is_not_packed_on_this_cpu():
    """On AVX2 CPUs torch raises in the reorder; the layers then use F.linear."""
    assert not linear.onednn_bf16_packing_works()
    assert linear.get_linear_method("cpu", torch.bfloat16).name == "F.linear"
    assert linear.get_linear_method("cpu", torch.float32).name == "oneDNN-packed"   # float32 unchanged


@pytest.mark.skipif(not linear.onednn_packing_available("cpu", torch.bfloat16), reason="no bf16 oneDNN packing here")
def test_bf16_packed_linear_matches_dense():
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(96, 64, generator=g).bfloat16(), torch.randn(96, generator=g).bfloat16()
    x = torch.randn(5, 64, generator=g).bfloat16()
    layer = linear.ReplicatedLinear(64, 96, True, torch.bfloat16, torch.device("cpu"),
                                    linear.OneDNNPackedLinearMethod())
    # the default where AMX-BF16 or AVX512-BF16 runs is that kernel (tests/test_bf16_tiled_linear.py), else this
    default = linear.ReplicatedLinear(64, 96, True, torch.bfloat16, torch.device("cpu")).linear_method.name
    assert default == ("AMX bf16 (C++)" if linear.amx_bf16_available("cpu", torch.bfloat16) else
                       "AVX512-BF16 (C++)" if linear.avx512_bf16_available("cpu", torch.bfloat16) else
                       "oneDNN-packed")
    layer.weight_loader(layer.weight, w)
    layer.weight_loader(layer.bias, b)
    layer.linear_method.process_weights_after_loading(layer)
    torch.testing.assert_close(layer(x).float(), (x.float() @ w.float().T + b.float()), rtol=0.02, atol=0.1)
