"""The CPU worker's intra-op threads fitted to the cores it actually gets.

A step runs dozens of parallel regions a layer; each ends at a barrier where every thread
waits for the slowest. When another process takes one of the cores, the thread on it loses
its time slice and every barrier waits for it: decode falls far below the engine's share
of the machine (docs/benchmarks.md section 16). ``ThreadGovernor`` watches how much of the
worker's cores other processes use (``/proc/stat`` per core, less this process's own time
and the cores its sibling ranks were given) and runs on fewer threads while they are
taken, back to all of them once they are free. Greedy outputs do not depend on the thread
count (every kernel's chain per output is fixed; tests/worker/test_cpu_threads.py), so the
switch never changes a token. Off with ``PAGEDLLM_CPU_THREAD_GOVERNOR=0``."""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagedllm import platform

logger = logging.getLogger("pagedllm")

# Load from other processes (in cores) above which a thread gives way, and the margin below
# it that a thread's return needs (so that a neighbour near the threshold does not flap).
REDUCE_AT = 0.5
RESTORE_MARGIN = 0.3


def thread_count_warning(num_threads: int, cores: int | None = None, ranks: int = 1) -> str | None:
    """A warning when ``ranks`` x ``num_threads`` exceeds the cores this process may use
    (affinity mask, cgroup quota: ``platform.usable_cores``), else None."""
    cores = platform.usable_cores() if cores is None else cores
    if num_threads * ranks <= cores:
        return None
    what = f"--num-threads {num_threads}" + (f" x {ranks} CPU ranks on this node" if ranks > 1 else "")
    fit = max(1, cores // ranks)
    return (f"{what} exceeds the {cores} cores this process may use (CPU affinity and cgroup quota): threads "
            f"beyond the cores wait at every parallel region's barrier for a core; use --num-threads {fit} or "
            f"fewer (the thread governor is off while they exceed the cores)")


# torch's intra-op thread count when this module was first imported: a governor of an
# earlier in-process engine may have lowered the current one, which a new engine must not
# inherit as its default
_TORCH_THREADS_AT_IMPORT = torch.get_num_threads()


def default_num_threads(cores: int | None = None) -> int:
    """torch's intra-op thread count (as at import) capped to the usable cores (torch
    counts the machine's cores and ignores a cgroup quota)."""
    cores = platform.usable_cores() if cores is None else cores
    return max(1, min(_TORCH_THREADS_AT_IMPORT, cores))


@dataclass
class CpuSample:
    """Cumulative counters at one moment: wall seconds, CPU seconds the cores spent busy
    (user, nice, system, irq, softirq, steal) and CPU seconds this process used;
    ``per_cpu``: each core's busy seconds (only cores present in both samples of a window
    count, so a core going offline or coming back does not count its whole history)."""

    wall: float
    busy: float
    own: float
    per_cpu: dict[str, float] = field(default_factory=dict)


class ProcStatProbe:
    """Reads ``/proc/stat``'s lines for ``cpus`` and ``/proc/self/stat``'s user + system time.
    Raises OSError where ``/proc/stat`` is missing or lists none of ``cpus``."""

    def __init__(self, cpus: set[int]):
        self.cpus = {f"cpu{c}" for c in cpus}
        self.tick = float(os.sysconf("SC_CLK_TCK"))
        if not self.sample().per_cpu:
            raise OSError("no core of this process in /proc/stat")

    def sample(self) -> CpuSample:
        wall = time.monotonic()
        per_cpu: dict[str, float] = {}
        with open("/proc/stat") as f:
            for line in f:
                if not line.startswith("cpu"):
                    break
                parts = line.split()
                if parts[0] in self.cpus:
                    # user nice system idle iowait irq softirq steal ...
                    v = [int(x) for x in parts[1:9]]
                    per_cpu[parts[0]] = (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / self.tick
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        own = (int(fields[11]) + int(fields[12])) / self.tick     # utime, stime (fields 14, 15)
        return CpuSample(wall, sum(per_cpu.values()), own, per_cpu)


class ThreadGovernor:
    """Sets torch's intra-op threads between steps. ``cores``: the cores it watches (its
    affinity mask); ``reserved``: cores its sibling ranks were given there (their load is
    not another process's). Free cores = cores - reserved - load of others over an
    ``interval``-second window; when fewer than ``full`` (by more than ``REDUCE_AT``), it runs
    on ``round(free)`` threads (at least 1); it goes back up (to at most ``full``) after
    ``restore_windows`` windows in a row that leave room with ``RESTORE_MARGIN`` to spare.
    A gap of ``idle_s`` without steps starts a new window instead of judging the idle time.
    ``probe.sample()`` gives ``CpuSample``s. Raises ValueError unless 1 <= full <= cores - reserved."""

    def __init__(self, full: int, cores: int, probe, interval: float = 0.5, restore_windows: int = 2,
                 set_threads: Callable[[int], None] = torch.set_num_threads, reserved: float = 0.0,
                 idle_s: float = 5.0):
        if not 1 <= full <= cores - reserved:
            raise ValueError(f"ThreadGovernor needs 1 <= full <= cores - reserved, got full={full}, "
                             f"cores={cores}, reserved={reserved}")
        self.full, self.cores, self.reserved, self.probe = full, cores, reserved, probe
        self.interval, self.restore_windows, self.idle_s = interval, restore_windows, idle_s
        self._set_threads = set_threads
        self.threads = full
        self.others = 0.0          # other processes' cores over the last window
        self.reductions = 0        # how many times it went below ``full``
        self._last = probe.sample()
        self._last_call: float | None = None   # the first step starts the first window
        self._room_windows = 0

    def after_step(self) -> None:
        """Called after every step: at most one ``/proc`` read per ``interval``."""
        now = time.monotonic()
        last_call, self._last_call = self._last_call, now
        if last_call is None or now - last_call > self.idle_s:
            self._last = self.probe.sample()   # start-up or idle: judge only what comes next
            return
        if now - self._last.wall >= self.interval:
            self.observe(self.probe.sample())

    def observe(self, s: CpuSample) -> None:
        """Close the window ending at ``s`` and change the thread count if it calls for it."""
        prev, self._last = self._last, s
        wall = s.wall - prev.wall
        if wall <= 0:
            return
        if s.per_cpu and prev.per_cpu:
            busy = sum(v - prev.per_cpu[c] for c, v in s.per_cpu.items() if c in prev.per_cpu)
        else:
            busy = s.busy - prev.busy
        self.others = max(0.0, (busy - (s.own - prev.own)) / wall - self.reserved)
        free = self.cores - self.reserved - self.others
        down = max(1, min(self.full, int(free + (1 - REDUCE_AT))))
        up = max(1, min(self.full, int(free - RESTORE_MARGIN + (1 - REDUCE_AT))))
        if down < self.threads:
            self._room_windows = 0
            self._apply(down, "reduced")
        elif up > self.threads:
            self._room_windows += 1
            if self._room_windows >= self.restore_windows:
                self._room_windows = 0
                self._apply(up, "restored")
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


def make_thread_governor(full: int, sibling_threads: int = 0) -> ThreadGovernor | None:
    """A governor over this process's cores (affinity mask), or None where it cannot watch
    them (no ``/proc/stat`` or affinity), where there is one thread, where ``full`` plus the
    ``sibling_threads`` of other ranks sharing these cores exceeds them (the start-up warning
    said so), or with the governor turned off."""
    from pagedllm import envs

    if not envs.cpu_thread_governor() or full < 2 or not hasattr(os, "sched_getaffinity"):
        return None
    cpus = os.sched_getaffinity(0)
    if full + sibling_threads > len(cpus):
        return None
    try:
        probe = ProcStatProbe(cpus)
    except (OSError, ValueError) as e:
        logger.info("CPU thread governor off: %s", e)
        return None
    return ThreadGovernor(full, len(cpus), probe, reserved=sibling_threads)
