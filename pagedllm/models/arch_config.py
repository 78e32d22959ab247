"""Architecture hyper-parameters of a decoder-only transformer, read from a GGUF file's
metadata or a HF ``config.json``."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from pagedllm.models.registry import arch_info, architecture_for_gguf


@dataclass
class ModelArchConfig:
    """What the model code needs to build a network.

    Attributes:
        architecture: HF architecture name, e.g. ``"LlamaForCausalLM"`` (registry key).
        hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
        num_key_value_heads, head_dim, vocab_size: sizes (GQA when kv heads < heads).
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: RoPE base frequency; ``rope_scaling``: HF's rope_scaling dict or None.
        max_position_embeddings: the model's trained context length, in tokens.
        tie_word_embeddings: lm_head shares the embedding matrix.
        attention_bias: q/k/v projections carry a bias (Qwen2).
        qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3).
        bos_token_id, eos_token_ids: special tokens from the config/metadata.
    """

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def kv_bytes_per_block(self, block_size: int, dtype) -> int:
        """Bytes of K and V for one KV-cache block of ``block_size`` tokens across all
        layers, with elements of ``dtype`` (a ``torch.dtype``; its ``itemsize`` bytes)."""
        return 2 * self.num_hidden_layers * block_size * self.num_key_value_heads * self.head_dim * dtype.itemsize


def _arch_flags(architecture: str) -> dict[str, bool]:
    """The registry's variant flags of ``architecture``; raises ValueError if unsupported."""
    info = arch_info(architecture)
    return {"attention_bias": info.attention_bias, "qk_norm": info.qk_norm}


def config_from_hf_dir(path: str) -> ModelArchConfig:
    """Read ``config.json`` of a HF-format model directory.

    Raises:
        FileNotFoundError: no config.json in ``path``.
        ValueError: the config names no architecture.
    """
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"{path!r} has no config.json: not a HF-format model directory")
    with open(cfg_path) as f:
        c = json.load(f)
    archs = c.get("architectures") or []
    if not archs:
        raise ValueError(f"{cfg_path} names no 'architectures'")
    arch = archs[0]
    flags = _arch_flags(arch)
    heads = c["num_attention_heads"]
    eos = c.get("eos_token_id")
    eos_ids = [] if eos is None else (list(eos) if isinstance(eos, list) else [eos])
    # transformers >= 5 writes "rope_parameters" (theta and scaling in one dict);
    # older configs have "rope_theta" and "rope_scaling".
    rope_params = c.get("rope_parameters") or {}
    rope_theta = c.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    rope_scaling = c.get("rope_scaling")
    if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
        rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
    if "attention_bias" in c:
        flags["attention_bias"] = bool(c["attention_bias"]) or flags["attention_bias"]
    return ModelArchConfig(
        architecture=arch,
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        vocab_size=c["vocab_size"],
        rms_norm_eps=c.get("rms_norm_eps", 1e-5),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        max_position_embeddings=c.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        bos_token_id=c.get("bos_token_id"),
        eos_token_ids=eos_ids,
        **flags,
    )


def config_from_gguf(reader) -> ModelArchConfig:
    """Build the config from a ``gguf.GGUFReader``'s metadata (llama.cpp's key names).

    Raises:
        ValueError: the GGUF architecture is not one pagedllm implements (named in the message).
    """
    def get(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    g_arch = get("general.architecture")
    arch = architecture_for_gguf(g_arch)
    p = g_arch + "."
    heads = int(get(p + "attention.head_count"))
    hidden = int(get(p + "embedding_length"))
    head_dim = int(get(p + "attention.key_length", get(p + "rope.dimension_count", hidden // heads)))
    tensor_names = {t.name for t in reader.tensors}
    vocab = get(p + "vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    rope_scaling = None
    st = get(p + "rope.scaling.type")
    if st and st != "none":
        rope_scaling = {"rope_type": st, "factor": float(get(p + "rope.scaling.factor", 1.0))}
        if get(p + "rope.scaling.original_context_length") is not None:
            rope_scaling["original_max_position_embeddings"] = int(
                get(p + "rope.scaling.original_context_length"))
    eos = get("tokenizer.ggml.eos_token_id")
    return ModelArchConfig(
        architecture=arch,
        hidden_size=hidden,
        intermediate_size=int(get(p + "feed_forward_length")),
        num_hidden_layers=int(get(p + "block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(get(p + "attention.head_count_kv", heads)),
        head_dim=head_dim,
        vocab_size=int(vocab),
        rms_norm_eps=float(get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get(p + "rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(get(p + "context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [int(eos)],
        **_arch_flags(arch),
    )
