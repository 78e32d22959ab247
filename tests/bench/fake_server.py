"""A fake OpenAI-compatible streaming server with a known latency model, for tests.

The server has ``capacity`` slots (``None`` = unlimited). A request waits for
a slot (queue time), then "prefills" for ``prefill_s + prefill_per_token_s *
prompt_tokens`` seconds, emits its first token, then one token every
``itl_s`` seconds until ``max_tokens``. So with closed-loop concurrency ``c``
and service time ``S = prefill + (max_tokens - 1) * itl``, TTFT is about the
prefill time while ``c <= capacity`` and grows by about ``S`` once requests
queue: a known knee at ``c = capacity`` (rate knee at ``capacity / S`` req/s).

It serves /v1/models, /health, /v1/completions, /v1/chat/completions (SSE
chunks like OpenAI's, a final usage chunk with ``stream_options``), /v1/responses and
/v1/messages (each API's own events, usage and error shapes; bodies checked as strictly as
pagedllm's: an unknown field or a missing required one is a 400 in the API's error shape),
/reset_prefix_cache, and /metrics with vLLM metric names (histogram sums/counts, counters,
gauges). Prefix-cache counters are token based on 4-token blocks, as vLLM counts them; a
chat-turn prompt is "rendered" as a role word per message plus its content's words, and its
cached words come back in usage (``cached_tokens`` / ``cache_read_input_tokens``).
``fail_first_n`` answers that many POSTs with HTTP 503 first. ``error_after_tokens``: a
stream error event after that many tokens, in the API's shape, with status ``error_code``
(chat/completions: ``code``; responses: a named ``code``; messages: ``error.type``).
``drop_first_attempt`` {ordinal: k}: the first attempt of the ordinal-th distinct request
(by prompt or conversation, in order of arrival) drops its connection after streaming k
tokens. Each request records ``streamed`` (tokens written) and ``disconnected`` (the client
went away mid-stream: an abandoned one); ``Stats.dropped`` and ``Stats.disconnects`` list
the tokens streamed by each dropped attempt and before each client disconnect. Every API.
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
    error_code: int = 500  # the status of that event
    drop_first_attempt: dict = field(default_factory=dict)  # distinct-request ordinal -> tokens
    reset_route: bool = True  # serve POST /reset_prefix_cache


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
    resets: int = 0
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

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        n = len(self._blocks)
        self._blocks.clear()
        self.stats.resets += 1
        return web.json_response({"status": "ok", "num_blocks_dropped": n})

    @staticmethod
    def _api(path: str) -> str:
        for api in ("chat", "responses", "messages"):
            if path.endswith({"chat": "/chat/completions", "responses": "/responses", "messages": "/messages"}[api]):
                return api
        return "completions"

    @staticmethod
    def _error_response(api: str, status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
        if api == "messages":
            return web.json_response({"type": "error", "error": {"type": kind, "message": message}}, status=status)
        return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": None}},
                                 status=status)

    @staticmethod
    def _chat_messages(api: str, body: dict) -> tuple[list[dict] | None, int | None, str | None]:
        """(chat messages, max tokens, error) of a chat-turn body, checked like pagedllm's."""
        allowed = {"chat": None,
                   "responses": {"model", "input", "instructions", "max_output_tokens", "stream", "store",
                                 "temperature", "top_p"},
                   "messages": {"model", "max_tokens", "system", "messages", "stream", "temperature", "top_p",
                                "top_k", "stop_sequences"}}[api]
        if allowed is not None and set(body) - allowed:
            return None, None, f"unknown fields: {', '.join(sorted(set(body) - allowed))}"
        if api == "chat":
            return body["messages"], int(body.get("max_tokens", 16)), None
        if api == "responses":
            items = body.get("input")
            if not isinstance(items, list) or not all(i.get("type") == "message" for i in items):
                return None, None, "input: message items expected"
            sys_ = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
            return sys_ + [{"role": i["role"], "content": i["content"]} for i in items], \
                int(body.get("max_output_tokens") or 16), None
        if "max_tokens" not in body:
            return None, None, "max_tokens: Field required"
        msgs = body.get("messages") or []
        if not msgs or msgs[-1]["role"] != "user" or any(m["role"] not in ("user", "assistant") for m in msgs):
            return None, None, "messages: user and assistant turns ending with the user's expected"
        sys_ = [{"role": "system", "content": body["system"]}] if body.get("system") else []
        return sys_ + msgs, int(body["max_tokens"]), None

    def _count_prefix(self, ids: list) -> int:
        """Prefix-cache lookup of ``ids`` on whole blocks: the hit tokens (counters updated)."""
        bs = self.model.block_size
        hits = 0
        self.stats.prefix_queries += len(ids)
        for b in range(len(ids) // bs):
            key = tuple(ids[: (b + 1) * bs])
            if key in self._blocks:
                hits += bs
            else:
                self._blocks.add(key)
        self.stats.prefix_hits += hits
        return hits

    async def generate(self, request: web.Request) -> web.StreamResponse:
        arrival = time.perf_counter()
        body = await request.json()
        m, s = self.model, self.stats
        api = self._api(request.path)
        s.posts += 1
        if s.posts <= m.fail_first_n:
            s.failed_posts += 1
            return self._error_response(api, 503, "overloaded", "overloaded_error")
        chat = api != "completions"
        msgs = None
        if chat:
            msgs, max_tokens, err = self._chat_messages(api, body)
            if err:
                return self._error_response(api, 400, err)
            # "rendered": a role word per message, then the content's words
            ids = [w for x in msgs for w in [f"<{x['role']}>", *str(x.get("content", "")).split()]]
            prompt_len = len(ids)
        else:
            max_tokens = int(body.get("max_tokens", 16))
            p = body["prompt"]
            if isinstance(p, list):
                ids = [int(t) for t in p]
                prompt_len = len(ids)
            else:
                ids = None
                prompt_len = max(1, len(p.split()))
        cached = self._count_prefix(ids) if ids is not None else 0
        rec = {"arrival": arrival, "prompt_len": prompt_len, "body": body, "chat": chat, "api": api,
               "messages": msgs, "cached": cached, "streamed": 0, "disconnected": False}
        s.requests.append(rec)
        key = json.dumps(msgs if chat else body.get("prompt"), sort_keys=True)
        drop_after = None
        if key not in self._seen:
            self._seen[key] = len(self._seen)
            drop_after = m.drop_first_attempt.get(self._seen[key])
        text = "".join(f" tok{i}" for i in range(max_tokens))
        if m.no_stream:
            await asyncio.sleep(m.prefill_s + m.itl_s * (max_tokens - 1))
            return web.json_response(self._whole(api, text, prompt_len, max_tokens, cached))
        sem = self._sem
        if sem is not None:
            await sem.acquire()
        s.in_flight += 1
        try:
            start = time.perf_counter()
            s.max_in_flight = max(s.max_in_flight, s.in_flight)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            ev = _Events(api, f"cmpl-{len(s.requests)}")
            for b in ev.head(prompt_len, cached):
                await resp.write(b)
            await asyncio.sleep(m.prefill_s + m.prefill_per_token_s * prompt_len)
            first = time.perf_counter()
            for b in ev.first(prompt_len, cached):
                await resp.write(b)
            try:
                for i in range(max_tokens):
                    if i:
                        await asyncio.sleep(m.itl_s)
                    if drop_after is not None and i == drop_after:
                        s.dropped.append(i)
                        request.transport.close()  # flushes what was written, then closes
                        return resp
                    if m.error_after_tokens is not None and i == m.error_after_tokens:
                        await resp.write(ev.error("engine died", m.error_code))
                        await resp.write_eof()
                        return resp
                    await resp.write(ev.token(f" tok{i}", i == max_tokens - 1))
                    rec["streamed"] += 1
                end = time.perf_counter()
                usage = (body.get("stream_options") or {}).get("include_usage")
                for b in ev.tail(prompt_len, max_tokens, cached, usage):
                    await resp.write(b)
            except (ConnectionError, RuntimeError):  # the client closed the stream
                rec["disconnected"] = True
                s.disconnects.append(rec["streamed"])
                return resp
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
    def _whole(api: str, text: str, prompt_len: int, n: int, cached: int) -> dict:
        """A whole (non-streamed) answer in ``api``'s shape."""
        if api == "responses":
            return {"id": "resp_x", "object": "response", "status": "incomplete", "error": None,
                    "output": [{"type": "message", "role": "assistant", "content": [
                        {"type": "output_text", "text": text, "annotations": []}]}],
                    "usage": {"input_tokens": prompt_len, "input_tokens_details": {"cached_tokens": cached},
                              "output_tokens": n, "total_tokens": prompt_len + n}}
        if api == "messages":
            return {"id": "msg_x", "type": "message", "role": "assistant", "content": [{"type": "text", "text": text}],
                    "stop_reason": "max_tokens", "usage": {"input_tokens": prompt_len - cached, "output_tokens": n,
                                                           "cache_read_input_tokens": cached,
                                                           "cache_creation_input_tokens": 0}}
        choice = {"index": 0, "message": {"role": "assistant", "content": text}} if api == "chat" else \
            {"index": 0, "text": text}
        return {"id": "x", "choices": [choice], "usage": {"prompt_tokens": prompt_len, "completion_tokens": n,
                                                          "prompt_tokens_details": {"cached_tokens": cached}}}

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
                app.router.add_post("/v1/responses", self.generate)
                app.router.add_post("/v1/messages", self.generate)
                if self.model.reset_route:
                    app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
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


class _Events:
    """The SSE bytes of one streamed answer in ``api``'s shape: ``head`` (before the first
    token), ``first`` (with it), ``token`` each, ``tail`` (usage, end), or ``error``."""

    def __init__(self, api: str, rid: str):
        self.api, self.rid, self.seq = api, rid, 0

    def _sse(self, obj: dict) -> bytes:
        if self.api == "responses":
            obj = {"type": obj["type"], "sequence_number": self.seq, **obj}
            self.seq += 1
        if self.api in ("responses", "messages"):
            return f"event: {obj['type']}\ndata: {json.dumps(obj)}\n\n".encode()
        return f"data: {json.dumps(obj)}\n\n".encode()

    def head(self, prompt_len: int, cached: int) -> list[bytes]:
        if self.api == "responses":   # sent at once, before any token, as pagedllm's server does
            r = {"id": self.rid, "object": "response", "status": "in_progress", "output": [], "usage": None}
            return [self._sse({"type": "response.created", "response": r}),
                    self._sse({"type": "response.in_progress", "response": r})]
        return []

    def first(self, prompt_len: int, cached: int) -> list[bytes]:
        if self.api == "messages":   # with the first token: the prompt's cache lookup is known
            msg = {"id": "msg_" + self.rid, "type": "message", "role": "assistant", "content": [],
                   "stop_reason": None, "usage": {"input_tokens": prompt_len - cached, "output_tokens": 1,
                                                  "cache_read_input_tokens": cached,
                                                  "cache_creation_input_tokens": 0}}
            return [self._sse({"type": "message_start", "message": msg}), self._sse({"type": "ping"}),
                    self._sse({"type": "content_block_start", "index": 0,
                               "content_block": {"type": "text", "text": ""}})]
        if self.api == "chat":
            return [self._sse({"id": self.rid, "object": "chat.completion.chunk", "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})]
        if self.api == "responses":
            return [self._sse({"type": "response.output_item.added", "output_index": 0, "item": {
                        "type": "message", "role": "assistant", "content": []}}),
                    self._sse({"type": "response.content_part.added", "output_index": 0, "content_index": 0,
                               "part": {"type": "output_text", "text": ""}})]
        return []

    def token(self, tok: str, last: bool) -> bytes:
        if self.api == "chat":
            ch = {"index": 0, "delta": {"content": tok}, "finish_reason": "length" if last else None}
            return self._sse({"id": self.rid, "object": "chat.completion.chunk", "choices": [ch]})
        if self.api == "responses":
            return self._sse({"type": "response.output_text.delta", "output_index": 0, "content_index": 0,
                              "delta": tok, "logprobs": []})
        if self.api == "messages":
            return self._sse({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": tok}})
        ch = {"index": 0, "text": tok, "finish_reason": "length" if last else None}
        return self._sse({"id": self.rid, "object": "text_completion", "choices": [ch]})

    def tail(self, prompt_len: int, n: int, cached: int, include_usage: bool) -> list[bytes]:
        if self.api == "responses":
            return [self._sse({"type": "response.output_text.done", "output_index": 0, "content_index": 0}),
                    self._sse({"type": "response.incomplete", "response": {
                        "id": self.rid, "status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"},
                        "usage": {"input_tokens": prompt_len, "input_tokens_details": {"cached_tokens": cached},
                                  "output_tokens": n, "total_tokens": prompt_len + n}}})]
        if self.api == "messages":
            return [self._sse({"type": "content_block_stop", "index": 0}),
                    self._sse({"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
                               "usage": {"output_tokens": n}}),
                    self._sse({"type": "message_stop"})]
        out = []
        if include_usage:
            out.append(self._sse({"id": self.rid, "choices": [], "usage": {
                "prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n,
                "prompt_tokens_details": {"cached_tokens": cached}}}))
        return out + [b"data: [DONE]\n\n"]

    def error(self, message: str, code: int = 500) -> bytes:
        """An error event with status ``code``: OpenAI's numeric ``code``; a Responses
        ``code`` and an Anthropic ``error.type`` named after it."""
        if self.api == "responses":
            name = {400: "invalid_request_error", 429: "rate_limit_exceeded", 503: "service_unavailable"}.get(
                code, "api_error" if code >= 500 else "invalid_request_error")
            return self._sse({"type": "error", "code": name, "message": message, "param": None})
        if self.api == "messages":
            name = {429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}.get(
                code, "api_error" if code >= 500 else "invalid_request_error")
            return self._sse({"type": "error", "error": {"type": name, "message": message}})
        return self._sse({"error": {"message": message, "code": code}})
