"""The HTTP side of ``pagedllm bench serve``: an async streaming client (SSE over aiohttp)
for the four APIs of :mod:`~pagedllm.benchmarks.endpoints` (completions, chat, responses,
messages); one :meth:`OpenAIStreamClient.send` fills one
:class:`~pagedllm.benchmarks.metrics.RequestResult`, its tokens from the API's usage.

Retries (up to ``max_retries``, exponential back-off; TTFT and E2E count from the first
attempt, TTFT to the last attempt's first token): HTTP 408/429/5xx, and at any point of
the stream a connection error, a timeout or an error event whose status
(:attr:`~pagedllm.benchmarks.endpoints.Event.error_code`: a numeric ``code``, or one
mapped from a named code or Anthropic's ``error.type``) is 408/429/5xx or absent; another
4xx fails at once. What a retried attempt cost lands in ``retried_*_tokens``. Other
failures fail the request; network errors never raise. ``abort_after`` tokens: the client
closes the stream there (an abandoned stream, ``aborted``;
:mod:`~pagedllm.benchmarks.load_model`), unless the answer finished first.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from .datasets import TokenSource
from .endpoints import endpoint, error_message
from .extras import import_bench_package
from .metrics import RequestResult, parse_prometheus_text
from .serve_options import BenchConfig

__all__ = ["OpenAIStreamClient"]

#: Statuses retried besides 5xx (an HTTP status, or the status of a stream's error event).
_RETRYABLE_STATUS = {408, 429}


class _Attempt:
    """State of one HTTP attempt."""

    def __init__(self) -> None:
        self.text_parts: list[str] = []
        self.first_token: float | None = None
        self.first_chunk: float | None = None
        self.last_token: float | None = None
        self.itl: list[float] = []
        self.usage: dict | None = None
        self.chunks = 0
        self.non_stream = False  # the server answered with one JSON body
        self.finished = False  # the answer is complete (Event.finished)
        self.error_code: int | None = None  # status of a stream error event; -1: it named none


class OpenAIStreamClient:
    """Sends streaming requests of any endpoint type and times them
    (``async with OpenAIStreamClient(cfg) as c: await c.send(...)``)."""

    def __init__(self, cfg: BenchConfig, tokens: TokenSource | None = None):
        self.cfg = cfg
        self.tokens = tokens
        self.http = None

    async def __aenter__(self) -> "OpenAIStreamClient":
        aiohttp = import_bench_package("aiohttp", "the benchmark client")

        self.http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
            timeout=aiohttp.ClientTimeout(total=None),
        )
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self.http is not None:
            await self.http.close()

    async def get_json(self, path: str, timeout_s: float = 10.0) -> Any:
        """GET ``root_url + path`` as JSON; raises on HTTP or network errors."""
        aiohttp = import_bench_package("aiohttp", "the benchmark client")

        async with self.http.get(self.cfg.root_url + path,
                                 timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            r.raise_for_status()
            return await r.json(content_type=None)

    async def scrape_metrics(self) -> dict | None:
        """Parsed Prometheus snapshot from ``/metrics`` (or ``metrics_url``); ``None`` if unavailable."""
        aiohttp = import_bench_package("aiohttp", "the benchmark client")

        if not self.cfg.scrape_metrics:
            return None
        url = self.cfg.metrics_url or (self.cfg.root_url + "/metrics")
        try:
            async with self.http.get(url, timeout=aiohttp.ClientTimeout(total=10)) as r:
                if r.status != 200:
                    return None
                text = await r.text()
            return parse_prometheus_text(text)
        except Exception:  # noqa: BLE001 - any failure means "n/a"
            return None

    def url_for(self, kind: str) -> str:
        """Full URL for a request of ``kind`` (an endpoint type), or ``--endpoint``'s."""
        if self.cfg.endpoint:
            ep = self.cfg.endpoint
            return ep if ep.startswith("http") else self.cfg.root_url + "/" + ep.lstrip("/")
        return self.cfg.root_url + endpoint(kind).path

    def body(self, kind: str, payload: Any, max_tokens: int) -> dict:
        """Request JSON of ``kind``: ``payload`` is the prompt (completions) or the chat
        message list (chat, responses, messages), ``--extra-body`` merged last. Raises
        ``ValueError`` for messages the API cannot carry."""
        b = endpoint(kind).body(self.cfg, payload, max_tokens)
        b.update(self.cfg.extra_body)
        return b

    async def post_json(self, path: str, timeout_s: float = 30.0) -> Any:
        """POST an empty body to ``root_url + path``; the JSON answer. Raises on HTTP or
        network errors."""
        aiohttp = import_bench_package("aiohttp", "the benchmark client")

        async with self.http.post(self.cfg.root_url + path,
                                  timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            r.raise_for_status()
            return await r.json(content_type=None)

    async def _attempt(self, kind: str, url: str, body: dict, t_start: float, st: _Attempt,
                       abort_after: int | None = None) -> tuple[str, str | None, int | None]:
        """One HTTP attempt; returns (outcome, error, status) with outcome in
        ok/retry/fail/aborted ("aborted": closed after ``abort_after`` text chunks)."""
        aiohttp = import_bench_package("aiohttp", "the benchmark client")

        status = None
        try:
            async with self.http.post(url, json=body,
                                      timeout=aiohttp.ClientTimeout(total=self.cfg.timeout_s)) as resp:
                status = resp.status
                if resp.status != 200:
                    detail = error_message(await resp.text())
                    retry = resp.status in _RETRYABLE_STATUS or resp.status >= 500
                    return ("retry" if retry else "fail"), f"HTTP {resp.status}: {detail}", status
                ctype = resp.headers.get("Content-Type", "")
                if ctype.startswith("application/json"):
                    # The server ignored stream=true: one JSON answer; TTFT = E2E.
                    obj = await resp.json(content_type=None)
                    if not isinstance(obj, dict):
                        return "fail", f"unexpected answer: {str(obj)[:200]}", status
                    if obj.get("error") or obj.get("type") == "error":
                        return "fail", f"server error: {error_message(json.dumps(obj))}", status
                    now = time.perf_counter()
                    st.first_chunk = st.first_token = st.last_token = now
                    st.non_stream = True
                    text, st.usage = endpoint(kind).whole(obj)
                    if text:
                        st.text_parts.append(text)
                        st.chunks += 1
                    return "ok", None, status
                buf = b""
                done = False
                async for data in resp.content.iter_any():
                    buf += data
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        err = self._handle_line(kind, line, t_start, st)
                        if err == "[DONE]":
                            done = True
                            break
                        if err:
                            return self._error_outcome(st), err, status
                        if abort_after is not None and st.chunks >= abort_after and not st.finished:
                            resp.close()  # the user stops reading: drop the connection
                            return "aborted", None, status
                    if done:
                        break
                if not done and buf.strip():
                    err = self._handle_line(kind, buf, t_start, st)
                    if err and err != "[DONE]":
                        return self._error_outcome(st), err, status
                if st.chunks == 0 and st.usage is None and st.first_chunk is None:
                    return ("retry" if st.first_token is None else "fail"), "empty response stream", status
                return "ok", None, status
        except asyncio.TimeoutError:
            err = f"timeout after {self.cfg.timeout_s:g} s"
        except aiohttp.ClientError as e:
            err = f"{type(e).__name__}: {e}"
        except OSError as e:
            err = f"{type(e).__name__}: {e}"
        return "retry", err, status

    @staticmethod
    def _error_outcome(st: _Attempt) -> str:
        """retry for a stream error event with status 408/429/5xx or none (-1); else fail
        (another 4xx; a bad chunk records no status and fails)."""
        c = st.error_code
        if c is None:
            return "fail"
        return "retry" if (c in _RETRYABLE_STATUS or c >= 500 or c == -1) else "fail"

    def _handle_line(self, kind: str, raw: bytes, t_start: float, st: _Attempt) -> str | None:
        """Read one SSE line into ``st``: None, an error message, or "[DONE]" (the stream's
        end: ``data: [DONE]`` or the API's last event). ``event:`` lines are skipped: every
        API's data object names its own type."""
        line = raw.decode("utf-8", errors="replace").strip()
        if not line or line.startswith(":") or not line.startswith("data:"):
            return None
        data = line[5:].strip()
        if data == "[DONE]":
            return "[DONE]"
        try:
            obj = json.loads(data)
        except json.JSONDecodeError:
            return f"bad SSE chunk: {data[:100]!r}"
        if not isinstance(obj, dict):
            return None
        ev = endpoint(kind).event(obj)
        if ev.error is not None:
            st.error_code = ev.error_code if ev.error_code is not None else -1
            return "server error: " + ev.error[:200]
        now = time.perf_counter()
        if ev.started and st.first_chunk is None:
            st.first_chunk = now
        if ev.text:
            if st.first_token is None:
                st.first_token = now
            else:
                st.itl.append(now - st.last_token)
            st.last_token = now
            st.chunks += 1
            st.text_parts.append(ev.text)
        if ev.usage:
            st.usage = {**(st.usage or {}), **ev.usage}
        if ev.finished:
            st.finished = True
        return "[DONE]" if ev.done else None

    async def send(self, kind: str, payload: Any, max_tokens: int, result: RequestResult,
                   prompt_len_estimate: int, abort_after: int | None = None) -> RequestResult:
        """Send one request with retries, filling ``result`` (times, tokens, error; the
        load-model fields of :class:`RequestResult`); ``abort_after``: close the stream after
        that many text chunks (None: read to the end)."""
        url = self.url_for(kind)
        body = self.body(kind, payload, max_tokens)
        result.start_time = t_start = time.perf_counter()
        result.abort_after_tokens = abort_after
        attempt = 0
        while True:
            st = _Attempt()
            try:
                outcome, err, status = await self._attempt(kind, url, body, t_start, st, abort_after)
            except Exception as e:  # noqa: BLE001 - a request failure must never end the run
                outcome, err, status = "fail", f"unexpected {type(e).__name__}: {e}", None
            result.http_status = status
            if outcome == "ok":
                break
            if outcome == "aborted":
                end = time.perf_counter()
                result.aborted = True
                result.end_time, result.e2e = end, end - t_start
                result.first_token_time, result.ttft = st.first_token, st.first_token - t_start
                result.itl = st.itl
                result.generated_text = "".join(st.text_parts)
                result.output_tokens = result.aborted_output_tokens = st.chunks
                result.output_tokens_source = "chunks"
                usage = endpoint(kind).usage(st.usage)  # Messages reports the prompt's in message_start
                result.cached_tokens = usage.cached_tokens
                result.prompt_tokens = usage.prompt_tokens if usage.prompt_tokens is not None else prompt_len_estimate
                return result
            if outcome == "fail" or attempt >= self.cfg.max_retries:
                result.success = False
                result.error = err
                result.end_time = time.perf_counter()
                result.prompt_tokens = prompt_len_estimate
                if st.chunks:
                    result.output_tokens, result.output_tokens_source = st.chunks, "chunks"
                return result
            if status == 200:  # the server took the prompt; what it streamed is wasted
                result.retried_prompt_tokens += prompt_len_estimate
                result.retried_output_tokens += st.chunks
            attempt += 1
            result.retries += 1
            await asyncio.sleep(min(self.cfg.retry_backoff_s * (2 ** (attempt - 1)), 5.0))
        end = st.first_token if st.non_stream else time.perf_counter()
        result.success = True
        result.end_time = end
        result.e2e = end - t_start
        first = st.first_token if st.first_token is not None else (st.first_chunk or end)
        result.first_token_time = first
        result.ttft = first - t_start
        result.itl = st.itl
        result.generated_text = "".join(st.text_parts)
        usage = endpoint(kind).usage(st.usage)
        result.cached_tokens = usage.cached_tokens
        if usage.output_tokens is not None:
            result.output_tokens, result.output_tokens_source = usage.output_tokens, "usage"
        elif self.tokens is not None and self.tokens.exact:
            result.output_tokens = self.tokens.count(result.generated_text)
            result.output_tokens_source = "tokenizer"
        else:
            result.output_tokens, result.output_tokens_source = st.chunks, "chunks"
        result.prompt_tokens = usage.prompt_tokens if usage.prompt_tokens is not None else prompt_len_estimate
        return result
