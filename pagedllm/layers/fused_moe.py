"""Mixture-of-experts feed-forward layer (``FusedMoE``, vLLM's name): a router picks k of E
SwiGLU experts per token; the output is the weighted sum of theirs. Routing: softmax in
float32, top k, optionally renormalised (Mixtral, arXiv:2401.04088 eq. 2; Qwen3-MoE's
``norm_topk_prob``). Tokens are sorted by expert, each expert runs once on its slice, and a
token's k results are summed in slot order (fixed order: batch-invariant). Each expert is
a pair of ordinary linear layers, so every linear method applies; details:
docs/notes/layers-fused_moe.md."""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from pagedllm.distributed import tensor_model_parallel_all_reduce
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pagedllm.layers.quantization.base_config import unsupported

# Shard ids of ``FusedMoE.weight_loader``: the checkpoint projections of one expert
# (Mixtral's w1 / w3 / w2, Qwen3-MoE's gate_proj / up_proj / down_proj), or gate and up
# stacked along the output rows (transformers 5's fused ``gate_up_proj``, gate first).
SHARDS = ("gate", "up", "down", "gate_up")


def select_experts(router_logits: torch.Tensor, top_k: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of router_logits [T, E]: (weights float32 [T, top_k], expert ids int64
    [T, top_k]), descending per token; ``renormalize`` divides the weights by their sum."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def split_stacked(shard_id: str, loaded_weight: torch.Tensor, intermediate_size: int
                  ) -> Iterator[tuple[int, str, torch.Tensor]]:
    """Yield (expert id, "gate" | "up" | "down", 2-D view) for each expert of a stacked 3-D
    tensor ("gate"/"up" [E, I, H], "down" [E, H, I], "gate_up" [E, 2I, H], gate rows first).
    Raises ValueError for an unknown shard id, a tensor not 3-D, or gate_up rows != 2 * I."""
    if shard_id not in SHARDS:
        raise ValueError(f"unknown expert shard {shard_id!r}; expected one of {SHARDS}")
    if loaded_weight.dim() != 3:
        raise ValueError(f"stacked expert weight {shard_id!r} must be 3-D [experts, out, in], "
                         f"got shape {tuple(loaded_weight.shape)}")
    if shard_id == "gate_up" and loaded_weight.shape[1] != 2 * intermediate_size:
        raise ValueError(f"stacked gate_up weight has {loaded_weight.shape[1]} rows per expert, "
                         f"expected 2 * {intermediate_size}")
    for e in range(loaded_weight.shape[0]):
        w = loaded_weight[e]
        if shard_id == "gate_up":
            yield e, "gate", w[:intermediate_size]
            yield e, "up", w[intermediate_size:]
        else:
            yield e, shard_id, w


class ExpertMLP(nn.Module):
    """One expert: down(SiLU(gate(x)) * up(x)), x [n, H] → [n, H]; gate|up fused (shards 0, 1)."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, device: torch.device,
                 prefix: str, quant_config=None):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], False, dtype, device,
            prefix=f"{prefix}.gate_up_proj", quant_config=quant_config)
        # partial sums over this rank's intermediate features; FusedMoE reduces once
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, dtype, device,
                                           prefix=f"{prefix}.down_proj", quant_config=quant_config,
                                           reduce_results=False)

    def forward(self, x: torch.Tensor, act_fn: nn.Module) -> torch.Tensor:
        return self.down_proj(act_fn(self.gate_up_proj(x)))


class FusedMoE(nn.Module):
    """The experts of one MoE layer and their top-k routing. Per expert e under ``prefix``:
    ``{e}.gate_up_proj.weight`` [2I, H] (gate rows, then up), ``{e}.down_proj.weight`` [H, I].

    Raises:
        ValueError: top_k outside 1..E.
        InvalidParameterError("quantization"): ``quant_config`` would keep the file's stacked
            expert tensors as packed GGUF blocks."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, dtype: torch.dtype, device: torch.device, prefix: str = "experts",
                 quant_config=None):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"{prefix}: num_experts_per_tok must be in 1..{num_experts}, got {top_k}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size, self.prefix = hidden_size, intermediate_size, prefix
        if quant_config is not None and quant_config.packed_gguf_types():
            self._refuse_packed_experts(quant_config, dtype, device)
        for e in range(num_experts):
            self.add_module(str(e), ExpertMLP(hidden_size, intermediate_size, dtype, device, f"{prefix}.{e}",
                                              quant_config))
        self.act_fn = SiluAndMul(dtype, device)
        self.compute_path = ("moe", f"top-{top_k} of {num_experts} experts, sorted per-expert matmuls")

    def _refuse_packed_experts(self, quant_config, dtype: torch.dtype, device: torch.device) -> None:
        """Raise ``unsupported`` if ``quant_config`` keeps a stacked expert tensor packed."""
        h, i = self.hidden_size, self.intermediate_size
        for name, fin, fout in (("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h)):
            if quant_config.get_linear_method(f"{self.prefix}.{name}", fin, [fout], dtype, device) is not None:
                raise unsupported(
                    f"{quant_config.name} cannot keep the MoE experts of layer {self.prefix} packed (their "
                    f"stacked {name} tensor is quantized in the file); run without --quantization to "
                    "dequantize them at load, or quantize float weights at load with q8_0, q4_0, q4_1 or int8")

    def expert(self, e: int) -> ExpertMLP:
        return self._modules[str(e)]

    def weight_loader(self, loaded_weight: torch.Tensor, shard_id: str, expert_id: int | None = None) -> None:
        """Load one expert's projection (2-D, ``expert_id`` given) or every expert's stacked
        along a first dimension of E (``expert_id`` None); ``shard_id`` one of ``SHARDS``.
        Raises ValueError for an unknown shard or expert, or a shape that does not fit."""
        if expert_id is None:
            if loaded_weight.dim() != 3 or loaded_weight.shape[0] != self.num_experts:
                raise ValueError(f"{self.prefix}: stacked {shard_id} weight of shape {tuple(loaded_weight.shape)} "
                                 f"does not have {self.num_experts} experts first")
            for e, shard, w in split_stacked(shard_id, loaded_weight, self.intermediate_size):
                self.weight_loader(w, shard, e)
            return
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"{self.prefix}: expert {expert_id} out of range 0..{self.num_experts - 1}")
        ex = self.expert(expert_id)
        if shard_id == "gate_up":
            for part, shard in ((loaded_weight[: self.intermediate_size], "gate"),
                                (loaded_weight[self.intermediate_size:], "up")):
                self.weight_loader(part, shard, expert_id)
        elif shard_id in ("gate", "up"):
            ex.gate_up_proj.weight_loader(ex.gate_up_proj.weight, loaded_weight, 0 if shard_id == "gate" else 1)
        elif shard_id == "down":
            ex.down_proj.weight_loader(ex.down_proj.weight, loaded_weight)
        else:
            raise ValueError(f"unknown expert shard {shard_id!r}; expected one of {SHARDS}")

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """hidden_states [T, H], router_logits [T, E] → [T, H] in hidden_states' dtype."""
        T, k = hidden_states.shape[0], self.top_k
        weights, ids = select_experts(router_logits, k, self.renormalize)
        flat_ids = ids.reshape(-1)                                   # [T*k], slot j of token t at t*k + j
        order = torch.argsort(flat_ids, stable=True)                 # pairs grouped by expert
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        x = hidden_states.index_select(0, order // k)                # [T*k, H], expert-sorted
        y = torch.empty(T * k, self.hidden_size, dtype=torch.float32, device=hidden_states.device)
        start = 0
        for e, n in enumerate(counts):
            if n:
                y[start:start + n] = self.expert(e)(x[start:start + n], self.act_fn).float()
                start += n
        y *= weights.reshape(-1)[order].unsqueeze(1)
        slots = torch.empty_like(y)
        slots[order] = y                                             # back to (token, slot) order
        slots = slots.view(T, k, self.hidden_size)
        out = slots[:, 0].clone()
        for j in range(1, k):
            out += slots[:, j]
        # tensor parallelism: each rank summed its share of every expert's intermediate features
        return tensor_model_parallel_all_reduce(out).to(hidden_states.dtype)
