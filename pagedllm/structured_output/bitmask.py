"""Allowed-token bitmasks across the scheduler → runner seam, and applying them to logits.
Layout (xgrammar's): int32 [rows, ceil(vocab / 32)], bit j of word i = token 32 i + j
allowed; sent as little-endian bytes (``GrammarBitmask``)."""
from __future__ import annotations

import logging

import numpy as np
import torch

from pagedllm.messages import GrammarBitmask

logger = logging.getLogger("pagedllm")
_xgr_failed = False


def pack_bitmask(bitmask: torch.Tensor, first_row: dict[str, int]) -> GrammarBitmask:
    """``bitmask``: int32 CPU [rows, words]; ``first_row``: req id → its first row."""
    rows, words = bitmask.shape
    data = bitmask.numpy().astype("<i4", copy=False).tobytes()
    return GrammarBitmask(first_row, rows, words, data)


def unpack_bitmask(gb: GrammarBitmask) -> torch.Tensor:
    """The int32 CPU tensor [gb.num_rows, gb.num_words] of a ``GrammarBitmask``."""
    arr = np.frombuffer(gb.data, dtype="<i4").reshape(gb.num_rows, gb.num_words)
    return torch.from_numpy(arr.astype(np.int32, copy=True))


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Unpack int32 [rows, words] into bool [rows, vocab_size] (True = allowed)."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
    """Set disallowed tokens of float ``logits`` [N, vocab] to -inf in place; ``bitmask`` int32
    [N, words] (CPU or ``logits.device``); ``rows``: rows to mask (None = all)."""
    global _xgr_failed
    if rows is not None and not rows:
        return
    bitmask = bitmask.to(logits.device, non_blocking=True)
    if not _xgr_failed:
        try:
            import xgrammar as xgr

            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)
            return
        except Exception as e:  # noqa: BLE001  (masking twice is harmless: same mask)
            _xgr_failed = True
            logger.warning("xgrammar cannot apply token bitmasks here (%s); using torch", e)
    sel = slice(None) if rows is None else torch.tensor(rows, device=logits.device)
    allowed = bitmask_to_bool(bitmask[sel], logits.shape[-1])
    logits[sel] = logits[sel].masked_fill(~allowed, float("-inf"))
