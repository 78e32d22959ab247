"""Parallel sampling: a request with ``n`` > 1 runs as n child requests ``"{i}_{id}"``
(seed + i). With prefix caching, children 1..n-1 wait until sequence 0's prompt is
computed, so the prompt is prefilled once. The caller sees one request (outputs carry one
sequence's completion by ``index``, then all n); a parent fails whole.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Container

import msgspec

from pagedllm.messages import EngineCoreRequest
from pagedllm.outputs import CompletionOutput

_INT64 = 2**63


def child_seed(seed: int | None, index: int) -> int | None:
    """``seed + index`` wrapped into [-2**63, 2**63); None if unseeded."""
    return None if seed is None else (seed + index + _INT64) % (2 * _INT64) - _INT64


class ParentRequest:
    """A request with ``n`` > 1: the caller's ``request_id``, ``child_ids`` by index,
    ``pending`` children not yet sent, ``finished`` completions by index, and
    ``num_cached_tokens``: sequence 0's, the request's (its prompt counts once, as in
    ``usage.prompt_tokens``; the others reuse what sequence 0 computed)."""

    __slots__ = ("request_id", "child_ids", "pending", "finished", "num_cached_tokens")

    def __init__(self, request_id: str, n: int):
        self.request_id = request_id
        self.child_ids = [f"{i}_{request_id}" for i in range(n)]
        self.pending: list[EngineCoreRequest] = []
        self.finished: dict[int, CompletionOutput] = {}
        self.num_cached_tokens = 0

    @classmethod
    def fan_out(cls, req: EngineCoreRequest,
                wait_for_prefix: bool) -> tuple[ParentRequest, list[tuple[EngineCoreRequest, bool]]]:
        """Split ``req`` into n children (n = 1, ``child_seed``). Returns the parent and
        (child, send now?) by index; with ``wait_for_prefix`` only child 0 goes now."""
        sp = req.sampling_params
        parent = cls(req.request_id, sp.n)
        children = []
        for i, cid in enumerate(parent.child_ids):
            params = dataclasses.replace(sp, n=1, best_of=None, seed=child_seed(sp.seed, i))
            child = msgspec.structs.replace(req, request_id=cid, sampling_params=params)
            send = i == 0 or not wait_for_prefix
            if not send:
                parent.pending.append(child)
            children.append((child, send))
        return parent, children

    def take_pending(self, alive: Container[str]) -> list[EngineCoreRequest]:
        """Take the pending children still in ``alive``, to send now."""
        out = [c for c in self.pending if c.request_id in alive]
        self.pending = []
        return out

    def abort(self) -> None:
        """Drop the waiting children: an aborted parent sends nothing more to the core."""
        self.pending = []

    def alive_children(self, alive: Container[str]) -> list[str]:
        """The ids of the children still in ``alive`` (to abort when a sibling failed)."""
        return [c for c in self.child_ids if c in alive]

    def add_completion(self, index: int, completion: CompletionOutput,
                       finished: bool) -> tuple[list[CompletionOutput], bool]:
        """News of sequence ``index``; returns (completions to report, parent finished):
        ``[completion]`` until all n finish, then all n by index."""
        if finished:
            self.finished[index] = completion
        if len(self.finished) < len(self.child_ids):
            return [completion], False
        return [self.finished[i] for i in range(len(self.child_ids))], True
