"""The engine core in its own process (``MPClient`` + ``core/engine_proc.py``), the default:
the same greedy tokens as the core in process, utility calls, start-up errors raised in
the front end as they were raised there, and the failure model: a killed engine process
fails every open request and /health within 1 s, an engine whose front end dies exits by
itself, and no path leaves an engine process behind."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from server_helpers import _alive, _Server, _wait_gone

from pagedllm import LLM, SamplingParams
from pagedllm.errors import EngineDeadError


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The history of the city goes back more than two thousand years, when a small settlement grew "
           "up around a river crossing used by traders who carried salt, wine and pottery between the "
           "coast and the mountains. Over the centuries the town"]   # the last fills full blocks
KW = dict(dtype="float32", device="cpu", max_model_len=256, kv_cache_memory="128MiB", num_threads=1)


def test_same_tokens_as_in_process_and_utilities():
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    inproc = LLM(**KW, engine_process=False)
    try:
        want = [o.outputs[0].token_ids for o in inproc.generate(PROMPTS, sp, use_tqdm=False)]
    finally:
        inproc.shutdown()
    llm = LLM(**KW)
    pid = llm.llm_engine.engine_core.pid
    try:
        assert pid != os.getpid() and _alive(pid)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
        assert got == want
        # the same prompts again hit the prefix cache in the other process
        again = llm.generate(PROMPTS, sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == want
        st = llm.stats()
        assert st.prefix_cache_hits > 0 and st.num_blocks_used == 0 and st.num_running == st.num_waiting == 0
        assert llm.reset_prefix_cache() > 0
        assert llm.llm_engine.max_model_len == 256
    finally:
        llm.shutdown()
    assert _wait_gone(pid, 5), "the engine process outlived shutdown()"


@pytest.mark.slow
def test_start_up_error_is_raised_in_the_front_end():
    """A cache too small for the asked max_model_len: the core's ValueError, with its text."""
    with pytest.raises(ValueError, match="larger than the KV cache can hold"):
        LLM(**{**KW, "max_model_len": 2048, "kv_cache_memory": "1MiB"})


def test_shutdown_returns_when_the_live_engine_has_no_socket_connected():
    """An engine that failed while starting may still be alive (flushing its FAILED
    message) with nothing connected to the front end's input socket: shutdown must not
    block on sending it SHUTDOWN (a PUSH send with no peer waits forever), and it stops
    the process. Here: a client whose process is a plain ``sleep``."""
    import tempfile
    import threading
    import weakref

    import zmq

    from pagedllm.engine.core_client import MPClient

    c = MPClient.__new__(MPClient)
    c._dir = tempfile.mkdtemp(prefix="pagedllm-test-")
    c._ctx = zmq.Context()
    c._input = c._ctx.socket(zmq.PUSH)
    c._input.setsockopt(zmq.LINGER, 0)
    c._input.bind(f"ipc://{c._dir}/input")
    c._send_lock, c._stopping = threading.Lock(), threading.Event()
    c._dead, c._closed, c._thread = None, False, None
    c.SHUTDOWN_WAIT_S = 0.5   # the sleep never answers SHUTDOWN: _cleanup terminates it
    c._proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    c._finalizer = weakref.finalize(c, MPClient._cleanup, c._proc, c._ctx, c._dir, c._stopping)
    done = threading.Event()
    t = threading.Thread(target=lambda: (c.shutdown(), done.set()), daemon=True)
    t0 = time.monotonic()
    t.start()
    assert done.wait(15), "shutdown blocked"
    assert time.monotonic() - t0 < 10
    assert c._proc.poll() is not None and not os.path.exists(c._dir)


@pytest.mark.serial   # timing-sensitive: run alone, after the parallel part of `make test`
def test_killed_engine_fails_open_streams_and_health_within_a_second():
    s = _Server(engine_kw=dict(engine_process=True))
    try:
        pid = s.engine.engine.engine_core.pid
        got: dict = {}

        async def stream():
            body = {"prompt": "Count to a thousand:", "max_tokens": 400, "ignore_eos": True,
                    "temperature": 0, "stream": True}
            async with httpx.AsyncClient(timeout=30) as c:
                async with c.stream("POST", f"{s.url}/v1/completions", json=body) as r:
                    lines = []
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            lines.append(line)
                            if len(lines) == 3:
                                os.kill(pid, signal.SIGKILL)
                                got["killed"] = time.monotonic()
                    got["ended"] = time.monotonic()
                    got["lines"] = lines

        asyncio.run(stream())
        assert got["ended"] - got["killed"] < 1.0
        err = [ln for ln in got["lines"] if '"error"' in ln]
        assert len(err) == 1 and '"code": 503' in err[0] and "exit code -9" in err[0]
        assert got["lines"][-1] == "data: [DONE]"
        r = httpx.get(f"{s.url}/health", timeout=5)
        assert r.status_code == 503 and r.json()["error"]["code"] == 503
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=5)
        assert r.status_code == 503 and "exit code -9" in r.json()["error"]["message"]
        with pytest.raises(EngineDeadError):
            s.engine.engine.engine_core.check_health()
    finally:
        s.stop()


@pytest.mark.slow
def test_engine_exits_when_its_front_end_is_killed():
    """SIGKILL leaves the front end no time to stop its engine: the engine notices its
    parent is gone and exits by itself."""
    code = ("import sys\nfrom pagedllm import LLM\n"
            "llm = LLM(dtype='float32', max_model_len=128, kv_cache_memory='64MiB', num_threads=1)\n"
            "print(llm.llm_engine.engine_core.pid, flush=True)\nsys.stdin.read()\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pid = int(p.stdout.readline())
        assert _alive(pid)
        p.kill()
        p.wait(10)
        assert _wait_gone(pid, 5), "the engine process outlived its killed front end"
    finally:
        if p.poll() is None:
            p.kill()


@pytest.mark.parametrize("ignores_sigterm", [False, True])
def test_stop_process_terminates_then_kills(ignores_sigterm):
    from pagedllm.utils import stop_process

    code = ("import signal, sys, time\n"
            f"if {ignores_sigterm}: signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "print('ready', flush=True); time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "ready\n"
        t0 = time.monotonic()
        status = stop_process(p, 1.0)
        assert status == (-signal.SIGKILL if ignores_sigterm else -signal.SIGTERM)
        assert time.monotonic() - t0 < 5
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdout.close()


def test_stop_process_only_reaps_one_that_exited():
    from pagedllm.utils import stop_process

    p = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    while p.poll() is None:
        time.sleep(0.01)
    assert stop_process(p, 1.0) == 3
