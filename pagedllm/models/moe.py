"""Mixture-of-experts decoders: Mixtral (Jiang et al. 2024, "Mixtral of Experts",
arXiv:2401.04088) and Qwen3-MoE (Qwen Team 2025, "Qwen3 Technical Report",
arXiv:2505.09388), as transformers' ``MixtralForCausalLM`` and ``Qwen3MoeForCausalLM``.

Both are the Llama decoder (``llama.py``: fused q|k|v attention, RMSNorm, RoPE; Qwen3-MoE
with the per-head q/k norm, ``ModelArchConfig.qk_norm``) whose feed-forward block is, in
the layers ``ModelArchConfig.is_moe_layer`` names, a router linear (``mlp.gate``, E
logits a token) and ``FusedMoE`` (``layers/fused_moe.py``: softmax, top-k, the experts'
SwiGLU MLPs, weighted sum). Mixtral has experts in every layer and renormalises the
top-k weights; Qwen3-MoE renormalises when ``norm_topk_prob`` and keeps a dense MLP
(``intermediate_size`` wide) in ``mlp_only_layers`` and in the layers that
``decoder_sparse_step`` skips.

Checkpoint names (all reach ``LlamaForCausalLM.load_weights`` as one expert's
``mlp.experts.{e}.{gate,up,down}_proj.weight``, see ``moe_checkpoint_weights``):
Mixtral's ``block_sparse_moe.experts.{e}.w1/w3/w2`` (what transformers 5.24 still
writes), Qwen3-MoE's ``mlp.experts.{e}.gate_proj/up_proj/down_proj``, transformers 5's
in-memory fused ``mlp.experts.gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj``
[E, H, I], and the GGUF loader's stacked ``mlp.experts.{gate,up,down}_proj.weight``
(llama.cpp's ``ffn_{gate,up,down}_exps``).
"""
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
    """The checkpoint's tensors with every expert weight as one expert's 2-D projection,
    named ``model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight``: Mixtral's
    ``block_sparse_moe`` is renamed ``mlp`` and its ``w1/w3/w2`` ``gate/up/down_proj``;
    a stacked 3-D tensor is split into views by ``fused_moe.split_stacked`` (no copy).
    Other tensors pass unchanged.

    Args:
        weights: (HF name, tensor) pairs, as ``models.loader.iter_weights`` yields them.
        intermediate_size: each expert's hidden width (to split a fused gate|up).
    """
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
    """The MoE feed-forward block: router logits ``gate(x)`` [T, E], then ``experts``
    (``FusedMoE``). x [T, hidden] → [T, hidden] in x's dtype.

    The router stays dense under ``--quantization`` (as vLLM keeps it): E outputs a token
    cost little, and the top-k choice is where rounding would move outputs most.
    """

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
    """A Llama decoder layer whose feed-forward block is a ``SparseMoeBlock`` where
    ``cfg.is_moe_layer(layer_idx)``, else the dense MLP."""

    def make_mlp(self, cfg, layer_idx, dtype, device, prefix, quant_config=None):
        if cfg.is_moe_layer(layer_idx):
            return SparseMoeBlock(cfg, dtype, device, prefix, quant_config)
        return super().make_mlp(cfg, layer_idx, dtype, device, prefix, quant_config)


class MoeModel(LlamaModel):
    decoder_layer_class = MoeDecoderLayer


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral over the paged KV cache: ``LlamaForCausalLM`` with ``SparseMoeBlock`` feed-
    forward blocks (every layer; top-k weights renormalised: Mixtral's configs carry no
    ``norm_topk_prob``, which reads as true). Args as ``LlamaForCausalLM``'s.

    Raises:
        ValueError: ``num_experts_per_tok`` outside 1..``num_experts``.
        InvalidParameterError("quantization"): a method the experts cannot use.
    """

    base_model_class = MoeModel

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """``LlamaForCausalLM.load_weights`` over ``moe_checkpoint_weights(weights)``, so
        per-expert and stacked checkpoints load alike, and a missing expert is named
        (e.g. ``model.layers.0.mlp.experts.3.up_proj.weight``).

        Raises:
            ValueError: a missing or mis-shaped weight (named).
        """
        inter = self.cfg.moe_intermediate_size or self.cfg.intermediate_size
        super().load_weights(moe_checkpoint_weights(weights, inter))


class Qwen3MoeForCausalLM(MixtralForCausalLM):
    """Qwen3-MoE: ``MixtralForCausalLM`` with the q/k norm (``qk_norm``), top-k weights
    renormalised only when ``norm_topk_prob``, and dense MLP layers where
    ``mlp_only_layers`` / ``decoder_sparse_step`` say (all read from the config)."""
