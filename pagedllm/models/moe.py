"""Mixture-of-experts decoders, Mixtral (arXiv:2401.04088) and Qwen3-MoE (arXiv:2505.09388),
as transformers': Llama layers with a router and ``FusedMoE`` where ``is_moe_layer``."""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagedllm.layers.fused_moe import FusedMoE, split_stacked
from pagedllm.layers.linear import ReplicatedLinear
from pagedllm.models.arch_config import ModelArchConfig
from pagedllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

# Mixtral's per-expert names → the gate/up/down names the rest of the loading knows.
_MIXTRAL_EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MIXTRAL_EXPERT_RE = re.compile(r"^(?P<base>.+\.mlp\.experts\.\d+)\.(?P<w>w[123])\.weight$")
# A tensor holding every expert of a layer (3-D, experts first).
_STACKED_RE = re.compile(r"^(?P<base>.+\.mlp\.experts)\.(?P<proj>gate_up|gate|up|down)_proj(?:\.weight)?$")


def moe_checkpoint_weights(weights: Iterable[tuple[str, torch.Tensor]], intermediate_size: int
                           ) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` (HF name, tensor) with every expert weight as one 2-D
    ``...mlp.experts.{e}.{gate,up,down}_proj.weight`` (stacked ones split by
    ``intermediate_size`` into views); other tensors unchanged. Layouts: docs/notes/models.md."""
    for name, tensor in weights:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        m = _MIXTRAL_EXPERT_RE.match(name)
        if m:
            name = f"{m['base']}.{_MIXTRAL_EXPERT_PROJ[m['w']]}.weight"
        m = _STACKED_RE.match(name)
        if m and tensor.dim() == 3:
            for e, shard, w in split_stacked(m["proj"], tensor, intermediate_size):
                yield f"{m['base']}.{e}.{shard}_proj.weight", w
            continue
        yield name, tensor


class SparseMoeBlock(nn.Module):
    """Router logits ``gate(x)`` [T, E] (kept dense under quantization, as vLLM), then
    ``FusedMoE``: x [T, hidden] → [T, hidden] in x's dtype."""

    def __init__(self, cfg: ModelArchConfig, dtype: torch.dtype, device: torch.device, prefix: str,
                 quant_config=None):
        super().__init__()
        self.gate = ReplicatedLinear(cfg.hidden_size, cfg.num_experts, False, dtype, device,
                                     prefix=f"{prefix}.gate")
        self.experts = FusedMoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                                cfg.moe_intermediate_size or cfg.intermediate_size, cfg.norm_topk_prob,
                                dtype, device, prefix=f"{prefix}.experts", quant_config=quant_config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


class MoeDecoderLayer(LlamaDecoderLayer):
    """A Llama layer with a ``SparseMoeBlock`` where ``cfg.is_moe_layer(layer_idx)``."""

    def make_mlp(self, cfg, layer_idx, dtype, device, prefix, quant_config=None):
        if cfg.is_moe_layer(layer_idx):
            return SparseMoeBlock(cfg, dtype, device, prefix, quant_config)
        return super().make_mlp(cfg, layer_idx, dtype, device, prefix, quant_config)


class MoeModel(LlamaModel):
    decoder_layer_class = MoeDecoderLayer


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral over the paged KV cache. Args as ``LlamaForCausalLM``'s.

    Raises:
        ValueError: ``num_experts_per_tok`` outside 1..``num_experts``.
        InvalidParameterError("quantization"): a method the experts cannot use."""

    base_model_class = MoeModel

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """``LlamaForCausalLM.load_weights`` over ``moe_checkpoint_weights(weights)``.

        Raises:
            ValueError: a missing or mis-shaped weight (named)."""
        inter = self.cfg.moe_intermediate_size or self.cfg.intermediate_size
        super().load_weights(moe_checkpoint_weights(weights, inter))


class Qwen3MoeForCausalLM(MixtralForCausalLM):
    """Qwen3-MoE: Mixtral's model with q/k norm, optional top-k renormalisation and dense layers."""
