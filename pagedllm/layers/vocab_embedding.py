"""The token embedding and the LM head (vocab_size x hidden_size tables)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import (get_tp_rank, get_tp_size, tensor_model_parallel_all_gather,
                                  tensor_model_parallel_all_reduce, vocab_shard)
from pagedllm.layers.linear import LinearMethod, UnquantizedLinearMethod, get_linear_method


def _load_vocab_rows(layer: nn.Module, param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    """Copy this rank's rows of the checkpoint table ``loaded`` [vocab, ...] into ``param``;
    the last shard's padding rows are zero. Raises ValueError (``name``) on another shape."""
    want = (layer.org_vocab_size, *param.shape[1:])
    if tuple(loaded.shape) != want:
        raise ValueError(f"weight {name}: shape {tuple(loaded.shape)} != expected {want}")
    n = layer.num_real_rows
    param[:n].copy_(loaded.narrow(0, layer.vocab_start, n).to(param.dtype))
    param[n:].zero_()


class VocabParallelEmbedding(nn.Module):
    """Token embedding: int64 ids [T] → [T, embedding_dim] in ``dtype``. The table is
    ``weight`` [num_embeddings, embedding_dim] (this tensor-parallel rank's vocabulary
    shard, ``distributed.vocab_shard``; lookups summed over ranks), or stored as ``quant_config.get_embedding_method``
    says (``embedding_method``; e.g. packed Q8_0 rows, dequantized on lookup)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, device: torch.device,
                 quant_config=None, prefix: str = "model.embed_tokens"):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.org_vocab_size, self.prefix = num_embeddings, prefix
        self.vocab_start, rows, self.num_real_rows = vocab_shard(num_embeddings, self.tp_rank, self.tp_size)
        self.num_embeddings, self.embedding_dim, self.params_dtype = rows, embedding_dim, dtype
        self.embedding_method = (quant_config.get_embedding_method(prefix, rows, embedding_dim, dtype, device)
                                 if quant_config is not None else None)
        if self.embedding_method is not None:
            self.embedding_method.create_weights(self, rows, embedding_dim, dtype, device)
        else:
            self.weight = nn.Parameter(torch.empty(rows, embedding_dim, dtype=dtype, device=device),
                                       requires_grad=False)
        if self.tp_size > 1:
            self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        """This rank's rows of the checkpoint's whole table (tensor parallelism)."""
        _load_vocab_rows(self, param.data, loaded_weight, f"{self.prefix}.weight")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        # each rank looks up the ids in its shard, zeros for the rest; the sum has every row
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_real_rows)
        out = self._lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(1), 0)
        return tensor_model_parallel_all_reduce(out.contiguous())

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embedding_method is not None:
            return self.embedding_method.embedding(self, ids)
        return F.embedding(ids, self.weight)


class DenseLogitsMethod(UnquantizedLinearMethod):
    """The LM head's dense weight: CPU float32 with several rows computes ``W @ h.T`` (faster
    there with a huge vocabulary; figures: docs/notes/layers-vocab_embedding.md), else
    ``F.linear``. ``apply`` may return a transposed view."""

    name = "dense W@h.T"

    def apply(self, layer, x, bias=None):
        if x.device.type == "cpu" and x.dtype == torch.float32 and x.shape[0] > 1:
            out = torch.mm(layer.weight, x.t().contiguous()).t()
            return out if bias is None else out + bias
        return F.linear(x, layer.weight, bias)


class ParallelLMHead(nn.Module):
    """Projection to logits: hidden [N, embedding_dim] → float32 [N, num_embeddings], by
    ``apply_float32`` with every method. The weight is its own, or with ``tied_embedding`` the
    embedding's table (loaded once; ``lm_head.weight`` ignored; kept dense or in the table's
    block format). A plain ``UnquantizedLinearMethod`` becomes ``DenseLogitsMethod``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, device: torch.device,
                 tied_embedding: VocabParallelEmbedding | None = None,
                 linear_method: LinearMethod | None = None, quant_config=None, prefix: str = "lm_head"):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.org_vocab_size, self.prefix = num_embeddings, prefix
        self.vocab_start, rows, self.num_real_rows = vocab_shard(num_embeddings, self.tp_rank, self.tp_size)
        if linear_method is None and quant_config is not None:
            linear_method = quant_config.get_linear_method(prefix, embedding_dim, [rows], dtype, device)
        method = linear_method or get_linear_method(device, dtype)
        self.linear_method = DenseLogitsMethod() if type(method) is UnquantizedLinearMethod else method
        self.input_size, self.output_size, self.params_dtype = embedding_dim, rows, dtype
        self.float32_out = True         # methods keep what ``apply_float32`` needs
        if tied_embedding is None:
            self.linear_method.create_weights(self, embedding_dim, [rows], dtype, device)
            if self.tp_size > 1:
                self.weight.weight_loader = self.weight_loader
        else:
            self.weight = tied_embedding.weight.data
            self.keep_dense_weight = True

    @property
    def compute_path(self) -> tuple[str, str, str]:
        """("linear", the method's name for this layer, "lm_head")."""
        return ("linear", self.linear_method.layer_name(self), "lm_head")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, embedding_dim] → float32 logits [N, vocab] (gathered over the ranks),
        never rounded to 16 bits."""
        logits = self.linear_method.apply_float32(self, hidden).contiguous()
        if self.tp_size == 1:
            return logits
        logits = tensor_model_parallel_all_gather(logits, dim=-1)
        return logits if logits.shape[1] == self.org_vocab_size else logits[:, :self.org_vocab_size].contiguous()

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        """This rank's rows of the checkpoint's whole head (tensor parallelism)."""
        _load_vocab_rows(self, param.data, loaded_weight, f"{self.prefix}.weight")
