"""Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2, Qwen3).

One module covers them: Qwen2 adds a bias to q/k/v, Qwen3 adds a per-head RMSNorm on q
and k before RoPE; Mistral is Llama's graph. Projections are fused for few ops a layer
(q|k|v as one matmul, gate|up as one), the shapes vLLM calls QKVParallelLinear and
MergedColumnParallelLinear, so tensor parallelism would be a row/column sharding of them.

Inputs are one flattened batch: ``input_ids`` and ``positions`` are int64 [T] covering
every scheduled token of every request; attention reads the paged KV cache through the
backend.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.backend import AttentionBackend
from pagedllm.models.arch_config import ModelArchConfig
from pagedllm.kernels.cpu import trace
from pagedllm.models.linear import linear, onednn_packing_available, pack_weight
from pagedllm.models.rotary import RotaryEmbedding, apply_rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019): x / sqrt(mean(x^2) + eps) * weight, in float32
    (torch's fused ``F.rms_norm`` for float32 inputs; half inputs are upcast as HF does)."""
    dtype = x.dtype
    if dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf.to(dtype) * weight) if dtype != torch.float32 else xf * weight


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        h, nh, nkv, hd, inter = (cfg.hidden_size, cfg.num_attention_heads,
                                 cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size)
        kw = dict(dtype=dtype, device=device)
        self.nh, self.nkv, self.hd, self.eps = nh, nkv, hd, cfg.rms_norm_eps
        self.q_size, self.kv_size = nh * hd, nkv * hd
        self.scale = hd ** -0.5
        self.input_layernorm = nn.Parameter(torch.ones(h, **kw), requires_grad=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(h, **kw), requires_grad=False)
        self.qkv_proj = nn.Parameter(torch.empty((nh + 2 * nkv) * hd, h, **kw), requires_grad=False)
        self.qkv_bias = (nn.Parameter(torch.zeros((nh + 2 * nkv) * hd, **kw), requires_grad=False)
                         if cfg.attention_bias else None)
        self.q_norm = nn.Parameter(torch.ones(hd, **kw), requires_grad=False) if cfg.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(hd, **kw), requires_grad=False) if cfg.qk_norm else None
        self.o_proj = nn.Parameter(torch.empty(h, nh * hd, **kw), requires_grad=False)
        self.gate_up_proj = nn.Parameter(torch.empty(2 * inter, h, **kw), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(h, inter, **kw), requires_grad=False)
        self.inter = inter
        # oneDNN-packed copies of the four projections (CPU float32), made by pack_weights()
        self.packed: dict[str, torch.Tensor] = {}

    def pack_weights(self) -> None:
        """Pack the projections for oneDNN and release the dense copies (CPU float32)."""
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            p = getattr(self, name)
            self.packed[name] = pack_weight(p.data)
            p.data = p.data.new_empty(0)

    def _add_norm(self, x, residual, weight, ops):
        """residual + x, then RMSNorm of it: returns (normed, new residual), [T, hidden]
        each. With the C++ ``ops`` both happen in place (``x`` becomes the normed rows)."""
        if ops is not None:
            with trace("pagedllm::fused_add_rms_norm"):
                ops.fused_add_rms_norm(x, residual, weight, self.eps)
            return x, residual
        residual = residual + x
        return rms_norm(residual, weight, self.eps), residual

    def forward(self, x, residual, cos, sin, attn: AttentionBackend, layer_cache, attn_md, ops=None):
        # x: [T, hidden]; residual: [T, hidden] or None for the first layer. ``ops``: the
        # C++ CPU kernels (float32 on CPU) or None for the torch ops; same maths.
        if residual is None:
            residual = x
            h = rms_norm(residual, self.input_layernorm, self.eps)
        else:
            h, residual = self._add_norm(x, residual, self.input_layernorm, ops)
        pk = self.packed
        qkv = linear(h, self.qkv_proj, pk.get("qkv_proj"), self.qkv_bias)
        T = qkv.shape[0]
        v = qkv[:, self.q_size + self.kv_size:].view(T, self.nkv, self.hd)
        if self.q_norm is not None:
            q = rms_norm(qkv[:, : self.q_size].view(T, self.nh, self.hd), self.q_norm, self.eps)
            k = rms_norm(qkv[:, self.q_size: self.q_size + self.kv_size].view(T, self.nkv, self.hd),
                         self.k_norm, self.eps)
            q = apply_rotary(q, cos, sin)
            k = apply_rotary(k, cos, sin)
        elif ops is not None:
            qk = qkv[:, : self.q_size + self.kv_size].view(T, self.nh + self.nkv, self.hd)
            with trace("pagedllm::rotary_embedding"):
                ops.rotary_embedding(qk, cos.view(T, -1), sin.view(T, -1))  # in place
            q, k = qk[:, : self.nh], qk[:, self.nh:]
        else:
            # q and k rotated together: one set of elementwise ops instead of two
            qk = apply_rotary(qkv[:, : self.q_size + self.kv_size].view(T, self.nh + self.nkv, self.hd),
                              cos, sin)
            q, k = qk[:, : self.nh], qk[:, self.nh:]
        o = attn.forward(q, k, v if ops is not None else v.contiguous(), layer_cache, attn_md, self.scale)
        x = linear(o, self.o_proj, pk.get("o_proj"))
        h, residual = self._add_norm(x, residual, self.post_attention_layernorm, ops)
        gu = linear(h, self.gate_up_proj, pk.get("gate_up_proj"))
        if ops is not None:
            act = gu.new_empty(T, self.inter)
            with trace("pagedllm::silu_and_mul"):
                ops.silu_and_mul(act, gu)
        else:
            act = F.silu(gu[:, : self.inter]) * gu[:, self.inter:]
        return linear(act, self.down_proj, pk.get("down_proj")), residual


class LlamaForCausalLM(nn.Module):
    """Decoder-only causal LM over a paged KV cache.

    Args:
        cfg: architecture hyper-parameters.
        dtype: compute and weight dtype (float32, bfloat16 or float16).
        device: where weights live.
        max_positions: size of the RoPE tables (the engine's max_model_len), in tokens.
    """

    def __init__(self, cfg: ModelArchConfig, dtype: torch.dtype, device: torch.device,
                 max_positions: int):
        super().__init__()
        self.cfg = cfg
        kw = dict(dtype=dtype, device=device)
        self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, **kw),
                                         requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device) for _ in range(cfg.num_hidden_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size, **kw), requires_grad=False)
        self.lm_head = (None if cfg.tie_word_embeddings else
                        nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, **kw), requires_grad=False))
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, device)
        self.packed_lm_head: torch.Tensor | None = None
        # C++ elementwise kernels for the float32 CPU path (None: torch ops)
        self.ops = None
        if torch.device(device).type == "cpu" and dtype == torch.float32:
            from pagedllm.kernels.cpu import load_cpu_kernels

            self.ops = load_cpu_kernels()

    def pack_weights(self) -> None:
        """After loading: on CPU float32 with oneDNN, reorder every projection and the LM
        head into oneDNN's layout (see ``models/linear.py``); a no-op elsewhere. The
        embedding table stays dense (it is also the lookup table when tied)."""
        if not onednn_packing_available(self.embed_tokens.device, self.embed_tokens.dtype):
            return
        for layer in self.layers:
            layer.pack_weights()
        if self.lm_head is None:
            self.packed_lm_head = pack_weight(self.embed_tokens.data)
        else:
            self.packed_lm_head = pack_weight(self.lm_head.data)
            self.lm_head.data = self.lm_head.data.new_empty(0)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                attn: AttentionBackend, attn_md) -> torch.Tensor:
        """Run all layers over the flattened batch.

        Args:
            input_ids, positions: int64 [T].
            kv_cache: the backend's whole cache tensor (all layers).
            attn: the attention backend; attn_md: its metadata for this step.

        Returns:
            hidden states before the final norm, [T, hidden] in the model dtype.
        """
        x = F.embedding(input_ids, self.embed_tokens)
        cos, sin = self.rotary.tables(positions, x.dtype)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, cos, sin, attn, attn.layer_cache(kv_cache, i), attn_md,
                                self.ops)
        return residual + x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head on the selected rows: [N, hidden] → float32 [N, vocab]."""
        h = rms_norm(hidden, self.norm, self.cfg.rms_norm_eps)
        if self.packed_lm_head is not None:
            return linear(h, None, self.packed_lm_head).float()
        w = self.embed_tokens if self.lm_head is None else self.lm_head
        if h.device.type == "cpu" and h.shape[0] > 1:
            # [vocab, hidden] @ [hidden, N]: with a huge vocab and few rows, MKL runs this
            # orientation ~1.5-2x faster than F.linear's (measured: 64 rows x 49152 vocab,
            # 35 ms vs 64 ms on 2 cores). Batch invariance of greedy outputs is tested.
            return torch.mm(w, h.t().contiguous()).t().float().contiguous()
        return F.linear(h, w).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the fused parameters.

        Raises:
            ValueError: a required parameter is missing from ``weights`` or has the wrong shape.
        """
        cfg = self.cfg
        q_size, kv_size = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        loaded: set[str] = set()

        def put(dst: torch.Tensor, src: torch.Tensor, name: str, rows: slice | None = None):
            target = dst if rows is None else dst[rows]
            if tuple(target.shape) != tuple(src.shape):
                raise ValueError(f"weight {name}: shape {tuple(src.shape)} != expected {tuple(target.shape)}")
            target.copy_(src.to(dst.dtype))
            loaded.add(name)

        for name, t in weights:
            if name == "model.embed_tokens.weight":
                put(self.embed_tokens, t, name)
            elif name == "model.norm.weight":
                put(self.norm, t, name)
            elif name == "lm_head.weight":
                if self.lm_head is not None:
                    put(self.lm_head, t, name)
            elif name.startswith("model.layers."):
                parts = name.split(".")
                i, sub = int(parts[2]), ".".join(parts[3:])
                L = self.layers[i]
                table = {
                    "input_layernorm.weight": (L.input_layernorm, None),
                    "post_attention_layernorm.weight": (L.post_attention_layernorm, None),
                    "self_attn.q_proj.weight": (L.qkv_proj, slice(0, q_size)),
                    "self_attn.k_proj.weight": (L.qkv_proj, slice(q_size, q_size + kv_size)),
                    "self_attn.v_proj.weight": (L.qkv_proj, slice(q_size + kv_size, None)),
                    "self_attn.o_proj.weight": (L.o_proj, None),
                    "mlp.gate_proj.weight": (L.gate_up_proj, slice(0, cfg.intermediate_size)),
                    "mlp.up_proj.weight": (L.gate_up_proj, slice(cfg.intermediate_size, None)),
                    "mlp.down_proj.weight": (L.down_proj, None),
                }
                if L.qkv_bias is not None:
                    table.update({
                        "self_attn.q_proj.bias": (L.qkv_bias, slice(0, q_size)),
                        "self_attn.k_proj.bias": (L.qkv_bias, slice(q_size, q_size + kv_size)),
                        "self_attn.v_proj.bias": (L.qkv_bias, slice(q_size + kv_size, None)),
                    })
                if L.q_norm is not None:
                    table.update({"self_attn.q_norm.weight": (L.q_norm, None),
                                  "self_attn.k_norm.weight": (L.k_norm, None)})
                if sub in table:
                    dst, rows = table[sub]
                    put(dst, t, name, rows)
        required = {"model.embed_tokens.weight", "model.norm.weight"}
        if self.lm_head is not None:
            required.add("lm_head.weight")
        per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight",
                     "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                     "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                     "mlp.down_proj.weight"]
        if cfg.attention_bias:
            per_layer += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
        if cfg.qk_norm:
            per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
        for i in range(cfg.num_hidden_layers):
            required.update(f"model.layers.{i}.{p}" for p in per_layer)
        missing = sorted(required - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")
