"""The OpenAI server in the test process, and process checks, shared by the server,
engine-process and end-to-end tests."""
from __future__ import annotations

import os
import socket
import threading
import time

import httpx

from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.metrics import PrometheusStatLogger
from pagedllm.entrypoints.openai.api_server import build_app

MAX_MODEL_LEN = 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """``app_kw``: extra arguments of ``build_app`` (e.g. the tool-calling flags);
    ``engine_kw``: EngineArgs settings over the suite's (the core runs in this process
    unless ``engine_process=True``)."""

    def __init__(self, engine_kw: dict | None = None, **app_kw):
        import uvicorn

        kw = dict(dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN, kv_cache_memory="256MiB",
                  num_threads=1, engine_process=False)
        kw.update(engine_kw or {})
        self.engine = AsyncLLM(EngineArgs(**kw), log_stats=False)
        # as run_server: the logger is labelled with the model name, known once loaded
        self.prom = PrometheusStatLogger(self.engine.model_name)
        self.engine.engine.stat_loggers.append(self.prom)
        self.port = _free_port()
        app = build_app(self.engine, self.prom, **app_kw)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=2, headers=self.auth).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("server did not start")

    auth: dict = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def idle_and_free(self, timeout: float = 10.0) -> bool:
        """True once no request is alive and every KV block is free (asked of the core
        itself, in this process or in its own)."""
        eng = self.engine.engine
        deadline = time.time() + timeout
        while time.time() < deadline:
            st = eng.get_scheduler_stats()
            if (not eng.states and st.num_running == 0 and st.num_waiting == 0
                    and st.num_blocks_used == 0):
                return True
            time.sleep(0.05)
        return False

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.engine.shutdown()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:   # a zombie (exited, not yet reaped) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False
