"""Batch-invariant linear layers: each output row must not depend on how many other rows
share the call (Thinking Machines, "Defeating Nondeterminism in LLM Inference", 2025).

Once per model load (``ensure_batch_invariant_linears``, unless
``PAGEDLLM_BATCH_INVARIANT_PROBE=0``) every distinct (method, dtype, in, out) shape is
probed with its real weights and with cancellation weights; shapes whose rows depend on M
get ``PaddedRowsLinearMethod`` or ``RowChunkedLinearMethod``. Why and what it costs:
docs/notes/layers-batch_invariance.md."""
from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from pagedllm.layers.linear import PaddedRowsLinearMethod, RowChunkedLinearMethod

logger = logging.getLogger("pagedllm")

# Row counts probed, most telling first: one row (decode), the 16- and 32-row blockings
# and their tails, then the rest of a spread up to 257. Big layers get a prefix of this
# list that fits ``PROBE_MAX_MACS``.
PROBE_ROWS = (1, 2, 16, 17, 3, 8, 32, 33, 5, 15, 31, 64, 65, 128, 257)
# A call costs about as much as this many more rows: each call streams the whole weight
# (figures: docs/notes/layers-batch_invariance.md).
PROBE_CALL_ROWS = 16
# Most multiply-adds (rows + PROBE_CALL_ROWS per call, x in x out) one shape's probe may cost.
PROBE_MAX_MACS = 3_000_000_000
# Chunk sizes tried, in order, for a shape whose rows depend on M (16: an AMX tile's rows).
CHUNK_ROWS = (16, 32)
# A shape whose rows depend on M only below this many rows is first tried with small calls
# padded (``PaddedRowsLinearMethod``), which leaves big calls whole.
PAD_ROWS_MAX = 16


def probe_rows(in_features: int, out_features: int, rows: Iterable[int] = PROBE_ROWS,
               max_macs: int = PROBE_MAX_MACS) -> list[int]:
    """The row counts of ``rows`` (in order) whose probe cost ((M + ``PROBE_CALL_ROWS``) x in x
    out each) fits ``max_macs`` in total, at least the first two; ascending."""
    rows = list(dict.fromkeys(rows))
    chosen, total = [], 0
    for m in rows:
        cost = (m + PROBE_CALL_ROWS) * in_features * out_features
        if total + cost <= max_macs:
            chosen.append(m)
            total += cost
    if len(chosen) < 2:
        chosen = rows[:2]
    return sorted(chosen)


def probe_row_invariance(fn: Callable[[torch.Tensor], torch.Tensor], in_features: int, dtype: torch.dtype,
                         device: torch.device | str, rows: list[int], seed: int = 0,
                         inputs: torch.Tensor | None = None) -> list[int]:
    """The row counts M (ascending) at which some output row of ``fn`` (x [M, in_features] →
    [M, out]) differed bitwise from the same row computed in the ``max(rows)``-row batch
    (seeded random, or ``inputs``); empty: invariant. Raises ValueError for fewer than two
    distinct row counts."""
    ms = sorted(set(rows))
    if len(ms) < 2:
        raise ValueError(f"probe_row_invariance needs two or more row counts, got {rows}")
    ref_m = ms[-1]
    if inputs is None:
        g = torch.Generator().manual_seed(seed)
        inputs = torch.randn(ref_m, in_features, generator=g).to(dtype=dtype, device=device)
    x = inputs
    bad = []
    with torch.inference_mode():
        ref = fn(x)
        for m in ms[:-1]:
            off = (7 * m) % (ref_m - m + 1)
            if not torch.equal(fn(x[off:off + m].clone()), ref[off:off + m]):
                bad.append(m)
    return bad


# Most weight elements a cancellation stand-in holds: larger layers (a big model's LM head)
# get a stand-in with fewer output rows (``cancellation_probe``).
STAND_IN_MAX_ELEMENTS = 1 << 27


def cancellation_inputs(out_features: int, in_features: int, rows: int, dtype: torch.dtype,
                        device: torch.device | str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [out, in] and inputs [rows, in] in ``dtype`` whose exact products sum to zero in
    every output, so a change of summation order shows even in a bf16 output."""
    g = torch.Generator().manual_seed(seed)
    half = in_features // 2

    def spread(n: int) -> torch.Tensor:
        return (torch.randn(n, half, generator=g) * torch.exp(2 * torch.randn(n, half, generator=g))).to(dtype)

    v, u = spread(min(out_features, 512)), spread(rows)
    v = v.repeat(-(-out_features // v.shape[0]), 1)[:out_features]
    perm = torch.randperm(half, generator=g)
    pad = [torch.zeros(out_features, in_features % 2, dtype=dtype)]
    w = torch.cat([v, -v[:, perm]] + pad, 1)
    x = torch.cat([u, u[:, perm]] + [torch.zeros(rows, in_features % 2, dtype=dtype)], 1)
    return w.to(device), x.to(device)


def _stand_in(layer: nn.Module, method, weight: torch.Tensor) -> nn.Module:
    """A shallow copy of ``layer`` computing with ``method`` and ``weight``; ``layer`` unchanged."""
    stand = copy.copy(layer)
    stand.__dict__ = dict(layer.__dict__)
    for name, value in layer.__dict__.items():    # own hook and submodule tables, not the layer's
        if name.endswith(("_hooks", "_hooks_with_kwargs", "_hooks_always_called")) or name == "_modules":
            stand.__dict__[name] = type(value)(value) if name == "_modules" else type(value)()
    stand._parameters = {k: v for k, v in layer._parameters.items() if k not in ("weight", "bias")}
    stand._buffers = dict(layer._buffers)
    stand.__dict__.pop("weight", None)          # a tied LM head's table is a plain attribute
    stand.weight = nn.Parameter(weight, requires_grad=False)
    if "bias" in layer._parameters:
        stand._parameters["bias"] = None
    stand.linear_method = method
    method.process_weights_after_loading(stand)
    return stand


def cancellation_probe(layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype,
                       device: torch.device | str, rows: list[int]) -> list[int] | None:
    """``probe_row_invariance`` of a stand-in layer with ``cancellation_inputs``; None when the
    method does not take a dense float weight."""
    method = layer.linear_method
    if not getattr(method, "float_weight", False):
        return None
    out = max(1, min(out_features, STAND_IN_MAX_ELEMENTS // in_features))
    w, x = cancellation_inputs(out, in_features, max(rows), dtype, device)
    stand = _stand_in(layer, method, w)
    return probe_row_invariance(stand, in_features, dtype, device, rows, inputs=x)


def _probe(layer: nn.Module, res: "ShapeProbe") -> list[int]:
    """Row counts at which ``layer``'s rows depended on M, by both probes."""
    bad = set(probe_row_invariance(layer, res.in_features, res.dtype, layer.weight.device, res.rows))
    bad |= set(cancellation_probe(layer, res.in_features, res.out_features, res.dtype, layer.weight.device,
                                  res.rows) or [])
    return sorted(bad)


@dataclass
class ShapeProbe:
    """What the probe found for one (method, dtype, in, out) shape: rows probed, ``failed_at``,
    the fix (``chunk_rows`` or ``min_rows``, else None) and ``still_failed_at`` if none worked."""

    method: str
    dtype: torch.dtype
    in_features: int
    out_features: int
    names: list[str] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    failed_at: list[int] = field(default_factory=list)
    chunk_rows: int | None = None
    min_rows: int | None = None
    still_failed_at: list[int] = field(default_factory=list)
    seconds: float = 0.0

    def label(self) -> str:
        return (f"{self.in_features}->{self.out_features} {self.method} ({' '.join(self.names)}; "
                f"rows differed at M={','.join(map(str, self.failed_at))})")


def _linear_layers(model: nn.Module) -> dict[tuple, list[nn.Module]]:
    """Layers with a ``linear_method`` grouped by (method name, compute dtype, in, out)."""
    groups: dict[tuple, list[nn.Module]] = {}
    for m in model.modules():
        method = getattr(m, "linear_method", None)
        if method is None:
            continue
        # the activations' dtype (a quantized method stores its weight in another)
        key = (method.layer_name(m), getattr(m, "params_dtype", m.weight.dtype), m.input_size, m.output_size)
        groups.setdefault(key, []).append(m)
    return groups


def ensure_batch_invariant_linears(model: nn.Module, chunk_rows: Iterable[int] = CHUNK_ROWS,
                                   max_macs: int = PROBE_MAX_MACS) -> list[ShapeProbe]:
    """Probe every linear shape of a loaded ``model`` and wrap the layers of shapes whose rows
    depend on M (padding first where they differ only below ``PAD_ROWS_MAX`` rows, else the
    first of ``chunk_rows`` that works); a shape nothing fixes keeps its method and is
    warned about. Returns one ``ShapeProbe`` per shape, in model order."""
    t_all = time.perf_counter()
    chunk_rows = list(chunk_rows)
    results = []
    for (name, dtype, fin, fout), layers in _linear_layers(model).items():
        t = time.perf_counter()
        first = layers[0]
        device = first.weight.device
        res = ShapeProbe(name, dtype, fin, fout, rows=probe_rows(fin, fout, max_macs=max_macs))
        for layer in layers:
            short = layer.compute_path[2] if len(getattr(layer, "compute_path", ())) > 2 else "linear"
            if short not in res.names:
                res.names.append(short)
        res.failed_at = _probe(first, res)
        if res.failed_at:
            originals = [layer.linear_method for layer in layers]
            pad = max(res.failed_at) + 1
            # the wrappings to try, in order: small calls padded, then fixed row chunks
            tries = ([("pad", pad)] if pad <= PAD_ROWS_MAX else []) + [("chunk", c) for c in chunk_rows]
            for kind, n in tries:
                wrap = PaddedRowsLinearMethod if kind == "pad" else RowChunkedLinearMethod
                for layer, method in zip(layers, originals):
                    layer.linear_method = wrap(method, n)
                res.still_failed_at = _probe(first, res)
                if not res.still_failed_at:
                    if kind == "pad":
                        res.min_rows = n
                    else:
                        res.chunk_rows = n
                    break
            else:
                for layer, method in zip(layers, originals):
                    layer.linear_method = method
        res.seconds = time.perf_counter() - t
        results.append(res)
    _log(results, time.perf_counter() - t_all, chunk_rows)
    return results


def _log(results: list[ShapeProbe], seconds: float, chunk_rows: list[int]) -> None:
    wrapped = [r for r in results if r.chunk_rows or r.min_rows]
    unfixed = [r for r in results if r.failed_at and not (r.chunk_rows or r.min_rows)]
    if not wrapped:
        what = "every row independent of the batch size" if not unfixed else "none wrapped"
    else:
        what = "wrapped: " + "; ".join(
            f"{r.label()} -> " + (f"{r.chunk_rows}-row chunks" if r.chunk_rows else
                                  f"calls under {r.min_rows} rows padded") for r in wrapped)
    logger.info("batch-invariance probe: %d linear shapes in %.2f s; %s", len(results), seconds, what)
    for r in unfixed:
        hint = " (--dtype float32 avoids it)" if r.dtype != torch.float32 else ""
        logger.warning("greedy outputs may depend on batching: linear %s in %s on this CPU gives rows "
                       "that depend on the batch size, even computed in %s-row chunks%s",
                       r.label(), str(r.dtype).replace("torch.", ""), "/".join(map(str, chunk_rows)), hint)
