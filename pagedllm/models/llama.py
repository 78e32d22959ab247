"""Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2, Qwen3), with q|k|v
and gate|up fused projections. Inputs are one flattened batch: ``input_ids`` and
``positions`` int64 [T]; attention uses the bound paged KV cache and the forward context."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.layers.activation import get_act_and_mul
from pagedllm.layers.attention import Attention, kv_scale_target
from pagedllm.layers.layernorm import RMSNorm, residual_stream
from pagedllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.rotary_embedding import RotaryEmbedding
from pagedllm.layers.utils import default_weight_loader
from pagedllm.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.models.arch_config import ModelArchConfig
from pagedllm.models.fused_decoder import FusedDecoder

# Checkpoint (HF) projection names → (our fused parameter, shard id of its weight_loader).
STACKED_PARAMS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}



def _param_for(name: str) -> tuple[str, str | int | None]:
    """Our parameter and shard id for a checkpoint name (a name not stacked maps to itself)."""
    head, _, leaf = name.rpartition(".")
    base, _, proj = head.rpartition(".")
    if proj in STACKED_PARAMS:
        fused, shard = STACKED_PARAMS[proj]
        return f"{base}.{fused}.{leaf}", shard
    return name, None


def _checkpoint_names(param_name: str) -> list[str]:
    """The checkpoint names that load ``param_name``."""
    head, _, leaf = param_name.rpartition(".")
    base, _, module = head.rpartition(".")
    projs = [proj for proj, (fused, _) in STACKED_PARAMS.items() if fused == module]
    return [f"{base}.{proj}.{leaf}" for proj in projs] or [param_name]


class LlamaAttention(nn.Module):
    """q|k|v projection, optional q/k norms, RoPE, paged attention (``scale`` default
    head_dim ** -0.5; ``sliding_window`` tokens or all), output projection."""

    def __init__(self, cfg: ModelArchConfig, layer_idx: int, rotary_emb: RotaryEmbedding,
                 dtype: torch.dtype, device: torch.device, prefix: str, quant_config=None,
                 norm_class: type[RMSNorm] = RMSNorm, scale: float | None = None,
                 sliding_window: int | None = None):
        super().__init__()
        h, nh, self.hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.qkv_proj = QKVParallelLinear(h, self.hd, nh, cfg.num_key_value_heads, cfg.attention_bias, dtype,
                                          device, prefix=f"{prefix}.qkv_proj", quant_config=quant_config)
        self.o_proj = RowParallelLinear(nh * self.hd, h, False, dtype, device, prefix=f"{prefix}.o_proj",
                                        quant_config=quant_config)
        self.nh, self.nkv = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads   # this rank's
        self.q_norm = norm_class(self.hd, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.k_norm = norm_class(self.hd, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.nh, self.hd, self.hd ** -0.5 if scale is None else scale, self.nkv, layer_idx,
                              dtype, device, sliding_window=sliding_window)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        T, q_size, kv_size = qkv.shape[0], self.qkv_proj.q_size, self.qkv_proj.kv_size
        q = qkv[:, :q_size].view(T, self.nh, self.hd)
        k = qkv[:, q_size: q_size + kv_size].view(T, self.nkv, self.hd)
        v = qkv[:, q_size + kv_size:].view(T, self.nkv, self.hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``; ``activation``: a HF ``hidden_act`` name.

    Raises:
        ValueError: an unsupported ``activation`` (named)."""

    def __init__(self, cfg: ModelArchConfig, dtype: torch.dtype, device: torch.device, prefix: str,
                 quant_config=None, activation: str = "silu"):
        super().__init__()
        h, inter = cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(h, [inter, inter], False, dtype, device,
                                                       prefix=f"{prefix}.gate_up_proj", quant_config=quant_config)
        self.down_proj = RowParallelLinear(inter, h, False, dtype, device, prefix=f"{prefix}.down_proj",
                                           quant_config=quant_config)
        self.act_fn = get_act_and_mul(activation, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_idx: int, rotary_emb: RotaryEmbedding,
                 dtype: torch.dtype, device: torch.device, prefix: str, quant_config=None):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, device)
        self.self_attn = LlamaAttention(cfg, layer_idx, rotary_emb, dtype, device, f"{prefix}.self_attn",
                                        quant_config, sliding_window=cfg.layer_window(layer_idx))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, device)
        self.mlp = self.make_mlp(cfg, layer_idx, dtype, device, f"{prefix}.mlp", quant_config)

    def make_mlp(self, cfg: ModelArchConfig, layer_idx: int, dtype: torch.dtype, device: torch.device,
                 prefix: str, quant_config=None) -> nn.Module:
        """Layer ``layer_idx``'s feed-forward block, [T, hidden] → [T, hidden] (subclasses override)."""
        return LlamaMLP(cfg, dtype, device, prefix, quant_config)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden]; residual float32 [T, hidden] or None for the first layer. Returns (output, residual)."""
        if residual is None:
            residual = residual_stream(x)
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(positions, h), residual)
        return self.mlp(h), residual

    def fused_operands(self, kernels) -> dict | str:
        """``DecoderStack.add_layer``'s arguments plus ``kernels`` (the attention backend's C++
        module, given) and ``shape`` for ``FusedDecoder``, or a string saying why this layer
        cannot run in C++."""
        at, mlp = self.self_attn, self.mlp
        if (type(self).forward is not LlamaDecoderLayer.forward or type(at) is not LlamaAttention
                or type(mlp) is not LlamaMLP or at.q_norm is not None):
            return "not the plain Llama layer (q/k norms, another MLP or forward)"
        if at.o_proj.tp_size > 1:
            return f"tensor parallel (tp={at.o_proj.tp_size}): the C++ stack has no all-reduce"
        if kernels is None or at.attn.kv_cache is None:
            return "attention not on the C++ kernels"
        for part in (self.input_layernorm, self.post_attention_layernorm, at.rotary_emb, mlp.act_fn):
            if getattr(part, "_kernels", None) is None or (isinstance(part, RMSNorm)
                                                           and type(part).forward is not RMSNorm.forward):
                return f"{type(part).__name__} not on the C++ kernels"
        linears = {"qkv": at.qkv_proj, "o": at.o_proj, "gate_up": mlp.gate_up_proj, "down": mlp.down_proj}
        ops: dict = {}
        for name, lin in linears.items():
            ops[name] = lin.linear_method.stack_linear(lin, kernels)
            if ops[name] is None:
                return f"linear {lin.linear_method.layer_name(lin)} has no C++ stack form"
        k_scale, v_scale = at.attn.kv_scales
        key_cache, value_cache = at.attn.kv_cache[0], at.attn.kv_cache[1]
        return dict(ops, input_norm=self.input_layernorm.weight.data,
                    post_norm=self.post_attention_layernorm.weight.data,
                    key_cache=key_cache, value_cache=value_cache, k_scale=k_scale, v_scale=v_scale,
                    kernels=kernels,
                    shape=(at.nh, at.nkv, at.hd, self.input_layernorm.eps, at.attn.scale))


class LlamaModel(nn.Module):
    # the class of each decoder layer (a subclass may change its feed-forward block)
    decoder_layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, cfg: ModelArchConfig, dtype: torch.dtype, device: torch.device, max_positions: int,
                 quant_config=None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, device,
                                                   quant_config, prefix="model.embed_tokens")
        rotary_emb = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype, device)
        self.layers = nn.ModuleList(
            self.decoder_layer_class(cfg, i, rotary_emb, dtype, device, f"model.layers.{i}", quant_config)
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        # every layer in one C++ call when they allow it (models/fused_decoder.py)
        self.fused_decoder = FusedDecoder()

    def prepare_fused(self, kernels) -> str | None:
        """Build the fused stack over the C++ module ``kernels``; None when it applies, else why not."""
        return self.fused_decoder.prepare(self.layers, kernels)

    def forward_fused(self, input_ids: torch.Tensor, positions: torch.Tensor, kernel_md) -> torch.Tensor:
        """``forward`` as one C++ stack call (after ``prepare_fused`` returned None); bitwise equal."""
        return self.fused_decoder(self.layers, self.embed_tokens(input_ids), positions, kernel_md)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        return residual + x         # float32 [T, hidden]: the final norm rounds it


class LlamaForCausalLM(nn.Module):
    """Decoder-only causal LM over a paged KV cache, HF parameter names (q/k/v, gate/up fused).
    ``dtype``: float32, bfloat16 or float16; ``max_positions``: RoPE table size (tokens);
    ``quant_config``: the ``--quantization`` config or None."""

    # The decoder stack (a subclass may swap in one with other layers).
    base_model_class: type[LlamaModel] = LlamaModel

    # Our fused layers and the checkpoint projections in each (for quantization configs).
    packed_modules_mapping = {fused: [p for p, (f, _) in STACKED_PARAMS.items() if f == fused]
                              for fused, _ in STACKED_PARAMS.values()}

    def __init__(self, cfg: ModelArchConfig, dtype: torch.dtype, device: torch.device,
                 max_positions: int, quant_config=None):
        super().__init__()
        self.cfg = cfg
        self.model = self.base_model_class(cfg, dtype, device, max_positions, quant_config)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype, device,
                                      self.model.embed_tokens if cfg.tie_word_embeddings else None,
                                      quant_config=quant_config, prefix="lm_head")

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """All layers over the flattened batch: ``input_ids``, ``positions`` int64 [T] → hidden
        states before the final norm, float32 [T, hidden]."""
        return self.model(input_ids, positions)

    def prepare_fused(self, kernels) -> str | None:
        """The decoder stack as one C++ call (``models/fused_decoder.py``): None when it applies
        over the C++ module ``kernels``, else why not."""
        prepare = getattr(self.model, "prepare_fused", None)
        return f"{type(self.model).__name__} has no fused form" if prepare is None else prepare(kernels)

    @torch.inference_mode()
    def forward_fused(self, input_ids: torch.Tensor, positions: torch.Tensor, kernel_md) -> torch.Tensor:
        """``forward`` through the fused stack (after ``prepare_fused`` returned None)."""
        return self.model.forward_fused(input_ids, positions, kernel_md)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: [N, hidden] → float32 [N, vocab]."""
        return self.lm_head(self.model.norm(hidden))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors and KV-cache scales; unknown names are skipped.

        Raises:
            ValueError: a missing or mis-shaped tensor, or a bad KV-cache scale."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        fused = getattr(self.model, "fused_decoder", None)
        if fused is not None:
            fused.invalidate()   # it holds the weights it was built with
        loaded: set[str] = set()
        for name, tensor in weights:
            target = kv_scale_target(name)
            if target is not None:
                attn = modules.get(target[0])
                if isinstance(attn, Attention):
                    for which in target[1]:
                        attn.set_kv_scale(which, tensor, name)
                continue
            pname, shard = _param_for(name)
            param = params.get(pname)
            if param is None:
                continue
            load = getattr(param, "weight_loader", None)
            if load is None:
                default_weight_loader(param, tensor, name)
            else:
                load(param, tensor, shard)
            loaded.add(name)
        required = {hf for pname in params for hf in _checkpoint_names(pname)}
        missing = sorted(required - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")
