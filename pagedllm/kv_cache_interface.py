"""KV-cache groups: how a model's layers share the paged KV cache (after vLLM's
``kv_cache_interface`` and hybrid KV-cache manager).

A group is a set of layers sharing one block table per request; every group holds
``layers_per_block`` layers, so all groups draw same-sized blocks from one pool (the cache
is ``layers_per_block`` tensors; layer ``l`` uses tensor ``slot`` of ``layer_location(l)``).
Full-attention models have one group; sliding-window layers get their own groups, whose
out-of-window blocks are released. Worked example (Gemma 3): docs/notes/core.md.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """``layers``: ascending indices (maybe fewer than ``layers_per_block``);
    ``sliding_window``: tokens, or None (full attention, every block kept)."""

    layers: tuple[int, ...]
    sliding_window: int | None = None


@dataclass(frozen=True)
class KVCacheConfig:
    """The model's KV-cache groups (group 0 first, the order of a request's block tables);
    ``layer_windows``: per layer, its attention window (None = whole context)."""

    groups: tuple[KVCacheGroupSpec, ...]
    layers_per_block: int
    layer_windows: tuple[int | None, ...]

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def needs_null_block(self) -> bool:
        """Some group releases blocks (to the null block 0)."""
        return any(g.sliding_window is not None for g in self.groups)

    def blocks_per_request(self, num_tokens: int, block_size: int, max_step_tokens: int) -> int:
        """Most blocks one request of ``num_tokens`` holds at once, at up to
        ``max_step_tokens`` per step (a window group: window + step, +1 for alignment)."""
        full = -(-num_tokens // block_size)
        return sum(full if g.sliding_window is None else
                   min(full, -(-(g.sliding_window - 1 + max_step_tokens) // block_size) + 1)
                   for g in self.groups)

    def layer_location(self, layer: int) -> tuple[int, int]:
        """(group, tensor slot) of ``layer``.

        Raises:
            KeyError: no group holds ``layer``.
        """
        for gi, g in enumerate(self.groups):
            if layer in g.layers:
                return gi, g.layers.index(layer)
        raise KeyError(f"layer {layer} is in no KV-cache group")


def make_kv_cache_config(layer_windows: list[int | None], hybrid: bool = True) -> KVCacheConfig:
    """Group layers by ``layer_windows[l]`` (tokens, None = whole context). One group when
    no layer has a window or ``hybrid=False``; else full-attention layers first, each kind
    in groups of ``layers_per_block`` = the smallest kind's layer count (vLLM's rule).

    Raises:
        ValueError: no layers, or a window that is not a positive int.
    """
    if not layer_windows:
        raise ValueError("a model needs at least one layer")
    for w in layer_windows:
        if w is not None and (not isinstance(w, int) or w < 1):
            raise ValueError(f"sliding_window must be a positive int, got {w!r}")
    n = len(layer_windows)
    kinds: dict[int | None, list[int]] = {}
    for i, w in enumerate(layer_windows):
        kinds.setdefault(w, []).append(i)
    if not hybrid or len(kinds) == 1 and None in kinds:
        return KVCacheConfig((KVCacheGroupSpec(tuple(range(n)), None),), n, tuple(layer_windows))
    size = min(len(v) for v in kinds.values())
    order = ([None] if None in kinds else []) + sorted(w for w in kinds if w is not None)
    groups = []
    for w in order:
        layers = kinds[w]
        for i in range(0, len(layers), size):
            groups.append(KVCacheGroupSpec(tuple(layers[i: i + size]), w))
    return KVCacheConfig(tuple(groups), size, tuple(layer_windows))
