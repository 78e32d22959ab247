"""How a model's layers share the paged KV cache: KV-cache groups (after vLLM's
``kv_cache_interface`` and its hybrid KV-cache manager).

A *group* is a set of layers that share one block table per request. Every group holds
the same number of layers (``layers_per_block``), so one block, wherever it is used, is
``layers_per_block`` layers' worth of K/V for ``block_size`` tokens, and all groups draw
their blocks from one pool: the cache is ``layers_per_block`` tensors, and layer ``l``
reads and writes tensor ``slot`` of ``layer_location(l)`` at its group's block ids.

A model whose layers all see the whole context has one group of all its layers: one
block table per request, as before groups existed. A model with sliding-window (local)
layers, e.g. Gemma 3 (five local layers to one global), gets its global layers in
group 0 and its local layers in groups of the same size after it; a local group's blocks
that fall out of the window are released (the request's table keeps the null block in
their place), so a long request holds about ``sliding_window / block_size`` blocks per
local group instead of one per ``block_size`` tokens. With ``hybrid=False`` (vLLM's
``--disable-hybrid-kv-cache-manager``) every layer goes to one group again: the local
layers still attend over their window only, but keep every block.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Attributes:
        layers: the layer indices of the group, ascending (a group may hold fewer than
            ``layers_per_block`` layers: its unused tensor slots are then idle).
        sliding_window: the window every layer of the group attends over, in tokens
            (blocks out of it are released), or None (full attention: every block kept).
    """

    layers: tuple[int, ...]
    sliding_window: int | None = None


@dataclass(frozen=True)
class KVCacheConfig:
    """The model's KV-cache groups.

    Attributes:
        groups: group 0 first; the block tables of a request come in this order.
        layers_per_block: layers a block holds (the number of cache tensors).
        layer_windows: per layer, the window its attention uses (None = whole context),
            also when its group keeps every block (``hybrid=False``).
    """

    groups: tuple[KVCacheGroupSpec, ...]
    layers_per_block: int
    layer_windows: tuple[int | None, ...]

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def needs_null_block(self) -> bool:
        """Some group releases blocks (its tables then point released entries at block 0,
        which the pool keeps out of use)."""
        return any(g.sliding_window is not None for g in self.groups)

    def blocks_per_request(self, num_tokens: int, block_size: int, max_step_tokens: int) -> int:
        """Most blocks one request of ``num_tokens`` tokens holds at once, computing up
        to ``max_step_tokens`` per step: a full group's ``cdiv(num_tokens, block_size)``;
        a sliding-window group's window plus one step's tokens, in blocks (plus one for a
        window that does not start at a block boundary), if that is fewer."""
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
    """Group the layers of a model whose layer ``l`` attends over ``layer_windows[l]``
    tokens (None: the whole context).

    One group of every layer when no layer has a window, or with ``hybrid=False``.
    Otherwise the full-attention layers are group 0 (split into several groups if there
    are more of them than of any one window's layers) and each window's layers follow in
    groups of the same size, ``layers_per_block`` = the smallest layer count of a kind
    (vLLM's rule, which keeps every block the same size); the last group of a kind may
    hold fewer layers.

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
