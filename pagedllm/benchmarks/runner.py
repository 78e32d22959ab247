"""The load side of ``pagedllm bench serve``: arrivals from a gamma process (rate
``request_rate`` req/s, shape ``burstiness``; 1 = Poisson) or a trace's timestamps;
``max_concurrency`` bounds in-flight sessions (a session waiting for it counts as client
wait); warm-ups run first, unpaced and unreported; a session's turns go one after another
(after an abandoned stream the session goes on with the partial reply; after a failure it
stops). Progress: :mod:`~pagedllm.benchmarks.progress`.
:func:`run_load` returns the raw :class:`LoadRun`, :func:`run_benchmark` the result dict,
:func:`run_comparison` the same workload through several endpoint types in turn.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import math
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from .client import OpenAIStreamClient
from .datasets import Dataset, MultiTurnDataset, Session, TokenSource
from .endpoints import CHAT_KINDS
from .load_model import AbortPlan
from .metrics import RequestResult
from .progress import make_progress
from .report import build_comparison, build_result
from .serve_options import BenchConfig, BenchError

__all__ = ["arrival_intervals", "iter_arrival_offsets", "sleep_until", "LoadRun", "run_load", "run_benchmark",
           "reset_prefix_cache", "run_comparison"]


def arrival_intervals(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """``n`` inter-arrival gaps (s) for mean rate ``rate`` (req/s): gamma with shape
    ``burstiness`` and scale ``1 / (rate * burstiness)`` (CV ``1/sqrt(burstiness)``); zeros
    for ``rate == inf``. Raises ``ValueError`` for non-positive rate or burstiness."""
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



class _Runner:
    """Sends sessions through ``client``: pacing, the concurrency bound and the turns of a session."""

    def __init__(self, cfg: BenchConfig, client: OpenAIStreamClient, tokens: TokenSource, kind_override: str):
        self.cfg, self.client, self.tokens, self.kind_override = cfg, client, tokens, kind_override
        self.results: list[RequestResult] = []
        self._next_id = 0
        self.progress: Any = None  # a RunProgress while the measured run is going
        self.aborts = AbortPlan(cfg.abort_fraction, cfg.abort_after, cfg.seed)

    def _kind(self, s: Session) -> str:
        return s.kind if self.kind_override == "auto" else self.kind_override

    async def run_session(self, s: Session, scheduled: float, sink: list[RequestResult]) -> None:
        kind = self._kind(s)
        messages: list[dict] = []
        est = 0
        system_tokens = s.system_tokens
        if s.system_prompt:
            messages.append({"role": "system", "content": s.system_prompt})
            est += self.tokens.count(s.system_prompt)
            system_tokens = est if system_tokens is None else system_tokens
        prev_end = None
        for k, turn in enumerate(s.turns):
            if prev_end is not None:
                scheduled = prev_end + turn.think_time_s
                await sleep_until(scheduled)
            if kind in CHAT_KINDS:
                content = turn.message
                if content is None:
                    content = turn.prompt if isinstance(turn.prompt, str) else self.tokens.decode(turn.prompt or [])
                messages.append({"role": "user", "content": content})
                payload: Any = list(messages)
                est += turn.prompt_len
                prompt_est = est
            else:
                if len(s.turns) > 1:
                    raise BenchError("multi-turn sessions need a chat-turn API (--endpoint-type chat, responses "
                                     "or messages)")
                payload = turn.prompt if turn.prompt is not None else turn.message
                if self.cfg.prompt_format == "text" and isinstance(payload, list):
                    payload = self.tokens.decode(payload)
                prompt_est = turn.prompt_len
            r = RequestResult(request_id=self._next_id, scheduled_time=scheduled, session_id=s.session_id, turn=k,
                              think_time_s=turn.think_time_s if prev_end is not None else 0.0,
                              system_tokens=system_tokens)
            self._next_id += 1
            sink.append(r)
            abort = self.aborts.abort_after(s.session_id, k, turn.output_len, turn.abort_after_tokens)
            await self.client.send(kind, payload, turn.output_len, r, prompt_est, abort)
            if self.progress is not None:
                self.progress.update(r)
            prev_end = r.end_time
            if not r.success and not r.aborted:
                break
            if kind in CHAT_KINDS:
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


def _progress(cfg: BenchConfig, dataset: Dataset, num_prompts: int | None) -> Any:
    """Progress over the measured requests (None when ``cfg.progress`` is off)."""
    total = None
    if dataset.timed:
        groups = getattr(dataset, "groups", None) or [[r] for r in getattr(dataset, "rows", [])]
        total = sum(len(g) for g in groups[:num_prompts])  # a chat trace's session has several turns
    elif num_prompts is not None and cfg.duration_s is None:
        total = num_prompts * getattr(dataset, "num_turns", 1)
    return make_progress(cfg.progress, cfg.progress_desc or "requests", total, cfg.duration_s)


@dataclass
class LoadRun:
    """What one measured run produced, before aggregation: ``results`` (sorted by id),
    ``num_warmups``, ``t0`` / ``t_end`` (``perf_counter`` s around the measured part),
    ``wall0`` (unix time at ``t0``), ``metrics_before`` / ``metrics_after`` (None when
    unavailable), ``endpoint_kind``, ``num_prompts`` (None: until ``duration_s`` or the trace
    ends), ``measured_s`` (seconds measured when not ``t_end - t0``: pooled rounds)."""

    results: list[RequestResult]
    num_warmups: int
    t0: float
    t_end: float
    wall0: float
    metrics_before: dict | None
    metrics_after: dict | None
    endpoint_kind: str
    num_prompts: int | None
    measured_s: float | None = None


async def run_load(cfg: BenchConfig, dataset: Dataset, tokens: TokenSource | None = None) -> LoadRun:
    """Send ``dataset``'s sessions in ``cfg``'s load shape and collect the results; fills
    ``cfg.model`` from ``/v1/models`` when unset. Raises ``BenchError`` for invalid options or
    an unreadable ``/v1/models``; request failures never raise."""
    cfg.validate()
    tokens = tokens or TokenSource(None)
    kind = dataset.kind if cfg.endpoint_type == "auto" else cfg.endpoint_type
    if isinstance(dataset, MultiTurnDataset) and kind not in CHAT_KINDS:
        raise BenchError("--dataset multi-turn needs --endpoint-type chat, responses or messages (or auto)")
    id_prompts = dataset.name in ("random", "shared-prefix") or (dataset.name == "trace" and dataset.kind != "chat")
    if id_prompts and not tokens.exact and (kind in CHAT_KINDS or cfg.prompt_format == "text"):
        flag = f"--endpoint-type {kind}" if kind in CHAT_KINDS else "--prompt-format text"
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
        runner.progress = _progress(cfg, dataset, num_prompts)
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
    return LoadRun(results, len(warm), t0, t_end, wall0, before, after, kind, num_prompts)


async def run_benchmark(cfg: BenchConfig, dataset: Dataset, tokens: TokenSource | None = None) -> dict:
    """Run one benchmark; returns the result dict
    (:func:`~pagedllm.benchmarks.report.build_result`). Raises as :func:`run_load`. The heap
    alive at the start is ``gc.freeze()``-d for the run (why: docs/notes/benchmarks.md)."""
    tokens = tokens or TokenSource(None)
    gc.collect()
    gc.freeze()
    try:
        run = await run_load(cfg, dataset, tokens)
    finally:
        gc.unfreeze()
    return build_result(cfg, dataset, tokens, run)


async def reset_prefix_cache(cfg: BenchConfig) -> bool:
    """``POST /reset_prefix_cache`` (pagedllm's and vLLM's route): True when the server
    answered 200, else False with a warning on stderr; never raises for the server's sake."""
    async with OpenAIStreamClient(cfg) as client:
        try:
            await client.post_json("/reset_prefix_cache")
            return True
        except Exception as e:  # noqa: BLE001 - any failure means "not reset"
            print(f"warning: cannot reset the prefix cache at {cfg.root_url}/reset_prefix_cache ({e}); later "
                  "endpoint types may find earlier ones' prompts cached", file=sys.stderr)
            return False


async def run_comparison(cfg: BenchConfig, dataset: Dataset, kinds: tuple[str, ...],
                         tokens: TokenSource | None = None) -> dict:
    """The same workload (dataset, seed, load) through each endpoint type of ``kinds``, in
    that order, against one server: before each run the prefix cache is reset
    (:func:`reset_prefix_cache`, recorded as ``prefix_cache_reset`` in its result), so each
    API starts as cold as the first. Returns :func:`~pagedllm.benchmarks.report.
    build_comparison`'s document. Raises as :func:`run_load`."""
    runs = []
    for kind in kinds:
        c = dataclasses.replace(cfg, endpoint_type=kind, extra_body=dict(cfg.extra_body),
                                progress_desc=cfg.progress_desc or f"[{kind}]")
        if not cfg.quiet:
            print(f"--- endpoint type {kind} ---", file=sys.stderr)
        reset = await reset_prefix_cache(c)
        res = await run_benchmark(c, dataset, tokens)
        res["prefix_cache_reset"] = reset
        runs.append(res)
    return build_comparison(runs)
