"""The HTTP side of ``pagedllm bench serve``: an async streaming client (SSE over aiohttp)
for an OpenAI-compatible server; one :meth:`OpenAIStreamClient.send` fills one
:class:`~pagedllm.benchmarks.metrics.RequestResult`.

Retries (up to ``max_retries``, exponential back-off; TTFT and E2E count from the first
attempt, TTFT to the last attempt's first token): HTTP 408/429/5xx, and at any point of
the stream a connection error, a timeout or an error event (unless its ``code`` is another
4xx); what a retried attempt cost lands in ``retried_*_tokens``. Other failures fail the
request; network errors never raise. ``abort_after`` tokens: the client closes the stream
there (an abandoned stream, ``aborted``; :mod:`~pagedllm.benchmarks.load_model`).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from .datasets import TokenSource
from .extras import import_bench_package
from .metrics import RequestResult, parse_prometheus_text
from .serve_options import BenchConfig

__all__ = ["OpenAIStreamClient"]

#: Statuses retried (besides 5xx) when no token has arrived yet.
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
        self.finished = False  # a choice carried a finish_reason
        self.error_code: int | None = None  # ``code`` of an SSE error event


def _chunk_text(obj: dict) -> str:
    parts = []
    for c in obj.get("choices") or []:
        if not isinstance(c, dict):
            continue
        t = c.get("text")
        if t is None:
            delta = c.get("delta") or {}
            t = (delta.get("content") or "") + (delta.get("reasoning_content") or delta.get("reasoning") or "")
        if t:
            parts.append(t)
    return "".join(parts)


class OpenAIStreamClient:
    """Sends streaming completions/chat requests and times them
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
        """Full URL for a request of ``kind`` ("completions" or "chat")."""
        if self.cfg.endpoint:
            ep = self.cfg.endpoint
            return ep if ep.startswith("http") else self.cfg.root_url + "/" + ep.lstrip("/")
        return self.cfg.root_url + ("/v1/chat/completions" if kind == "chat" else "/v1/completions")

    def body(self, kind: str, payload: Any, max_tokens: int) -> dict:
        """Request JSON: ``payload`` is the prompt (completions) or message list (chat)."""
        b: dict = {"model": self.cfg.model, "max_tokens": int(max_tokens), "stream": True,
                   "temperature": self.cfg.temperature}
        if kind == "chat":
            b["messages"] = payload
        else:
            b["prompt"] = payload
        if self.cfg.stream_usage:
            b["stream_options"] = {"include_usage": True}
        if self.cfg.ignore_eos:
            b["ignore_eos"] = True
        b.update(self.cfg.extra_body)
        return b

    async def _attempt(self, url: str, body: dict, t_start: float, st: _Attempt,
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
                    detail = (await resp.text())[:200].strip()
                    retry = resp.status in _RETRYABLE_STATUS or resp.status >= 500
                    return ("retry" if retry else "fail"), f"HTTP {resp.status}: {detail}", status
                ctype = resp.headers.get("Content-Type", "")
                if ctype.startswith("application/json"):
                    # The server ignored stream=true: one JSON answer; TTFT = E2E.
                    obj = await resp.json(content_type=None)
                    if isinstance(obj, dict) and obj.get("error"):
                        return "fail", f"server error: {str(obj['error'])[:200]}", status
                    now = time.perf_counter()
                    st.first_chunk = st.first_token = st.last_token = now
                    st.non_stream = True
                    for c in (obj.get("choices") or []) if isinstance(obj, dict) else []:
                        t = c.get("text") or (c.get("message") or {}).get("content") or ""
                        if t:
                            st.text_parts.append(t)
                            st.chunks += 1
                    st.usage = obj.get("usage") if isinstance(obj, dict) else None
                    return "ok", None, status
                buf = b""
                done = False
                async for data in resp.content.iter_any():
                    buf += data
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        err = self._handle_line(line, t_start, st)
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
                    err = self._handle_line(buf, t_start, st)
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
        """retry for an SSE error event without a code or with 408/429/5xx; else fail
        (a bad chunk has no code recorded and fails)."""
        c = st.error_code
        if c is None:
            return "fail"
        return "retry" if (c in _RETRYABLE_STATUS or c >= 500 or c == -1) else "fail"

    def _handle_line(self, raw: bytes, t_start: float, st: _Attempt) -> str | None:
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
        if obj.get("error"):
            e = obj["error"]
            code = e.get("code") if isinstance(e, dict) else None
            try:
                st.error_code = int(code) if code is not None else -1
            except (TypeError, ValueError):
                st.error_code = -1  # a named code ("server_error"): the server's fault
            return "server error: " + (e.get("message", str(e)) if isinstance(e, dict) else str(e))[:200]
        now = time.perf_counter()
        if obj.get("choices") and st.first_chunk is None:
            st.first_chunk = now
        if any(isinstance(c, dict) and c.get("finish_reason") for c in obj.get("choices") or []):
            st.finished = True
        text = _chunk_text(obj)
        if text:
            if st.first_token is None:
                st.first_token = now
            else:
                st.itl.append(now - st.last_token)
            st.last_token = now
            st.chunks += 1
            st.text_parts.append(text)
        if obj.get("usage"):
            st.usage = obj["usage"]
        return None

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
                outcome, err, status = await self._attempt(url, body, t_start, st, abort_after)
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
                result.prompt_tokens = prompt_len_estimate
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
        usage = st.usage or {}
        if isinstance(usage.get("completion_tokens"), int):
            result.output_tokens, result.output_tokens_source = usage["completion_tokens"], "usage"
        elif self.tokens is not None and self.tokens.exact:
            result.output_tokens = self.tokens.count(result.generated_text)
            result.output_tokens_source = "tokenizer"
        else:
            result.output_tokens, result.output_tokens_source = st.chunks, "chunks"
        if isinstance(usage.get("prompt_tokens"), int):
            result.prompt_tokens = usage["prompt_tokens"]
        else:
            result.prompt_tokens = prompt_len_estimate
        return result
