"""One prefill pass of a built model over a throwaway paged KV cache, outside the engine:
per-position logits, and SmoothQuant's calibration pass."""
from __future__ import annotations

import numpy as np
import torch

from pagedllm.distributed import get_tp_size


def prefill_logits(model: torch.nn.Module, arch, ids: list[int], dtype: torch.dtype,
                   device: torch.device, attention_backend: str = "auto", block_size: int = 16,
                   kv_cache_dtype: str = "auto") -> torch.Tensor:
    """float32 [T, vocab] logits at every position of the T ``ids``, from one prefill of
    ``model`` over a KV cache bound only during the call.

    Raises:
        ValueError: ``ids`` is empty.
    """
    from pagedllm.attention.backend import CommonAttentionMetadata
    from pagedllm.attention.registry import get_attention_backend
    from pagedllm.forward_context import set_forward_context
    from pagedllm.layers import bind_kv_cache, unbind_kv_cache

    if not ids:
        raise ValueError("ids must not be empty")
    attn = get_attention_backend(attention_backend, device, dtype)
    T, bs = len(ids), block_size
    nb = -(-T // bs)
    nkv = arch.num_kv_heads_per_rank(get_tp_size())   # this tensor-parallel rank's
    kv = torch.zeros(attn.kv_cache_shape(arch.num_hidden_layers, nb + 1, bs, nkv,
                                         arch.head_dim), dtype=dtype, device=device)
    bt = np.arange(1, nb + 1, dtype=np.int32)[None]
    pos = np.arange(T)
    slots = bt[0, pos // bs].astype(np.int64) * bs + pos % bs
    meta = CommonAttentionMetadata(
        1, T, 0, torch.tensor([0, T], dtype=torch.int32, device=device),
        torch.tensor([T], dtype=torch.int32, device=device), torch.tensor([0], dtype=torch.int32, device=device),
        torch.from_numpy(bt).to(device), torch.from_numpy(slots).to(device), bs,
        np.array([0, T]), np.array([T]), np.array([0]), bt)
    # one block table for every layer; a sliding-window layer reads its own metadata
    windows = arch.layer_windows()
    kinds = sorted(set(windows), key=lambda w: -1 if w is None else w)
    bind_kv_cache(model, kv, attn, attn_group={i: kinds.index(w) for i, w in enumerate(windows)})
    md = [attn.build_metadata(meta, w) for w in kinds]
    try:
        with torch.inference_mode(), set_forward_context(md if len(md) > 1 else md[0]):
            hidden = model(torch.tensor(ids, device=device), torch.arange(T, device=device))
            return model.compute_logits(hidden).float()
    finally:
        unbind_kv_cache(model)


# Tokens per calibration prefill (the text is cut into sequences of this length; short, so
# that engines with any max_model_len >= 128 calibrate the same, and get the same weights).
CALIBRATION_SEQ_LEN = 128


def calibrate_smoothquant(model: torch.nn.Module, layers: list, path: str, cfg, dtype: torch.dtype,
                          device: torch.device, max_positions: int) -> None:
    """``build_model``'s SmoothQuant ``calibrate``: activation maxima for ``layers`` from
    prefills of the shipped text in ``CALIBRATION_SEQ_LEN``-token sequences (shorter below
    ``max_positions``), so int8 weights do not depend on ``max_model_len`` >= 128."""
    import logging
    import time

    from pagedllm.layers.linear import UnquantizedLinearMethod
    from pagedllm.layers.quantization.smoothquant import calibrate_input_amax, calibration_text
    from pagedllm.tokenizer import get_tokenizer

    t = time.perf_counter()
    # (ids past the model's vocabulary, from a test model's small one, are dropped)
    ids = [t for t in get_tokenizer(path).encode(calibration_text()) if t < cfg.vocab_size]
    seq = min(CALIBRATION_SEQ_LEN, max_positions)

    def run(ids):
        for i in range(0, len(ids), seq):       # with the logits: an int8 LM head is calibrated too
            prefill_logits(model, cfg, ids[i:i + seq], dtype, device)

    n = calibrate_input_amax(layers, run, ids, UnquantizedLinearMethod) if ids else 0
    log = logging.getLogger("pagedllm")
    log.info("calibrated %d of %d layers on %d tokens in %.2f s (SmoothQuant)",
             n, len(layers), len(ids), time.perf_counter() - t)
    if n < len(layers):
        log.warning("SmoothQuant: %d of %d int8 layers saw no calibration token and are not smoothed "
                    "(their method names say so)", len(layers) - n, len(layers))
