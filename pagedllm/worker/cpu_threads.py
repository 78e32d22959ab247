"""The CPU worker's intra-op threads fitted to the cores it actually gets.

A step runs dozens of parallel regions a layer; each ends at a barrier where every thread
waits for the slowest. When another process takes one of the cores, the thread on it loses
its time slice and every barrier waits for it: decode falls far below the engine's share
of the machine (docs/benchmarks.md section 16). ``ThreadGovernor`` watches how much of the
worker's cores other processes use (``/proc/stat`` per core, less this process's own time)
and runs on fewer threads while they are taken, back to all of them once they are free.
Greedy outputs do not depend on the thread count (every kernel's chain per output is fixed;
tests/worker/test_cpu_threads.py), so the switch never changes a token.
Off with ``PAGEDLLM_CPU_THREAD_GOVERNOR=0``."""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedllm import platform

logger = logging.getLogger("pagedllm")


def thread_count_warning(num_threads: int, cores: int | None = None) -> str | None:
    """A warning when ``num_threads`` exceeds the cores this process may use (affinity mask,
    cgroup quota: ``platform.usable_cores``), else None."""
    cores = platform.usable_cores() if cores is None else cores
    if num_threads <= cores:
        return None
    return (f"--num-threads {num_threads} exceeds the {cores} cores this process may use (CPU affinity "
            f"and cgroup quota): threads beyond the cores wait at every parallel region's barrier for a "
            f"core; use --num-threads {cores} or fewer")


def default_num_threads(cores: int | None = None) -> int:
    """torch's intra-op thread count capped to the usable cores (torch counts the machine's
    cores and ignores a cgroup quota)."""
    cores = platform.usable_cores() if cores is None else cores
    return max(1, min(torch.get_num_threads(), cores))


@dataclass
class CpuSample:
    """Cumulative counters at one moment: wall seconds, CPU seconds the cores spent busy
    (user, nice, system, irq, softirq, steal) and CPU seconds this process used."""

    wall: float
    busy: float
    own: float


class ProcStatProbe:
    """Reads ``/proc/stat``'s lines for ``cpus`` and ``/proc/self/stat``'s user + system time.
    Raises OSError where ``/proc/stat`` is missing or lists none of ``cpus``."""

    def __init__(self, cpus: set[int]):
        self.cpus = {f"cpu{c}" for c in cpus}
        self.tick = float(os.sysconf("SC_CLK_TCK"))
        if self.sample().busy < 0:
            raise OSError("no core of this process in /proc/stat")

    def sample(self) -> CpuSample:
        wall = time.monotonic()
        busy, seen = 0, False
        with open("/proc/stat") as f:
            for line in f:
                if not line.startswith("cpu"):
                    break
                parts = line.split()
                if parts[0] in self.cpus:
                    # user nice system idle iowait irq softirq steal ...
                    v = [int(x) for x in parts[1:9]]
                    busy += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
                    seen = True
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        own = int(fields[11]) + int(fields[12])          # utime, stime (fields 14, 15)
        return CpuSample(wall, busy / self.tick if seen else -1.0, own / self.tick)


class ThreadGovernor:
    """Sets torch's intra-op threads between steps: ``full`` while the worker's ``cores``
    (its affinity mask) are free; ``round(free cores)`` (at least 1, at most ``full``) once other processes keep more than half a core
    of them busy over a ``interval``-second window; ``full`` again after ``restore_windows``
    windows in a row with room for every thread. ``probe.sample()`` gives ``CpuSample``s."""

    def __init__(self, full: int, cores: int, probe, interval: float = 0.5, restore_windows: int = 2,
                 set_threads: Callable[[int], None] = torch.set_num_threads):
        if full < 1 or cores < 1:
            raise ValueError(f"ThreadGovernor needs full >= 1 and cores >= 1, got {full}, {cores}")
        self.full, self.cores, self.probe = full, cores, probe
        self.interval, self.restore_windows = interval, restore_windows
        self._set_threads = set_threads
        self.threads = full
        self.others = 0.0          # other processes' cores over the last window
        self.reductions = 0        # how many times it went below ``full``
        self._last = probe.sample()
        self._room_windows = 0

    def after_step(self) -> None:
        """Called after every step: at most one ``/proc`` read per ``interval``."""
        now = time.monotonic()
        if now - self._last.wall < self.interval:
            return
        self.observe(self.probe.sample())

    def observe(self, s: CpuSample) -> None:
        """Close the window ending at ``s`` and change the thread count if it calls for it."""
        prev, self._last = self._last, s
        wall = s.wall - prev.wall
        if wall <= 0:
            return
        self.others = max(0.0, (s.busy - prev.busy) - (s.own - prev.own)) / wall
        fit = max(1, min(self.full, int(self.cores - self.others + 0.5)))
        if fit < self.threads:
            self._room_windows = 0
            self._apply(fit, "reduced")
        elif fit > self.threads:
            self._room_windows += 1
            if self._room_windows >= self.restore_windows:
                self._room_windows = 0
                self._apply(fit, "restored")
        else:
            self._room_windows = 0

    def _apply(self, threads: int, how: str) -> None:
        if threads < self.threads:
            self.reductions += 1
        self._set_threads(threads)
        log = logger.warning if how == "reduced" and self.threads == self.full else logger.info
        log("CPU threads %s to %d of %d: other processes use %.1f of this worker's %d cores",
            how, threads, self.full, self.others, self.cores)
        self.threads = threads


def make_thread_governor(full: int) -> ThreadGovernor | None:
    """A governor over this process's cores (affinity mask), or None where it cannot watch
    them (no ``/proc/stat``), where there is one thread, or with the governor turned off."""
    from pagedllm import envs

    if not envs.cpu_thread_governor() or full < 2:
        return None
    cpus = os.sched_getaffinity(0)
    try:
        probe = ProcStatProbe(cpus)
    except (OSError, ValueError) as e:
        logger.info("CPU thread governor off: %s", e)
        return None
    return ThreadGovernor(full, len(cpus), probe)
