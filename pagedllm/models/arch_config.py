"""Architecture hyper-parameters of a decoder-only transformer, from GGUF metadata or a HF ``config.json``."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from pagedllm.distributed import kv_head_shard
from pagedllm.models.registry import arch_info, architecture_for_gguf


@dataclass
class ModelArchConfig:
    """What the model code needs to build a network (HF's field names; lengths in tokens).

    Attributes:
        architecture: HF architecture name (registry key); rope_scaling: HF's dict or None.
        attention_bias: q/k/v projections carry a bias; qk_norm: per-head q/k RMSNorm before RoPE.
        sliding_window: the local layers' window (a query at p sees keys p - window + 1 .. p),
            or None; layer_types: per layer ``"full_attention"`` / ``"sliding_attention"``
            (None: all full); rope_local_theta: the local layers' RoPE base (None: rope_theta).
        query_pre_attn_scalar: softmax scale is its -1/2 power (None: ``head_dim ** -0.5``).
        hidden_activation: the gated MLP's activation (HF ``hidden_act`` name).
        final_logit_softcapping: logits become ``c * tanh(logits / c)``, or None.
        num_experts (0: dense), num_experts_per_tok (top-k), moe_intermediate_size,
            norm_topk_prob (renormalise top-k weights), decoder_sparse_step and
            mlp_only_layers (which layers are MoE: ``is_moe_layer``)."""

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
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    hidden_activation: str = "silu"
    final_logit_softcapping: float | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether ``layer``'s feed-forward block is MoE (transformers' ``Qwen3MoeDecoderLayer`` rule)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % max(1, self.decoder_sparse_step) == 0)

    def is_sliding(self, layer: int) -> bool:
        return (self.sliding_window is not None and self.layer_types is not None
                and self.layer_types[layer] == "sliding_attention")

    def layer_window(self, layer: int) -> int | None:
        """``layer``'s sliding window in tokens, or None (whole context)."""
        return self.sliding_window if self.is_sliding(layer) else None

    def layer_windows(self) -> list[int | None]:
        return [self.layer_window(i) for i in range(self.num_hidden_layers)]

    def num_kv_heads_per_rank(self, tp_size: int = 1) -> int:
        """KV heads one tensor-parallel rank holds (``distributed.kv_head_shard``)."""
        return kv_head_shard(self.num_key_value_heads, 0, tp_size)[1]

    def kv_bytes_per_block(self, block_size: int, dtype, layers_per_block: int | None = None,
                           tp_size: int = 1) -> int:
        """Bytes of K and V for one block of ``block_size`` tokens over ``layers_per_block`` layers
        (default all) in ``dtype`` (a ``torch.dtype``) on one of ``tp_size`` ranks."""
        n = self.num_hidden_layers if layers_per_block is None else layers_per_block
        return 2 * n * block_size * self.num_kv_heads_per_rank(tp_size) * self.head_dim * dtype.itemsize


def _arch_flags(architecture: str) -> dict[str, bool]:
    """The registry's variant flags of ``architecture``; raises ValueError if unsupported."""
    info = arch_info(architecture)
    return {"attention_bias": info.attention_bias, "qk_norm": info.qk_norm}


def config_from_hf_dir(path: str) -> ModelArchConfig:
    """Read ``config.json`` of a HF-format model directory.

    Raises:
        FileNotFoundError: no config.json; ValueError: no, or an unsupported, architecture or field."""
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
    extra = {}
    if arch_info(arch).sliding_window:
        extra = _hybrid_from_hf(c, c["num_hidden_layers"])
        rope_theta = extra.pop("rope_theta", rope_theta)
        rope_scaling = extra.pop("rope_scaling", None)
    else:
        extra = _windows_from_hf(arch, c, c["num_hidden_layers"])
    if arch_info(arch).moe:
        extra.update(_moe_from_hf(c))
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
        **extra,
    )


def _layer_types(num_layers: int, pattern: int) -> list[str]:
    """Gemma's pattern: every ``pattern``-th layer global, the others local (transformers, llama.cpp)."""
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]


# Gemma 3's architecture constants where a checkpoint does not state them (transformers'
# Gemma3TextConfig defaults; llama.cpp's gemma3 loader uses the same): one global layer in
# six, RoPE base 10,000 on the local layers.
_GEMMA3_SWA_PATTERN = 6
_GEMMA3_LOCAL_THETA = 10000.0


def _hybrid_from_hf(c: dict, num_layers: int) -> dict:
    """Gemma 3's sliding-window and RoPE fields from ``config.json`` (old and new formats).

    Raises:
        ValueError: ``attn_logit_softcapping`` is set."""
    types = c.get("layer_types") or _layer_types(num_layers, int(c.get("sliding_window_pattern") or
                                                               _GEMMA3_SWA_PATTERN))
    rp = c.get("rope_parameters") or {}
    full, local = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
    theta = full.get("rope_theta", c.get("rope_theta", 1_000_000.0))
    scaling = c.get("rope_scaling")
    if scaling is None and full.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in full.items() if k != "rope_theta"}
    if c.get("attn_logit_softcapping") is not None:
        raise ValueError("attn_logit_softcapping is not supported (Gemma 2's attention soft-capping)")
    return {
        "sliding_window": c.get("sliding_window"),
        "layer_types": list(types),
        "rope_local_theta": float(local.get("rope_theta", c.get("rope_local_base_freq", _GEMMA3_LOCAL_THETA))),
        "query_pre_attn_scalar": c.get("query_pre_attn_scalar"),
        "hidden_activation": c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh",
        "final_logit_softcapping": c.get("final_logit_softcapping"),
        "rope_theta": float(theta),
        "rope_scaling": scaling,
    }


def _windows_from_hf(arch: str, c: dict, num_layers: int) -> dict:
    """The sliding window of a Llama-family ``config.json`` as transformers applies it (Mistral:
    every layer; Qwen2: with ``use_sliding_window``, per ``layer_types`` or ``max_window_layers``).

    Raises:
        ValueError: a ``sliding_window`` that is not a positive int."""
    sw = c.get("sliding_window")
    if not arch_info(arch).hf_sliding_window or sw is None:
        return {}
    if arch == "Qwen2ForCausalLM":
        if not c.get("use_sliding_window"):
            return {}
        start = int(c.get("max_window_layers", num_layers))
        types = c.get("layer_types") or ["sliding_attention" if i >= start else "full_attention"
                                         for i in range(num_layers)]
    else:
        types = ["sliding_attention"] * num_layers
    if not isinstance(sw, int) or isinstance(sw, bool) or sw < 1:
        raise ValueError(f"config.json: sliding_window must be a positive int or null, got {sw!r}")
    if "sliding_attention" not in types:
        return {}
    return {"sliding_window": sw, "layer_types": list(types)}


def _hybrid_from_gguf(get, p: str, num_layers: int, head_dim: int) -> dict:
    """Gemma 3's sliding-window fields from GGUF keys, else its constants (as llama.cpp)."""
    pat = get(p + "attention.sliding_window_pattern")
    if isinstance(pat, list):
        types = ["sliding_attention" if x else "full_attention" for x in pat]
    else:
        types = _layer_types(num_layers, int(pat or _GEMMA3_SWA_PATTERN))
    scale = get(p + "attention.scale")
    sw = get(p + "attention.sliding_window")
    return {
        "sliding_window": None if sw is None else int(sw),
        "layer_types": types,
        "rope_local_theta": float(get(p + "rope.freq_base_swa", _GEMMA3_LOCAL_THETA)),
        # llama.cpp scales by 1/sqrt(key_length) unless the file says otherwise
        "query_pre_attn_scalar": float(head_dim) if scale is None else float(scale) ** -2,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": get(p + "final_logit_softcapping"),
    }


def _moe_from_hf(c: dict) -> dict:
    return {
        "num_experts": int(c.get("num_local_experts") or c.get("num_experts") or 0),
        "num_experts_per_tok": int(c.get("num_experts_per_tok") or 0),
        "moe_intermediate_size": int(c.get("moe_intermediate_size") or c["intermediate_size"]),
        "norm_topk_prob": bool(c.get("norm_topk_prob", True)),
        "decoder_sparse_step": int(c.get("decoder_sparse_step") or 1),
        "mlp_only_layers": [int(i) for i in c.get("mlp_only_layers") or []],
    }


def _moe_from_gguf(get, p: str, num_layers: int, tensor_names: set[str]) -> dict:
    """The MoE fields of a GGUF file (llama.cpp's keys); a layer without a router tensor is dense."""
    ff = get(p + "feed_forward_length")
    return {
        "num_experts": int(get(p + "expert_count", 0) or 0),
        "num_experts_per_tok": int(get(p + "expert_used_count", 0) or 0),
        "moe_intermediate_size": int(get(p + "expert_feed_forward_length", ff) or 0),
        "norm_topk_prob": bool(get(p + "expert_weights_norm", True)),
        "mlp_only_layers": [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names],
    }


def config_from_gguf(reader) -> ModelArchConfig:
    """Build the config from a ``gguf.GGUFReader``'s metadata (llama.cpp's key names).

    Raises:
        ValueError: the GGUF architecture is not one pagedllm implements (named)."""
    def get(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    g_arch = get("general.architecture")
    p = g_arch + "."
    arch = architecture_for_gguf(g_arch, moe=int(get(p + "expert_count", 0) or 0) > 0)
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
    n_layers = int(get(p + "block_count"))
    extra = _hybrid_from_gguf(get, p, n_layers, head_dim) if arch_info(arch).sliding_window else {}
    if arch_info(arch).moe:
        extra.update(_moe_from_gguf(get, p, n_layers, tensor_names))
    return ModelArchConfig(
        architecture=arch,
        hidden_size=hidden,
        intermediate_size=int(get(p + "feed_forward_length", get(p + "expert_feed_forward_length"))),
        num_hidden_layers=n_layers,
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
        **extra,
    )
