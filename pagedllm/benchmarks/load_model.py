"""Abandoned streams in ``pagedllm bench serve`` / ``sweep``: which requests the client
stops reading, and after how many streamed tokens it closes the connection.

``--abort-fraction F``: each request is abandoned with probability F. ``--abort-after
DIST``: where, in tokens (a token = one streamed text chunk): ``uniform:LO,HI`` a fraction
of the request's max tokens drawn uniformly in [LO, HI] (0 <= LO <= HI <= 1), rounded,
at least 1; ``tokens:N`` exactly N (N >= 1); ``exp:MEAN`` exponential with mean MEAN
tokens, rounded up. Default ``uniform:0,1``. Draws are seeded by ``--seed``, the session
id and the turn, so they do not depend on timing and both sides of ``--compare`` abandon
the same requests. A turn's own ``abort_after_tokens`` (a trace record's) overrides.
A cut-off at or past the request's max tokens, or a stream that ends first, is read to
its end (not abandoned).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np

__all__ = ["AbortAfter", "AbortPlan", "parse_abort_after", "add_load_model_arguments", "DEFAULT_ABORT_AFTER"]

DEFAULT_ABORT_AFTER = "uniform:0,1"


@dataclass(frozen=True)
class AbortAfter:
    """A parsed ``--abort-after``: ``kind`` "uniform" (``a``, ``b`` fractions of max
    tokens), "tokens" (``a`` tokens) or "exp" (``a`` mean tokens)."""

    kind: str
    a: float
    b: float = 0.0

    def draw(self, rng: np.random.Generator, max_tokens: int) -> int:
        """Tokens to read before closing (>= 1) for a request of ``max_tokens``."""
        if self.kind == "tokens":
            return int(self.a)
        if self.kind == "uniform":
            f = self.a if self.a == self.b else float(rng.uniform(self.a, self.b))
            return max(1, int(round(f * max_tokens)))
        return max(1, int(math.ceil(float(rng.exponential(self.a)))))


def parse_abort_after(spec: str, flag: str = "--abort-after") -> AbortAfter:
    """Parse ``uniform:LO,HI``, ``tokens:N`` or ``exp:MEAN`` (module doc). Raises
    ``ValueError`` naming ``flag`` with the accepted forms."""
    forms = "uniform:LO,HI (fractions of max tokens), tokens:N or exp:MEAN_TOKENS"
    kind, sep, rest = str(spec).strip().partition(":")
    kind = kind.strip().lower()
    if not sep or kind not in ("uniform", "tokens", "exp"):
        raise ValueError(f"{flag}: expected {forms}, got {spec!r}")
    parts = [p.strip() for p in rest.split(",")]
    try:
        vals = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"{flag}: {rest!r} is not a number (in {spec!r}; expected {forms})") from None
    if any(not math.isfinite(v) for v in vals):
        raise ValueError(f"{flag}: values must be finite, got {spec!r}")
    if kind == "uniform":
        if len(vals) != 2:
            raise ValueError(f"{flag}: uniform takes two fractions LO,HI, got {spec!r}")
        lo, hi = vals
        if not 0 <= lo <= hi <= 1:
            raise ValueError(f"{flag}: uniform needs 0 <= LO <= HI <= 1, got {spec!r}")
        return AbortAfter("uniform", lo, hi)
    if len(vals) != 1:
        raise ValueError(f"{flag}: {kind} takes one number, got {spec!r}")
    v = vals[0]
    if kind == "tokens":
        if v < 1 or v != int(v):
            raise ValueError(f"{flag}: tokens:N needs an integer N >= 1, got {spec!r}")
        return AbortAfter("tokens", int(v))
    if not v > 0:
        raise ValueError(f"{flag}: exp:MEAN needs a mean > 0 tokens, got {spec!r}")
    return AbortAfter("exp", v)


class AbortPlan:
    """Per-request abort decisions of one run: ``fraction`` in [0, 1], ``after`` the
    distribution (``None``: the default), ``seed`` the run's ``--seed``. Raises
    ``ValueError`` naming the flag for a fraction outside [0, 1] or a bad spec."""

    def __init__(self, fraction: float = 0.0, after: str | None = None, seed: int = 0):
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"--abort-fraction must be in [0, 1], got {fraction:g}")
        self.fraction = float(fraction)
        self.after = parse_abort_after(after or DEFAULT_ABORT_AFTER)
        self.seed = int(seed)

    def abort_after(self, session_id: str | None, turn: int, max_tokens: int,
                    override: int | None = None) -> int | None:
        """Tokens after which the client closes this request's stream, or None (read to
        the end). ``override`` (a turn's own ``abort_after_tokens``) wins when not None;
        results >= ``max_tokens`` become None."""
        if override is not None:
            k = int(override)
        else:
            if self.fraction <= 0.0:
                return None
            rng = np.random.default_rng([self.seed, 48, zlib.crc32(str(session_id).encode()), int(turn)])
            if rng.random() >= self.fraction:
                return None
            k = self.after.draw(rng, max_tokens)
        return k if 1 <= k < max_tokens else None


def add_load_model_arguments(g) -> None:
    """Register ``--abort-fraction`` and ``--abort-after`` on argparse group ``g``."""
    g.add_argument("--abort-fraction", type=float, default=0.0, metavar="F",
                   help="share of requests whose client stops reading the stream and closes the "
                        "connection (abandoned streams; default 0)")
    g.add_argument("--abort-after", default=None, metavar="DIST",
                   help=f"how far into the stream an abandoning client closes it: uniform:LO,HI (fractions "
                        f"of the request's max tokens), tokens:N or exp:MEAN_TOKENS (default {DEFAULT_ABORT_AFTER}; "
                        f"seeded by --seed)")
