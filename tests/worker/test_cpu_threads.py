"""The CPU worker's threads fitted to the cores it gets (``worker/cpu_threads.py``): the
governor's decisions from load samples, the start-up warning, greedy outputs that do not
depend on the thread count, and detection of a real busy process beside it (serial)."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest
import torch

from pagedllm import platform
from pagedllm.worker import cpu_threads
from pagedllm.worker.cpu_threads import (CpuSample, ProcStatProbe, ThreadGovernor, default_num_threads,
                                         make_thread_governor, thread_count_warning)


class FakeProbe:
    """Samples in which other processes keep ``others`` cores busy (this process ``own``);
    no per-core counters."""

    def __init__(self):
        self.t = self.busy = self.own = 0.0

    def advance(self, seconds: float, others: float, own: float = 1.0) -> CpuSample:
        self.t += seconds
        self.busy += (others + own) * seconds
        self.own += own * seconds
        return self.sample()

    def sample(self) -> CpuSample:
        return CpuSample(self.t, self.busy, self.own)


def _governor(full=4, cores=4):
    calls: list[int] = []
    probe = FakeProbe()
    return ThreadGovernor(full, cores, probe, set_threads=calls.append), probe, calls


def test_reduces_to_the_free_cores_and_restores_after_two_free_windows():
    gov, probe, calls = _governor()
    gov.observe(probe.advance(0.5, others=0.3))            # under half a core: nothing
    assert gov.threads == 4 and calls == []
    gov.observe(probe.advance(0.5, others=1.0, own=3.0))   # one core taken: 3 threads at once
    assert gov.threads == 3 and calls == [3] and gov.others == pytest.approx(1.0)
    gov.observe(probe.advance(0.5, others=2.6))            # 1.4 free rounds to 1
    assert gov.threads == 1 and calls == [3, 1] and gov.reductions == 2
    gov.observe(probe.advance(0.5, others=3.9))            # never below one thread
    assert gov.threads == 1 and calls == [3, 1]
    gov.observe(probe.advance(0.5, others=0.0))            # one free window is not enough
    assert gov.threads == 1
    gov.observe(probe.advance(0.5, others=3.0))            # busy again: the count starts over
    gov.observe(probe.advance(0.5, others=0.0))
    assert gov.threads == 1
    gov.observe(probe.advance(0.5, others=0.1))
    assert gov.threads == 4 and calls == [3, 1, 4]         # never above full


def test_cores_beyond_full_are_slack():
    """8 cores, 2 threads: other processes may use up to 6.4 of them before one thread goes."""
    gov, probe, calls = _governor(full=2, cores=8)
    gov.observe(probe.advance(1.0, others=6.4))
    assert gov.threads == 2 and calls == []
    gov.observe(probe.advance(1.0, others=6.6))
    assert gov.threads == 1 and calls == [1]


def test_a_neighbour_near_the_threshold_does_not_flap():
    """Reduced above half a core, restored only below 0.2 of one."""
    gov, probe, calls = _governor(full=2, cores=2)
    for others in (0.6, 0.4, 0.4, 0.6, 0.4, 0.4, 0.3, 0.3):
        gov.observe(probe.advance(0.5, others=others))
    assert calls == [1]
    gov.observe(probe.advance(0.5, others=0.1))
    gov.observe(probe.advance(0.5, others=0.1))
    assert calls == [1, 2]


def test_sibling_ranks_cores_are_not_other_processes():
    """Two ranks of 2 threads on 4 shared cores: the sibling's 2 cores are reserved."""
    gov, probe, calls = _governor(full=2, cores=4)
    gov.reserved = 2
    gov.observe(probe.advance(0.5, others=2.0))       # the sibling at work: room for both threads
    assert calls == []
    gov.observe(probe.advance(0.5, others=3.0))       # and one more process: one thread gives way
    assert calls == [1]
    with pytest.raises(ValueError, match="cores - reserved"):
        ThreadGovernor(3, 4, FakeProbe(), reserved=2)


def test_a_core_that_comes_back_counts_from_its_return():
    """Per-core counters: a core absent from the window's first sample adds nothing."""
    gov, _, calls = _governor(full=2, cores=2)
    gov.observe(CpuSample(0.0, 0.0, 0.0, {"cpu0": 10.0}))
    gov.observe(CpuSample(0.5, 0.0, 0.5, {"cpu0": 10.5, "cpu1": 5000.0}))
    assert gov.others == 0.0 and calls == []


def test_after_step_reads_once_per_interval_and_skips_idle_gaps(monkeypatch):
    probe = FakeProbe()
    reads = []
    real = probe.sample
    probe.sample = lambda: reads.append(1) or real()
    calls: list[int] = []
    gov = ThreadGovernor(2, 2, probe, interval=0.5, set_threads=calls.append, idle_s=5.0)
    clock = [100.0]
    monkeypatch.setattr("pagedllm.worker.cpu_threads.time.monotonic", lambda: clock[0])
    reads.clear()
    probe.t = clock[0]                     # the probe's clock is the governor's
    gov.after_step()                       # the first step starts the first window
    assert reads == [1]
    for _ in range(10):                    # ten steps inside one interval: no read
        clock[0] += 0.01
        gov.after_step()
    assert reads == [1]
    clock[0] += 0.5
    probe.t = clock[0]
    gov.after_step()
    assert reads == [1, 1]
    # an idle minute in which another process ran: not judged, a new window starts
    clock[0] += 60
    probe.t, probe.busy = clock[0], probe.busy + 90.0    # 1.5 cores for 60 s (no read)
    gov.after_step()
    assert reads == [1, 1, 1] and calls == [] and gov.threads == 2


def test_bad_arguments():
    with pytest.raises(ValueError, match="1 <= full"):
        ThreadGovernor(0, 2, FakeProbe())
    with pytest.raises(ValueError, match="1 <= full"):
        ThreadGovernor(3, 2, FakeProbe())


def test_thread_count_warning_names_the_flag_and_the_cores():
    assert thread_count_warning(2, cores=2) is None
    msg = thread_count_warning(8, cores=2)
    assert "--num-threads 8" in msg and "2 cores" in msg and "--num-threads 2" in msg
    msg = thread_count_warning(2, cores=2, ranks=2)
    assert "--num-threads 2 x 2 CPU ranks" in msg and "--num-threads 1" in msg
    assert default_num_threads(cores=1) == 1
    assert 1 <= default_num_threads() <= platform.usable_cores()
    before = torch.get_num_threads()
    try:   # an earlier in-process engine's governor lowered the count: not the next one's default
        torch.set_num_threads(1)
        assert default_num_threads() == min(cpu_threads._TORCH_THREADS_AT_IMPORT, platform.usable_cores())
    finally:
        torch.set_num_threads(before)


def test_worker_warns_at_start_up_and_keeps_no_governor_for_one_thread(monkeypatch, caplog):
    from pagedllm.worker.worker import Worker

    set_to: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    w = Worker.__new__(Worker)
    cores = platform.usable_cores()
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        w._set_up_cpu_threads(cores + 3)
    assert set_to == [cores + 3]
    assert any(f"--num-threads {cores + 3} exceeds" in r.getMessage() for r in caplog.records)
    assert w.thread_governor is None                  # threads past the cores: warned, not governed
    w._set_up_cpu_threads(1)
    assert w.thread_governor is None                  # nothing to take away from one thread
    monkeypatch.setenv("PAGEDLLM_CPU_THREAD_GOVERNOR", "0")
    assert make_thread_governor(4) is None


def test_worker_consults_the_governor_after_each_step():
    from types import SimpleNamespace

    from pagedllm.worker.worker import Worker

    w = Worker.__new__(Worker)
    seen = []
    w.model_runner = SimpleNamespace(execute_model=lambda so: seen.append(("step", so)) or "out")
    w.thread_governor = SimpleNamespace(after_step=lambda: seen.append(("governor", None)))
    assert w.execute_model("so") == "out" and seen == [("step", "so"), ("governor", None)]


def test_the_api_server_keeps_no_core_sized_pools(monkeypatch):
    from pagedllm.entrypoints.openai import api_server

    set_to: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    api_server._keep_off_the_engine_cores()
    assert set_to == [1] and os.environ["TOKENIZERS_PARALLELISM"] == "false"


def test_proc_stat_probe_counts_this_process():
    probe = ProcStatProbe(os.sched_getaffinity(0))
    a = probe.sample()
    t = time.process_time()
    while time.process_time() - t < 0.3:   # 0.3 s of this process's CPU
        pass
    b = probe.sample()
    assert b.wall > a.wall and b.own - a.own >= 0.2 and b.busy - a.busy >= b.own - a.own - 0.05
    with pytest.raises(OSError):
        ProcStatProbe({10_000})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_outputs_do_not_depend_on_the_thread_count(monkeypatch, tiny_dir, dtype):
    """What makes the governor safe: 1 thread and 2 give the same tokens and logprobs
    (prefills and decodes, several requests a step)."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.platform import has_native_bf16

    if dtype == "bfloat16" and not has_native_bf16():
        pytest.skip("bfloat16 is not native on this CPU")
    monkeypatch.setenv("PAGEDLLM_CPU_THREAD_GOVERNOR", "0")    # the counts below, not the governor's
    llm = LLM(model=tiny_dir, dtype=dtype, max_model_len=256, kv_cache_memory="32MiB", engine_process=False,
              max_num_batched_tokens=64)
    before = torch.get_num_threads()
    try:
        sp = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
        prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 2000 + 1 for j in range(5 + 17 * i)]} for i in range(5)]
        got = []
        for n in (2, 1):
            torch.set_num_threads(n)
            outs = llm.generate(prompts, sp, use_tqdm=False)
            assert torch.get_num_threads() == n
            got.append([(o.outputs[0].token_ids, [sorted((t, lp.logprob) for t, lp in d.items())
                                                  for d in o.outputs[0].logprobs]) for o in outs])
    finally:
        torch.set_num_threads(before)
        llm.shutdown()
    assert got[0] == got[1]


@pytest.mark.serial   # reads the machine's load: run alone, after the parallel part of `make test`
def test_detects_a_busy_process_on_its_cores_and_gives_the_core_back():
    """A real busy loop pinned to one of this process's cores: the governor drops a thread
    within a few windows, and restores it within a few windows of the loop's end."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two cores")
    calls: list[int] = []
    gov = ThreadGovernor(len(cpus), len(cpus), ProcStatProbe(set(cpus)), interval=0.3, set_threads=calls.append)
    loop = subprocess.Popen([sys.executable, "-c", "import os, time\nos.sched_setaffinity(0, {%d})\n"
                             "end = time.time() + 20\nwhile time.time() < end: pass" % cpus[-1]])
    try:
        deadline = time.monotonic() + 6
        while gov.threads == len(cpus) and time.monotonic() < deadline:
            time.sleep(0.05)
            gov.after_step()
        assert gov.threads == len(cpus) - 1 and gov.others > 0.5, (gov.others, calls)
    finally:
        loop.kill()
        loop.wait(timeout=10)
    deadline = time.monotonic() + 6
    while gov.threads < len(cpus) and time.monotonic() < deadline:
        time.sleep(0.05)
        gov.after_step()
    assert gov.threads == len(cpus) and calls == [len(cpus) - 1, len(cpus)]
