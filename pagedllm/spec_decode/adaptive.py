"""How many proposed drafts each request verifies next step: the step's draft count that
maximises expected tokens per second under a per-request acceptance rate and a measured
step cost (``StepCostModel``). Rationale: docs/notes/spec-decode.md."""
from __future__ import annotations

import math


class StepCostModel:
    """Forward seconds of a decode step by scored tokens T: a per-T moving average (``ema``)
    once T was seen ``min_count`` times, else a least-squares line ``a + b * T`` with
    forgetting (``decay``) after ``min_steps`` steps."""

    def __init__(self, decay: float = 0.97, ema: float = 0.8, min_steps: int = 16, min_count: int = 3):
        self.decay = decay
        self.ema = ema
        self.min_steps = min_steps
        self.min_count = min_count
        self.n = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self._table: dict[int, list[float]] = {}   # T -> [average seconds, count]

    def record(self, num_tokens: int, seconds: float) -> None:
        d = self.decay
        x, y = float(num_tokens), float(seconds)
        self._w = d * self._w + 1
        self._x = d * self._x + x
        self._y = d * self._y + y
        self._xx = d * self._xx + x * x
        self._xy = d * self._xy + x * y
        self.n += 1
        e = self._table.get(num_tokens)
        if e is None:
            self._table[num_tokens] = [y, 1]
        else:
            e[0] = self.ema * e[0] + (1 - self.ema) * y
            e[1] += 1

    def _line(self) -> tuple[float, float] | None:
        if self.n < self.min_steps:
            return None
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var < 0.25:        # T hardly varied: the slope is not identified
            return None
        b = max((self._xy / self._w - mx * my) / var, 0.0)
        return my - b * mx, b

    def per_token_seconds(self) -> float | None:
        """Seconds per extra scored token (the line's slope), or None without a fit."""
        line = self._line()
        return None if line is None else line[1]

    def cost(self, num_tokens: int) -> float | None:
        """Predicted forward seconds of a step scoring ``num_tokens`` tokens, or None if unknown."""
        e = self._table.get(num_tokens)
        if e is not None and e[1] >= self.min_count:
            return e[0]
        line = self._line()
        if line is None:
            return None
        return max(line[0] + line[1] * num_tokens, 1e-9)


class AdaptiveDraftLength:
    """Chooses draft counts. Args: ``k_max`` (``num_speculative_tokens``); ``min_gain``
    (fallback rule ``a**k >= min_gain``); ``probe_interval`` (steps between one-draft probes);
    ``decay`` (past weight per verified step); ``enabled`` (False: verify every draft)."""

    PRIOR_ACCEPTED = 1.5
    PRIOR_TRIED = 2.0     # prior a = 0.75 before any evidence

    def __init__(self, k_max: int, min_gain: float = 0.25, probe_interval: int = 16,
                 decay: float = 0.8, enabled: bool = True):
        self.k_max = k_max
        self.min_gain = min_gain
        self.probe_interval = probe_interval
        self.decay = decay
        self.enabled = enabled
        self.cost_model = StepCostModel()
        self._proposer_s: float | None = None   # a model proposer's seconds per unit of depth
        self._steps_since_probe = 0
        # req_id -> [accepted (decayed), tried (decayed), steps since it last verified a draft]
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

    def _rule(self, a: float, cap: int) -> int:
        if a >= 1.0:
            return cap
        if a < self.min_gain:
            return 0
        return min(cap, int(math.log(self.min_gain) / math.log(a)))

    def record_proposer(self, seconds: float, depth: int) -> None:
        """A model proposer spent ``seconds`` proposing ``depth`` tokens deep (moving average per depth)."""
        if depth > 0:
            per = seconds / depth
            self._proposer_s = per if self._proposer_s is None else 0.8 * self._proposer_s + 0.2 * per

    def choose(self, req_ids: list[str], num_proposed: list[int], num_decoding: int,
               independent: list[bool] | None = None) -> list[int]:
        """Drafts to verify per request next step (each <= its ``num_proposed``), for
        ``num_decoding`` (B) decoding requests; ``independent[i]`` True (seeded sampling) puts a
        request on the per-request rule."""
        if not self.enabled:
            return list(num_proposed)
        independent = independent or [False] * len(req_ids)
        alphas = [self.acceptance_rate(r) for r in req_ids]
        base = self.cost_model.cost(num_decoding)
        if base is None:
            ks = [self._rule(a, n) for a, n in zip(alphas, num_proposed)]
        else:
            ks = [self._rule(a, n) if ind else 0 for a, n, ind in zip(alphas, num_proposed, independent)]
            cands = sorted(((a ** j, i) for i, (a, n, ind) in enumerate(zip(alphas, num_proposed, independent))
                            if not ind for j in range(1, n + 1)), key=lambda t: -t[0])
            # a model proposer also pays its seconds per draft depth (the deepest count)
            per_depth = self._proposer_s or 0.0
            best_n, best_rate, gain = 0, num_decoding / base, 0.0
            depth, deepest = [0] * len(req_ids), max(ks, default=0)
            for n, (g, i) in enumerate(cands, 1):
                c = self.cost_model.cost(num_decoding + n)
                if c is None:
                    break
                gain += g
                depth[i] += 1
                deepest = max(deepest, depth[i])
                rate = (num_decoding + gain) / (c + per_depth * deepest)
                if rate > best_rate:
                    best_n, best_rate = n, rate
            for _, i in cands[:best_n]:
                ks[i] += 1
        self._steps_since_probe += 1
        waiting = []   # requests due a shared probe: (steps without drafts, index)
        for i, r in enumerate(req_ids):
            st = self._state[r]
            if ks[i] > 0:
                continue
            st[2] += 1
            if st[2] >= self.probe_interval and num_proposed[i] > 0:
                if independent[i]:
                    ks[i], st[2] = 1, 0
                else:
                    waiting.append((st[2], -i))
        if waiting and self._steps_since_probe >= self.probe_interval:
            i = -max(waiting)[1]          # the longest-waiting request (the first on ties)
            ks[i] = 1
            self._state[req_ids[i]][2] = 0
            self._steps_since_probe = 0
        return ks

    def record(self, req_id: str, num_draft: int, num_accepted: int) -> None:
        """A step verified ``num_draft`` drafts of the request and accepted the first ``num_accepted``."""
        if num_draft <= 0:
            return
        st = self._get(req_id)
        tried = num_accepted + (1 if num_accepted < num_draft else 0)
        st[0] = self.decay * st[0] + num_accepted
        st[1] = self.decay * st[1] + tried
        st[2] = 0

    def remove(self, req_id: str) -> None:
        self._state.pop(req_id, None)
