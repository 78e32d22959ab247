"""Environment switches: every spelling a user may reach for, and a clear error for a typo
(``PAGEDLLM_AMX=false`` used to leave AMX on, since only the exact string ``0`` counted)."""
from __future__ import annotations

import pytest

from pagedllm import envs

SWITCHES = [(envs.amx_enabled, "PAGEDLLM_AMX", True), (envs.onednn_enabled, "PAGEDLLM_ONEDNN", True),
            (envs.cpu_kernels_enabled, "PAGEDLLM_CPU_KERNELS", True),
            (envs.avx2_int8_enabled, "PAGEDLLM_AVX2_INT8", True),
            (envs.fused_decoder_enabled, "PAGEDLLM_FUSED_DECODER", True),
            (envs.batch_invariant_probe_enabled, "PAGEDLLM_BATCH_INVARIANT_PROBE", True),
            (envs.configure_logging, "PAGEDLLM_CONFIGURE_LOGGING", True),
            (envs.allow_long_max_model_len, "PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN", False),
            (envs.triton_interpret, "TRITON_INTERPRET", False)]


@pytest.mark.parametrize("read, name, default", SWITCHES)
def test_switch_spellings(monkeypatch, read, name, default):
    monkeypatch.delenv(name, raising=False)
    assert read() is default
    for raw, want in [("0", False), ("false", False), ("OFF", False), (" no ", False), ("False", False),
                      ("1", True), ("true", True), ("On", True), ("YES", True), ("", default)]:
        monkeypatch.setenv(name, raw)
        assert read() is want, (name, raw)


@pytest.mark.parametrize("raw", ["00", "2", "disable", "fasle"])
def test_switch_typo_is_an_error_naming_the_variable(monkeypatch, raw):
    monkeypatch.setenv("PAGEDLLM_AMX", raw)
    with pytest.raises(ValueError, match=f"PAGEDLLM_AMX must be 1 or 0 .*got '{raw}'"):
        envs.amx_enabled()
