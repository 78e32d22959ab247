"""Backpressure (``--max-waiting-requests``): whether one more generation request may
join the engine's queue, decided on arrival. Sequences count as in flight from admission
(``n * p`` for ``n`` choices over ``p`` prompts); those waiting are estimated as::

    capacity = num_running if num_waiting > 0 else max_num_seqs     (latest stats)
    waiting  = min(in_flight, max(num_waiting, in_flight - capacity))

A request arriving when ``waiting >= max_waiting_requests`` gets 503 with ``Retry-After``
and is counted nowhere. Why this estimate: docs/notes/entrypoints.md.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass
class Admission:
    """One admitted request's share of ``in_flight``; ``release`` gives it back (idempotent)."""

    control: "AdmissionControl"
    num_seqs: int
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.control._in_flight -= self.num_seqs


class AdmissionControl:
    """Args:
        max_waiting_requests: refuse a request while this many sequences wait (>= 1).
        max_num_seqs: the scheduler's limit of running sequences.

    A stat logger too: attach it with ``AsyncLLM.add_stat_logger`` (``record`` runs on the
    engine's thread); ``try_admit`` and ``Admission.release`` run on the event loop only.

    Raises:
        ValueError: ``max_waiting_requests`` < 1.
    """

    def __init__(self, max_waiting_requests: int, max_num_seqs: int):
        if max_waiting_requests < 1:
            raise ValueError(f"--max-waiting-requests must be >= 1, got {max_waiting_requests}")
        self.max_waiting_requests = max_waiting_requests
        self.max_num_seqs = max_num_seqs
        self._in_flight = 0
        self._lock = threading.Lock()
        self._sched_running = 0
        self._sched_waiting = 0

    def record(self, scheduler_stats, iteration_stats) -> None:
        """Stat-logger hook (engine thread): keeps the scheduler's latest counts."""
        with self._lock:
            self._sched_running = scheduler_stats.num_running
            self._sched_waiting = scheduler_stats.num_waiting

    @property
    def in_flight(self) -> int:
        """Sequences admitted and not yet released."""
        return self._in_flight

    def num_waiting(self) -> int:
        """The estimate of waiting sequences of the module doc."""
        with self._lock:
            running, waiting = self._sched_running, self._sched_waiting
        capacity = running if waiting > 0 else self.max_num_seqs
        return min(self._in_flight, max(waiting, self._in_flight - capacity))

    def try_admit(self, num_seqs: int) -> Admission | None:
        """Count ``num_seqs`` more sequences in flight and return their ``Admission``, or None
        (nothing counted) when ``max_waiting_requests`` sequences wait already."""
        if self.num_waiting() >= self.max_waiting_requests:
            return None
        self._in_flight += num_seqs
        return Admission(self, num_seqs)
