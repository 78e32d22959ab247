"""Mixture-of-experts feed-forward layer (``FusedMoE``, vLLM's name): a router picks k of
E SwiGLU experts for every token, and the token's output is the weighted sum of theirs.

Routing (``select_experts``), from the router's logits [T, E]: softmax over all E experts
in float32, the top k, and, where the model says so, the k weights renormalised to sum to
one. Mixtral (Jiang et al. 2024, "Mixtral of Experts", arXiv:2401.04088, eq. 2:
``G(x) = Softmax(TopK(x W_g))``) always renormalises, which is the same distribution;
Qwen3-MoE (Qwen Team 2025, "Qwen3 Technical Report", arXiv:2505.09388; transformers'
``Qwen3MoeTopKRouter``) renormalises when its config's ``norm_topk_prob`` is true.

Compute (``FusedMoE.forward``): the T * k (token, expert) pairs are sorted by expert
(stable), the tokens' rows gathered in that order, and each expert that received rows
runs its gate|up matmul, SiLU-and-mul and down matmul once on its contiguous slice: a
loop over the experts that have tokens, never over tokens. Each result row is scaled by
its routing weight (float32), put back in (token, slot) order, and the k slots of a token
are summed in slot order (then cast to the activations' dtype). Summing by slot rather
than with ``index_add_`` keeps the order of the additions fixed on every device
(``index_add_`` accumulates with atomics on CUDA, whose order varies between runs once
k > 2), so a token's output is the same bits whatever else is in the batch.

Each expert's two projections are ordinary fused linear layers
(``MergedColumnParallelLinear`` gate|up, ``RowParallelLinear`` down), registered as
children ``{e}.gate_up_proj`` and ``{e}.down_proj``: expert e's weights are the slices
``w13[e]`` [2I, H] and ``w2[e]`` [H, I] of vLLM's stacked layout, held one expert per
layer so that every linear mechanism applies to them unchanged: the oneDNN-packed weights
on the CPU (whose rows do not depend on the row count), the batch-invariance probe
(``layers/batch_invariance.py``: a shape whose rows depend on the row count computes in
fixed row chunks, so an expert's rows do not depend on how many tokens it got), and the
``--quantization`` methods that quantize float weights at load (int8, q8_0, q4_0, q4_1).
A method that would keep a GGUF file's packed blocks (``gguf``) cannot take the stacked
3-D expert tensors, and is refused for the experts (``InvalidParameterError``
("quantization"), naming the layer).
"""
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
    """The router's choice for every token (module docstring: softmax, top-k, optional
    renormalisation).

    Args:
        router_logits: [T, E], any float dtype.
        top_k: experts per token, 1 <= top_k <= E.
        renormalize: divide the k weights by their sum (Mixtral; Qwen3-MoE with
            ``norm_topk_prob``), else keep the softmax probabilities.

    Returns:
        (weights float32 [T, top_k], expert ids int64 [T, top_k]), in descending weight
        order for each token (``torch.topk``'s).
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def split_stacked(shard_id: str, loaded_weight: torch.Tensor, intermediate_size: int
                  ) -> Iterator[tuple[int, str, torch.Tensor]]:
    """The per-expert tensors of a stacked checkpoint tensor, as views (no copy).

    Args:
        shard_id: one of ``SHARDS``: "gate"/"up" [E, I, H], "down" [E, H, I], or
            "gate_up" [E, 2I, H] (gate rows first, as transformers 5's
            ``experts.gate_up_proj``).
        loaded_weight: the 3-D tensor, experts first.
        intermediate_size: I, to split "gate_up".

    Yields:
        (expert id, "gate" | "up" | "down", 2-D tensor) for every expert in order.

    Raises:
        ValueError: an unknown shard id, a tensor that is not 3-D, or a "gate_up" whose
            rows are not 2 * I.
    """
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
    """One expert: down(SiLU(gate(x)) * up(x)), x [n, H] → [n, H] in x's dtype; gate and
    up fused as ``gate_up_proj`` (shard 0 and 1)."""

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
    """The experts of one MoE layer and their top-k routing (module docstring).

    Parameters (per expert e, HF-style names under ``prefix``): ``{e}.gate_up_proj.weight``
    [2I, H] (gate rows, then up) and ``{e}.down_proj.weight`` [H, I], in ``dtype`` (or as
    the quantization method stores them).

    Args:
        num_experts: E; top_k: experts per token (1 <= top_k <= E).
        hidden_size: H; intermediate_size: I, each expert's hidden width.
        renormalize: renormalise the top-k weights (``select_experts``).
        dtype, device: of the weights and activations.
        prefix: the layer's name, e.g. ``model.layers.0.mlp.experts`` (for quantization
            configs and error messages).
        quant_config: the model's ``QuantizationConfig``, or None (dense weights).

    Raises:
        ValueError: top_k outside 1..E.
        InvalidParameterError("quantization"): ``quant_config`` keeps a GGUF file's
            packed blocks and the file's stacked expert tensors are of such a type.
    """

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
        """Raise if ``quant_config`` would hand over a stacked expert tensor (the GGUF
        loader's ``{prefix}.gate_proj.weight`` etc.) as raw blocks: asks it for the method
        of each as if it were a layer, which it answers for the types it keeps packed."""
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
        """Load a checkpoint tensor into the experts.

        Args:
            loaded_weight: one expert's projection (2-D: "gate"/"up" [I, H], "down"
                [H, I], "gate_up" [2I, H]) when ``expert_id`` is given; else every
                expert's, stacked along a first dimension of E (``split_stacked``).
            shard_id: one of ``SHARDS``.
            expert_id: the expert, or None for a stacked tensor.

        Raises:
            ValueError: an unknown shard or expert, or a shape that does not fit
                (the weight named).
        """
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
        """Route and run the experts.

        Args:
            hidden_states: [T, H] in the layer's dtype.
            router_logits: [T, E] (the router linear's output).

        Returns:
            [T, H] in ``hidden_states``' dtype: sum over the token's k experts of
            weight * expert(x).
        """
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
