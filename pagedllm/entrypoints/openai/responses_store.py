"""The in-process store of the Responses API (``store: true``): finished responses by id,
at most ``max_entries`` of them (least recently used first out) and none older than
``max_age_s``. Each entry keeps its own turn's input and output items and a reference to
the entry it continued, so a conversation of n turns costs n turns of memory, and a
continuation still renders the whole conversation after an earlier turn was evicted."""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

# Defaults of ``ResponseStore`` (docs/api.md, "Responses API").
STORE_MAX_ENTRIES = 1000
STORE_MAX_AGE_S = 3600.0


@dataclass(frozen=True)
class StoredResponse:
    """One stored response.

    Attributes:
        response: the response object as it was answered.
        items: this turn's input items (without ``instructions``) then its output items.
        previous: the entry this turn continued (``previous_response_id``), or None.
        stored_at: ``time.monotonic()`` when stored.
    """

    response: dict
    items: list[dict]
    previous: StoredResponse | None
    stored_at: float

    def conversation(self) -> list[dict]:
        """Every item from the first turn to this one, in order."""
        chain, entry = [], self
        while entry is not None:
            chain.append(entry.items)
            entry = entry.previous
        return [item for items in reversed(chain) for item in items]


class ResponseStore:
    """Args:
        max_entries: at most this many responses (>= 1).
        max_age_s: a response older than this (seconds) is gone.
        clock: the monotonic clock (seconds), replaceable in tests.
    Not thread-safe: used from the event loop only.
    """

    def __init__(self, max_entries: int = STORE_MAX_ENTRIES, max_age_s: float = STORE_MAX_AGE_S,
                 clock=time.monotonic):
        if max_entries < 1 or max_age_s <= 0:
            raise ValueError("ResponseStore needs max_entries >= 1 and max_age_s > 0")
        self.max_entries = max_entries
        self.max_age_s = max_age_s
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, response: dict, items: list[dict], previous: StoredResponse | None) -> StoredResponse:
        """Store ``response`` under its ``id`` (the most recently used), evicting the least
        recently used beyond ``max_entries``."""
        entry = StoredResponse(response, items, previous, self._clock())
        self._entries[response["id"]] = entry
        self._entries.move_to_end(response["id"])
        self._expire()
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return entry

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry of ``response_id`` (now the most recently used), or None: never stored,
        deleted, evicted or expired."""
        self._expire()
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        """Remove ``response_id``; False when it was not there."""
        self._expire()
        return self._entries.pop(response_id, None) is not None

    def _expire(self) -> None:
        oldest = self._clock() - self.max_age_s
        for rid in [rid for rid, e in self._entries.items() if e.stored_at < oldest]:
            del self._entries[rid]
