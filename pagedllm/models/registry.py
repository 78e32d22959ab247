"""Model registry: each supported architecture's model class (imported lazily), GGUF name and variant flags."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedllm.models.arch_config import ModelArchConfig


# The --dtype names the shared layers run in; an architecture may run in fewer (ArchInfo.dtypes).
ALL_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ArchInfo:
    """One architecture.

    Attributes:
        model_class: ``"module:Class"``, imported on first use; gguf_arch: llama.cpp's name.
        attention_bias, qk_norm: as ``ModelArchConfig``'s.
        gguf_rope_permuted: the loader undoes llama.cpp's q/k row permutation.
        gguf_norm_shift: subtracted from GGUF RMSNorm weights (Gemma: 1).
        sliding_window: some layers are local; hf_sliding_window: config.json's
            ``sliding_window`` makes layers local (``arch_config._windows_from_hf``).
        models: families covered, for ``pagedllm models``; moe: MoE feed-forward layers.
        dtypes: the ``--dtype`` names it runs in."""

    model_class: str
    gguf_arch: str
    attention_bias: bool = False
    qk_norm: bool = False
    gguf_rope_permuted: bool = False
    gguf_norm_shift: float = 0.0
    sliding_window: bool = False
    hf_sliding_window: bool = False
    models: str = ""
    moe: bool = False
    dtypes: tuple[str, ...] = ALL_DTYPES


_LLAMA = "pagedllm.models.llama:LlamaForCausalLM"

# HF architecture name (config.json "architectures"[0]) → what it is.
ARCHITECTURES: dict[str, ArchInfo] = {
    "LlamaForCausalLM": ArchInfo(_LLAMA, "llama", gguf_rope_permuted=True,
                                 models="Llama 2/3, SmolLM2, TinyLlama"),
    "MistralForCausalLM": ArchInfo(_LLAMA, "mistral", gguf_rope_permuted=True, hf_sliding_window=True,
                                   models="Mistral"),
    "Qwen2ForCausalLM": ArchInfo(_LLAMA, "qwen2", attention_bias=True, hf_sliding_window=True,
                                 models="Qwen2, Qwen2.5"),
    "Qwen3ForCausalLM": ArchInfo(_LLAMA, "qwen3", qk_norm=True, models="Qwen3"),
    "Gemma3ForCausalLM": ArchInfo("pagedllm.models.gemma3:Gemma3ForCausalLM", "gemma3", qk_norm=True,
                                  gguf_norm_shift=1.0, sliding_window=True, models="Gemma 3 (text)",
                                  dtypes=("float32", "bfloat16")),
    "MixtralForCausalLM": ArchInfo("pagedllm.models.moe:MixtralForCausalLM", "llama", gguf_rope_permuted=True,
                                   moe=True, hf_sliding_window=True, models="Mixtral 8x7B, 8x22B"),
    "Qwen3MoeForCausalLM": ArchInfo("pagedllm.models.moe:Qwen3MoeForCausalLM", "qwen3moe", qk_norm=True,
                                    moe=True, models="Qwen3-MoE (30B-A3B, 235B-A22B)"),
}

# What every architecture runs with (the layers are shared): the --quantization methods
# (``layers/quantization``; "gguf" keeps a GGUF's Q8_0/Q4_0/Q4_1 blocks packed, so it
# needs a file of those types).
QUANTIZATION = ("int8", "gguf", "q8_0", "q4_0", "q4_1")


def describe_architectures() -> list[dict[str, str]]:
    """One row per registered architecture, for ``pagedllm models``."""
    return [{"architecture": name, "gguf": info.gguf_arch, "models": info.models,
             "dtypes": ", ".join(info.dtypes),
             # stacked 3-D expert tensors of a GGUF are dequantized, not kept packed
             "quantization": ", ".join(q if not (info.moe and q == "gguf") else "gguf (per-expert tensors)"
                                       for q in QUANTIZATION),
             "sliding_window": ("yes" if info.sliding_window else
                                "when config.json sets it" if info.hf_sliding_window else "no"),
             "moe": "yes" if info.moe else "no"}
            for name, info in ARCHITECTURES.items()]


def arch_info(architecture: str) -> ArchInfo:
    """Raises ValueError naming an ``architecture`` that is not registered."""
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[architecture]


def architecture_for_gguf(gguf_arch: str, moe: bool = False) -> str:
    """The HF architecture of a GGUF ``general.architecture`` (shared: the one matching ``moe``).

    Raises:
        ValueError: no registered architecture has it."""
    names = [name for name, info in ARCHITECTURES.items() if info.gguf_arch == gguf_arch]
    if names:
        return next((n for n in names if ARCHITECTURES[n].moe == moe), names[0])
    raise ValueError(f"unsupported GGUF architecture {gguf_arch!r}; "
                     f"supported: {sorted({i.gguf_arch for i in ARCHITECTURES.values()})}")


def get_model_class(cfg: ModelArchConfig) -> type[torch.nn.Module]:
    """Raises ValueError naming an architecture that is not registered."""
    module, cls = arch_info(cfg.architecture).model_class.split(":")
    return getattr(importlib.import_module(module), cls)
