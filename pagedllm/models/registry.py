"""Model registry: HF architecture name → model class."""
from __future__ import annotations

import torch

from pagedllm.models.arch_config import ModelArchConfig
from pagedllm.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[torch.nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def get_model_class(cfg: ModelArchConfig) -> type[torch.nn.Module]:
    """Raises ValueError naming an architecture that is not registered."""
    if cfg.architecture not in MODEL_REGISTRY:
        raise ValueError(
            f"unsupported model architecture {cfg.architecture!r}; supported: {sorted(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[cfg.architecture]


def build_model(path: str, cfg: ModelArchConfig, dtype: torch.dtype, device: torch.device,
                max_positions: int) -> torch.nn.Module:
    """Instantiate the registered class and load weights from a GGUF file or HF dir."""
    from pagedllm.models.loader import iter_weights

    cls = get_model_class(cfg)
    model = cls(cfg, dtype, device, max_positions)
    model.load_weights(iter_weights(path, cfg))
    if hasattr(model, "pack_weights"):
        model.pack_weights()
    return model.eval()
