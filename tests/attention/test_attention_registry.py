"""The attention-backend registry (``attention/registry.py``): every name in the table
imports to the class of that name, ``auto`` picks by device, unknown names are clear errors,
and the start-up line says which backend runs and why."""
from __future__ import annotations

import pytest
import torch

from pagedllm.attention import registry
from pagedllm.attention.backend import AttentionBackend
from pagedllm.config import EngineArgs
from pagedllm.errors import InvalidParameterError


@pytest.mark.parametrize("name", sorted(registry.ATTENTION_BACKENDS))
def test_every_registered_backend_imports_under_its_name(name):
    cls = registry.attention_backend_class(name)
    assert issubclass(cls, AttentionBackend) and cls.name == name
    assert cls.kv_cache_dtypes, f"{name} declares no KV-cache dtype"


def test_auto_picks_by_device(monkeypatch):
    assert registry.choose_attention_backend("auto", None) == ("cpu_kernel", "auto: the CPU")
    assert registry.choose_attention_backend("auto", "cpu", torch.bfloat16)[0] == "cpu_kernel"
    assert registry.choose_attention_backend("auto", "cpu", torch.float16) == (
        "torch", "auto: no C++ attention kernel for float16")
    assert registry.choose_attention_backend("auto", "cuda:0") == ("triton", "auto: CUDA")
    monkeypatch.setattr(registry, "_triton_importable", lambda: False)
    assert registry.choose_attention_backend("auto", "cuda") == ("torch", "auto: CUDA without triton installed")
    assert registry.choose_attention_backend("torch", "cuda") == ("torch", "--attention-backend")


def test_unknown_names_are_clear_errors():
    with pytest.raises(ValueError, match="unknown attention backend 'flash'.*cpu_kernel, torch, triton"):
        registry.get_attention_backend("flash")
    with pytest.raises(InvalidParameterError, match="attention_backend") as e:
        EngineArgs(attention_backend="flash").validate()
    assert e.value.param == "attention_backend"


def test_backends_declare_what_they_need():
    torch_be = registry.get_attention_backend("torch", "cpu", torch.float32)
    assert torch_be.contiguous_v and not torch_be.cudagraph_support and torch_be.why == "--attention-backend"
    cpu_be = registry.get_attention_backend("auto", "cpu", torch.float32)
    assert cpu_be.name == "cpu_kernel" and cpu_be.why == "auto: the CPU"
    assert cpu_be.contiguous_v == (cpu_be.kernels is None)


def test_start_up_line_says_which_backend_and_why(make_llm):
    from engine_helpers import model_runner

    llm = make_llm(attention_backend="auto")
    line = model_runner(llm.llm_engine).describe_compute_path()
    assert line.startswith("attention backend cpu_kernel (") and "[auto: the CPU]" in line
    assert "decoder " in line
