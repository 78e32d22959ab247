"""Live progress of a ``bench serve`` run or a ``bench sweep`` point, on stderr: requests
done / total, current output tokens/s (streamed tokens of requests that ended in the last
``window_s`` seconds, abandoned streams included) and an ETA.

On a TTY a tqdm bar (removed when the run ends); otherwise plain lines, so that logs show
progress: one at each further ~10 % of the total (of ``duration_s`` when the total is
unknown; every 30 s when both are), and one at the end. Off with ``--no-progress`` or
``--quiet``.
"""

from __future__ import annotations

import collections
import sys
import time
from typing import IO, Any, Callable

from .metrics import RequestResult

__all__ = ["RunProgress", "make_progress"]

_PLAIN_EVERY_S = 30.0


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class RunProgress:
    """Counts finished requests of one run (``update`` per request, ``close`` at the end).
    ``total`` requests or None; ``duration_s`` the run's time limit or None; ``tty``: None
    asks ``stream.isatty()``."""

    def __init__(self, desc: str, total: int | None, duration_s: float | None = None,
                 stream: IO[str] | None = None, tty: bool | None = None, window_s: float = 10.0,
                 clock: Callable[[], float] = time.perf_counter):
        self.desc, self.total, self.duration_s = desc, total, duration_s
        self.stream = stream if stream is not None else sys.stderr
        self.window_s, self.clock = window_s, clock
        self.t0 = clock()
        self.done = 0
        self._recent: collections.deque = collections.deque()  # (time, output tokens)
        self._last_step = 0  # plain mode: the last tenth (or 30 s tick) printed
        self.bar: Any = None
        if tty is None:
            tty = bool(getattr(self.stream, "isatty", lambda: False)())
        if tty:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total, unit="req", desc=desc, file=self.stream, leave=False,
                                dynamic_ncols=True)

    def tokens_per_s(self, now: float | None = None) -> float:
        """Output tokens/s over the last ``window_s`` seconds (or since the start)."""
        now = self.clock() if now is None else now
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent.popleft()
        span = min(self.window_s, now - self.t0)
        return sum(n for _, n in self._recent) / span if span > 0 else 0.0

    def eta_s(self, now: float | None = None) -> float | None:
        """Seconds left: from the mean pace so far over ``total``, else to ``duration_s``."""
        now = self.clock() if now is None else now
        elapsed = now - self.t0
        if self.total and self.done:
            return max(0.0, elapsed * (self.total - self.done) / self.done)
        if self.duration_s:
            return max(0.0, self.duration_s - elapsed)
        return None

    def line(self, now: float | None = None) -> str:
        """The plain progress line: ``desc: done/total requests (pct), tok/s, ETA``."""
        now = self.clock() if now is None else now
        if self.total:
            count = f"{self.done}/{self.total} requests ({self.done / self.total:.0%})"
        else:
            count = f"{self.done} requests"
        return (f"{self.desc}: {count}, {self.tokens_per_s(now):.1f} output tok/s, "
                f"{now - self.t0:.0f}s elapsed, ETA {_eta(self.eta_s(now))}")

    def _step(self, now: float) -> int:
        if self.total:
            return min(10, self.done * 10 // self.total)
        if self.duration_s:
            return min(10, int((now - self.t0) * 10 // self.duration_s))
        return int((now - self.t0) // _PLAIN_EVERY_S)

    def update(self, r: RequestResult) -> None:
        """Count one finished request (its output tokens when completed or abandoned)."""
        now = self.clock()
        self.done += 1
        if r.success or r.aborted:
            self._recent.append((now, r.output_tokens))
        if self.bar is not None:
            self.bar.set_postfix_str(f"{self.tokens_per_s(now):.0f} out tok/s", refresh=False)
            self.bar.update(1)
            return
        step = self._step(now)
        if step > self._last_step:
            self._last_step = step
            print(self.line(now), file=self.stream, flush=True)

    def close(self) -> None:
        """End the bar, or print the final plain line (unless the last one was at 100 %)."""
        if self.bar is not None:
            self.bar.close()
            return
        if self._last_step < 10 or not (self.total or self.duration_s):
            print(self.line(), file=self.stream, flush=True)


def make_progress(enabled: bool, desc: str, total: int | None, duration_s: float | None) -> RunProgress | None:
    """A :class:`RunProgress` on stderr, or None when not ``enabled``."""
    return RunProgress(desc, total, duration_s) if enabled else None
