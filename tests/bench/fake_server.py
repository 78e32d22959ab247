"""A fake OpenAI-compatible streaming server with a known latency model, for tests.

The server has ``capacity`` slots (``None`` = unlimited). A request waits for
a slot (queue time), then "prefills" for ``prefill_s + prefill_per_token_s *
prompt_tokens`` seconds, emits its first token, then one token every
``itl_s`` seconds until ``max_tokens``. So with closed-loop concurrency ``c``
and service time ``S = prefill + (max_tokens - 1) * itl``, TTFT is about the
prefill time while ``c <= capacity`` and grows by about ``S`` once requests
queue: a known knee at ``c = capacity`` (rate knee at ``capacity / S`` req/s).

It serves /v1/models, /health, /v1/completions, /v1/chat/completions (SSE
chunks like OpenAI's, a final usage chunk with ``stream_options``), and
/metrics with vLLM metric names (histogram sums/counts, counters, gauges).
Prefix-cache counters are token based on 4-token blocks, as vLLM counts them.
``fail_first_n`` answers that many POSTs with HTTP 503 first. ``drop_first_attempt``
{ordinal: k}: the first attempt of the ordinal-th distinct request (by prompt, in order of
arrival) drops its connection after streaming k tokens. Each request records ``streamed``
(tokens written) and ``disconnected`` (the client went away mid-stream: an abandoned one).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field

from aiohttp import web


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LatencyModel:
    capacity: int | None = None
    prefill_s: float = 0.005
    prefill_per_token_s: float = 0.0
    itl_s: float = 0.002
    fail_first_n: int = 0
    expose_metrics: bool = True
    model_name: str = "fake-model"
    block_size: int = 4
    no_stream: bool = False  # answer with one JSON body, ignoring stream=true
    error_after_tokens: int | None = None  # send an SSE error event after this many tokens
    error_code: int = 500  # the ``code`` of that event
    drop_first_attempt: dict = field(default_factory=dict)  # distinct-request ordinal -> tokens


@dataclass
class Stats:
    requests: list = field(default_factory=list)  # dicts: arrival, start, first, end, prompt_len, body
    in_flight: int = 0
    max_in_flight: int = 0
    posts: int = 0
    failed_posts: int = 0
    hist: dict = field(default_factory=lambda: {k: [0.0, 0] for k in (
        "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
        "time_to_first_token_seconds", "e2e_request_latency_seconds", "time_per_output_token_seconds")})
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    success: int = 0
    dropped: list = field(default_factory=list)  # tokens streamed by each dropped attempt
    disconnects: list = field(default_factory=list)  # tokens streamed before each client disconnect


class FakeServer:
    """Run with ``with FakeServer(LatencyModel(...)) as srv: srv.url``."""

    def __init__(self, model: LatencyModel | None = None):
        self.model = model or LatencyModel()
        self.stats = Stats()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._blocks: set = set()
        self._seen: dict = {}  # prompt key -> ordinal of first arrival
        self._lock = threading.Lock()

    # -- handlers ---------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model.model_name, "object": "model"}]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def metrics(self, request: web.Request) -> web.Response:
        if not self.model.expose_metrics:
            return web.Response(status=404, text="not found")
        s = self.stats
        lab = f'model_name="{self.model.model_name}"'
        lines = []
        for name, (sm, cnt) in s.hist.items():
            full = f"vllm:{name}"
            lines += [f"# TYPE {full} histogram",
                      f'{full}_bucket{{le="+Inf",{lab}}} {cnt}',
                      f"{full}_count{{{lab}}} {cnt}",
                      f"{full}_sum{{{lab}}} {sm}"]
        for name, v in (("prompt_tokens_total", s.prompt_tokens), ("generation_tokens_total", s.generation_tokens),
                        ("num_preemptions_total", 0), ("prefix_cache_queries_total", s.prefix_queries),
                        ("prefix_cache_hits_total", s.prefix_hits)):
            lines += [f"# TYPE vllm:{name} counter", f"vllm:{name}{{{lab}}} {float(v)}"]
        lines += ["# TYPE vllm:request_success_total counter",
                  f'vllm:request_success_total{{finished_reason="length",{lab}}} {float(s.success)}',
                  "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{{{lab}}} {s.in_flight}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    def _observe(self, name: str, v: float) -> None:
        h = self.stats.hist[name]
        h[0] += v
        h[1] += 1

    async def generate(self, request: web.Request) -> web.StreamResponse:
        arrival = time.perf_counter()
        body = await request.json()
        m, s = self.model, self.stats
        s.posts += 1
        if s.posts <= m.fail_first_n:
            s.failed_posts += 1
            return web.json_response({"error": {"message": "overloaded"}}, status=503)
        chat = request.path.endswith("/chat/completions")
        if chat:
            msgs = body["messages"]
            prompt_len = max(1, sum(len(str(x.get("content", "")).split()) for x in msgs))
            ids = None
        else:
            p = body["prompt"]
            if isinstance(p, list):
                ids = [int(t) for t in p]
                prompt_len = len(ids)
            else:
                ids = None
                prompt_len = max(1, len(p.split()))
        if ids is not None:
            bs = m.block_size
            full = len(ids) // bs
            s.prefix_queries += len(ids)
            for b in range(full):
                key = tuple(ids[: (b + 1) * bs])
                if key in self._blocks:
                    s.prefix_hits += bs
                else:
                    self._blocks.add(key)
        max_tokens = int(body.get("max_tokens", 16))
        rec = {"arrival": arrival, "prompt_len": prompt_len, "body": body, "chat": chat, "streamed": 0,
               "disconnected": False}
        s.requests.append(rec)
        key = json.dumps(body.get("messages") if chat else body.get("prompt"), sort_keys=True)
        drop_after = None
        if key not in self._seen:
            self._seen[key] = len(self._seen)
            drop_after = m.drop_first_attempt.get(self._seen[key])
        if m.no_stream:
            await asyncio.sleep(m.prefill_s + m.itl_s * (max_tokens - 1))
            text = "".join(f" tok{i}" for i in range(max_tokens))
            choice = {"index": 0, "message": {"role": "assistant", "content": text}} if chat else \
                {"index": 0, "text": text}
            return web.json_response({"id": "x", "choices": [choice], "usage": {
                "prompt_tokens": prompt_len, "completion_tokens": max_tokens}})
        sem = self._sem
        if sem is not None:
            await sem.acquire()
        s.in_flight += 1
        try:
            start = time.perf_counter()
            s.max_in_flight = max(s.max_in_flight, s.in_flight)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await asyncio.sleep(m.prefill_s + m.prefill_per_token_s * prompt_len)
            first = time.perf_counter()
            rid = f"cmpl-{len(s.requests)}"
            if chat:
                await resp.write(self._sse({"id": rid, "object": "chat.completion.chunk", "choices": [
                    {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}))
            for i in range(max_tokens):
                if i:
                    await asyncio.sleep(m.itl_s)
                if drop_after is not None and i == drop_after:
                    s.dropped.append(i)
                    request.transport.close()  # flushes what was written, then closes
                    return resp
                if m.error_after_tokens is not None and i == m.error_after_tokens:
                    await resp.write(self._sse({"error": {"message": "engine died", "code": m.error_code}}))
                    await resp.write_eof()
                    return resp
                tok = f" tok{i}"
                last = i == max_tokens - 1
                if chat:
                    ch = {"index": 0, "delta": {"content": tok}, "finish_reason": "length" if last else None}
                    obj = {"id": rid, "object": "chat.completion.chunk", "choices": [ch]}
                else:
                    ch = {"index": 0, "text": tok, "finish_reason": "length" if last else None}
                    obj = {"id": rid, "object": "text_completion", "choices": [ch]}
                try:
                    await resp.write(self._sse(obj))
                except (ConnectionError, RuntimeError):  # the client closed the stream
                    rec["disconnected"] = True
                    s.disconnects.append(rec["streamed"])
                    return resp
                rec["streamed"] += 1
            end = time.perf_counter()
            if (body.get("stream_options") or {}).get("include_usage"):
                await resp.write(self._sse({"id": rid, "choices": [], "usage": {
                    "prompt_tokens": prompt_len, "completion_tokens": max_tokens,
                    "total_tokens": prompt_len + max_tokens}}))
            await resp.write(b"data: [DONE]\n\n")
            rec.update(start=start, first=first, end=end)
            self._observe("request_queue_time_seconds", start - arrival)
            self._observe("request_prefill_time_seconds", first - start)
            self._observe("request_decode_time_seconds", end - first)
            self._observe("time_to_first_token_seconds", first - arrival)
            self._observe("e2e_request_latency_seconds", end - arrival)
            if max_tokens > 1:
                self._observe("time_per_output_token_seconds", (end - first) / (max_tokens - 1))
            s.prompt_tokens += prompt_len
            s.generation_tokens += max_tokens
            s.success += 1
            await resp.write_eof()
            return resp
        finally:
            s.in_flight -= 1
            if sem is not None:
                sem.release()

    @staticmethod
    def _sse(obj: dict) -> bytes:
        return f"data: {json.dumps(obj)}\n\n".encode()

    def wait_idle(self, timeout_s: float = 5.0) -> None:
        """Wait until no request is in flight: a stream the client closed is noticed at the
        server's next write, after the client's run may have ended."""
        deadline = time.perf_counter() + timeout_s
        while self.stats.in_flight and time.perf_counter() < deadline:
            time.sleep(0.005)

    # -- lifecycle ---------------------------------------------------------
    def __enter__(self) -> "FakeServer":
        started = threading.Event()
        self._error: BaseException | None = None

        def run() -> None:
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
            try:
                self._sem = asyncio.Semaphore(self.model.capacity) if self.model.capacity else None
                app = web.Application()
                app.router.add_get("/v1/models", self.models)
                app.router.add_get("/health", self.health)
                app.router.add_get("/metrics", self.metrics)
                app.router.add_post("/v1/completions", self.generate)
                app.router.add_post("/v1/chat/completions", self.generate)
                self._runner = web.AppRunner(app, access_log=None)
                self.loop.run_until_complete(self._runner.setup())
                site = web.TCPSite(self._runner, "127.0.0.1", self.port)
                self.loop.run_until_complete(site.start())
            except BaseException as e:  # noqa: BLE001
                self._error = e
                started.set()
                return
            started.set()
            self.loop.run_forever()
            self.loop.run_until_complete(self._runner.cleanup())
            self.loop.close()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        started.wait(10)
        if self._error:
            raise self._error
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
