"""Parallel sampling: a request with ``n`` > 1 runs as n child requests ``"{i}_{id}"``.

Child i samples with the parent's seed + i (wrapped to int64), or unseeded. With prefix
caching on and no prompt logprobs asked, sequence 0 goes to the core first and the others
wait until its prompt is computed (its first token arrives, or it ends), so that they find
the prompt's full blocks in the prefix cache: the prompt is prefilled once. The caller
sees one request: each output carries one sequence's completion (its ``index`` says
which) until all n are finished; the finished output lists all n by index. A parent
fails whole: when a child fails, its alive siblings are aborted.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Container

import msgspec

from pagedllm.messages import EngineCoreRequest
from pagedllm.outputs import CompletionOutput

_INT64 = 2**63


def child_seed(seed: int | None, index: int) -> int | None:
    """The seed of sequence ``index``: ``seed + index`` wrapped into [-2**63, 2**63); None
    for an unseeded request."""
    return None if seed is None else (seed + index + _INT64) % (2 * _INT64) - _INT64


class ParentRequest:
    """A request with ``n`` > 1 as the front end follows it.

    Attributes:
        request_id: the caller's id; child_ids: the core's ids of its n sequences, by index;
        pending: child requests not yet sent to the core; finished: the completions of the
        finished sequences, by index.
    """

    __slots__ = ("request_id", "child_ids", "pending", "finished")

    def __init__(self, request_id: str, n: int):
        self.request_id = request_id
        self.child_ids = [f"{i}_{request_id}" for i in range(n)]
        self.pending: list[EngineCoreRequest] = []
        self.finished: dict[int, CompletionOutput] = {}

    @classmethod
    def fan_out(cls, req: EngineCoreRequest,
                wait_for_prefix: bool) -> tuple[ParentRequest, list[tuple[EngineCoreRequest, bool]]]:
        """Split ``req`` (``sampling_params.n`` > 1) into its n child requests, each with
        n = 1, no best_of and its ``child_seed``.

        Returns:
            The parent, and the children by index, each with whether it goes to the core
            now; with ``wait_for_prefix`` only sequence 0 does, the others are kept in
            ``pending`` (see ``take_pending``).
        """
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
        """The waiting children to send to the core now (sequence 0's prompt is computed,
        or it ended before that), leaving none pending; those whose ids are no longer in
        ``alive`` (aborted meanwhile) are dropped."""
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
        """News of sequence ``index`` (``finished``: it is done).

        Returns:
            The completions the caller's output carries, and whether the parent is
            finished: ``[completion]`` until all n sequences are finished, then all n by
            index.
        """
        if finished:
            self.finished[index] = completion
        if len(self.finished) < len(self.child_ids):
            return [completion], False
        return [self.finished[i] for i in range(len(self.child_ids))], True
