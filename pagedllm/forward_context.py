"""The per-step forward context: what every layer of one model step shares (today the
attention metadata), set by the runner around the forward instead of being passed through
every layer's call (vLLM's ``vllm/forward_context.py``, nano-vllm's ``utils/context.py``)."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass
class ForwardContext:
    """``attn_metadata``: the backend's ``build_metadata`` result for this step."""

    attn_metadata: Any


_forward_context: ForwardContext | None = None


@contextlib.contextmanager
def set_forward_context(attn_metadata: Any) -> Iterator[ForwardContext]:
    """Make ``attn_metadata`` the current step's for the body of the ``with``; the previous
    context (None outside a step) comes back afterwards, also when the body raises."""
    global _forward_context
    prev, _forward_context = _forward_context, ForwardContext(attn_metadata)
    try:
        yield _forward_context
    finally:
        _forward_context = prev


def get_forward_context() -> ForwardContext:
    """The current step's context. Raises RuntimeError outside ``set_forward_context``."""
    if _forward_context is None:
        raise RuntimeError("no forward context: run the model inside set_forward_context(attn_metadata)")
    return _forward_context
