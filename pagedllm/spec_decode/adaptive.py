"""Per-request draft length from the acceptance each request has shown so far.

Draft token j of a step (1-based) is kept only if drafts 1..j-1 were, so with a per-token
acceptance rate ``a`` it adds ``a**j`` expected tokens to the step while costing one more
scored position in the target's forward. ``AdaptiveDraftLength`` proposes the largest
``k <= k_max`` with ``a**k >= min_gain``; below that (k = 0) the request decodes plainly
and, every ``probe_interval`` steps, tries one draft, so a request whose text turns
repetitive later picks speculation back up. ``a`` is estimated per request from the
drafts it verified (accepted / tried positions, geometric model: a step that accepted m of
k tried m + 1 positions unless all k were accepted), with exponential forgetting so that
it follows the text's current phase.
"""
from __future__ import annotations

import math


class AdaptiveDraftLength:
    """Args:
        k_max: ``num_speculative_tokens``.
        min_gain: expected accepted tokens the last draft position must add (0.25: a
            draft position costs a small share of a step at batch 1 and close to a token's
            full cost in a large batch; this keeps the loss on text that never repeats
            to the probes).
        probe_interval: steps between one-token probes when k is 0.
        decay: weight of the past per verified step (0.8: about the last 5 steps count).
        enabled: False: always ``k_max``.
    """

    PRIOR_ACCEPTED = 1.5
    PRIOR_TRIED = 2.0     # prior a = 0.75: k = 4 at the default min_gain before any evidence

    def __init__(self, k_max: int, min_gain: float = 0.25, probe_interval: int = 8,
                 decay: float = 0.8, enabled: bool = True):
        self.k_max = k_max
        self.min_gain = min_gain
        self.probe_interval = probe_interval
        self.decay = decay
        self.enabled = enabled
        # req_id -> [accepted (decayed), tried (decayed), steps since the last draft]
        self._state: dict[str, list[float]] = {}

    def _get(self, req_id: str) -> list[float]:
        st = self._state.get(req_id)
        if st is None:
            st = self._state[req_id] = [self.PRIOR_ACCEPTED, self.PRIOR_TRIED, 0.0]
        return st

    def acceptance_rate(self, req_id: str) -> float:
        """The request's estimated per-token acceptance rate, in (0, 1]."""
        acc, tried, _ = self._get(req_id)
        return acc / tried

    def num_tokens(self, req_id: str) -> int:
        """How many drafts to propose for the request's next step (0..k_max)."""
        if not self.enabled:
            return self.k_max
        a = self.acceptance_rate(req_id)
        st = self._state[req_id]
        if a >= 1.0:
            k = self.k_max
        elif a <= 0.0 or a < self.min_gain:
            k = 0
        else:
            k = min(self.k_max, int(math.log(self.min_gain) / math.log(a)))
        if k == 0:
            st[2] += 1
            if st[2] >= self.probe_interval:
                st[2] = 0
                return 1
        return k

    def record(self, req_id: str, num_draft: int, num_accepted: int) -> None:
        """A step verified ``num_draft`` drafts of the request and accepted the first
        ``num_accepted``."""
        if num_draft <= 0:
            return
        st = self._get(req_id)
        tried = num_accepted + (1 if num_accepted < num_draft else 0)
        st[0] = self.decay * st[0] + num_accepted
        st[1] = self.decay * st[1] + tried
        st[2] = 0

    def remove(self, req_id: str) -> None:
        self._state.pop(req_id, None)
