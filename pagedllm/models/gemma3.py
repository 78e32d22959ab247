"""Gemma 3 text decoder (arXiv:2503.19786; transformers' ``Gemma3ForCausalLM``): Llama with
interleaved local/global layers, q/k norms, four ``GemmaRMSNorm``s a layer, GeGLU, scaled
embeddings, optional logit soft-capping. Inputs as ``llama.py``'s. Details: docs/notes/models.md."""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.layernorm import GemmaRMSNorm, residual_stream
from pagedllm.layers.rotary_embedding import RotaryEmbedding
from pagedllm.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.models.arch_config import ModelArchConfig
from pagedllm.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


def _gemma3_attention(cfg: ModelArchConfig, layer_idx: int, rotary_emb: RotaryEmbedding,
                      dtype: torch.dtype, device: torch.device, prefix: str, quant_config=None) -> LlamaAttention:
    scalar = cfg.query_pre_attn_scalar or cfg.head_dim
    return LlamaAttention(cfg, layer_idx, rotary_emb, dtype, device, prefix, quant_config, norm_class=GemmaRMSNorm,
                          scale=float(scalar) ** -0.5, sliding_window=cfg.layer_window(layer_idx))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_idx: int, rotary_emb: RotaryEmbedding,
                 dtype: torch.dtype, device: torch.device, prefix: str, quant_config=None):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps, dtype, device)
        self.self_attn = _gemma3_attention(cfg, layer_idx, rotary_emb, dtype, device, f"{prefix}.self_attn",
                                           quant_config)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, dtype, device)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype, device)
        # GeGLU: Llama's MLP with the config's gelu (``gelu_pytorch_tanh``)
        self.mlp = LlamaMLP(cfg, dtype, device, f"{prefix}.mlp", quant_config, activation=cfg.hidden_activation)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype, device)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden]; residual float32 [T, hidden] or None for the first layer. Returns (output, residual)."""
        if residual is None:
            residual = residual_stream(x)
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(positions, h))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ModelArchConfig, dtype: torch.dtype, device: torch.device, max_positions: int,
                 quant_config=None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, device,
                                                   quant_config, prefix="model.embed_tokens")
        # transformers multiplies by the scale rounded to the weights' dtype
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype, device=device),
                             persistent=False)
        rope_global = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype, device)
        rope_local = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_local_theta or cfg.rope_theta, None,
                                     dtype, device)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, i, rope_local if cfg.is_sliding(i) else rope_global, dtype, device,
                               f"model.layers.{i}", quant_config)
            for i in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids) * self.embed_scale
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        return residual + x


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 over the paged KV cache; loading as ``LlamaForCausalLM``'s.

    Raises:
        ValueError: an unsupported activation, or ``layer_types`` not matching the layers."""

    def __init__(self, cfg: ModelArchConfig, dtype: torch.dtype, device: torch.device,
                 max_positions: int, quant_config=None):
        nn.Module.__init__(self)
        if cfg.layer_types is not None and len(cfg.layer_types) != cfg.num_hidden_layers:
            raise ValueError(f"layer_types has {len(cfg.layer_types)} entries for {cfg.num_hidden_layers} layers")
        self.cfg = cfg
        self.model = Gemma3Model(cfg, dtype, device, max_positions, quant_config)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype, device,
                                      self.model.embed_tokens if cfg.tie_word_embeddings else None,
                                      quant_config=quant_config, prefix="lm_head")

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm, LM head, optional soft-capping: [N, hidden] → float32 [N, vocab]."""
        logits = self.lm_head(self.model.norm(hidden))
        c = self.cfg.final_logit_softcapping
        if c:
            logits = torch.tanh(logits / c) * c
        return logits
