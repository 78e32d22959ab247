"""AsyncLLM: an asyncio front end over the engine, for the HTTP server.

One output thread (``pagedllm-engine``) owns the LLMEngine, fed by typed inbox messages,
and puts RequestOutputs on per-request asyncio.Queues; tokenizing runs in
``TOKENIZER_THREADS`` threads, each with its own tokenizer copy. A failed step fails only
its requests; after ``MAX_CONSECUTIVE_STEP_FAILURES`` in a row, or any error outside a
step, the engine is dead and everything raises EngineDeadError.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import EngineStepError, LLMEngine
from pagedllm.errors import EngineDeadError  # noqa: F401  (re-exported: the server imports it here)
from pagedllm.logger import configure_default_logging
from pagedllm.messages import EngineCoreRequest
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm")


# Failed steps in a row after which the engine is declared dead (e.g. a device error).
MAX_CONSECUTIVE_STEP_FAILURES = 3

# Threads that validate, template and tokenize requests (each with its own tokenizer).
TOKENIZER_THREADS = 4

# With the core in its own process: seconds the output thread waits for the core's next
# outputs before it looks at its queue of new requests and aborts again (busy), and for
# new requests before it takes the core's news (idle: aborts' freed blocks, stats).
OUTPUT_WAIT_S = 0.02
IDLE_WAIT_S = 0.05


# -- the output thread's inbox ---------------------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    """A validated, tokenized request for ``LLMEngine.add_processed``."""
    request: EngineCoreRequest
    prompt_text: str | None


@dataclass(frozen=True)
class AbortRequests:
    """Callers' request ids for ``LLMEngine.abort_request``."""
    request_ids: list[str]


@dataclass(frozen=True)
class ResetPrefixCache:
    """``LLMEngine.reset_prefix_cache``; completes ``future`` on ``loop``."""
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


@dataclass(frozen=True)
class Shutdown:
    """Stop the output thread."""


InboxMessage = AddRequest | AbortRequests | ResetPrefixCache | Shutdown


class AsyncLLM:
    """Asyncio engine over ``EngineArgs``; ``stat_loggers``: extra ones (e.g. Prometheus)."""

    def __init__(self, args: EngineArgs, stat_loggers: list | None = None, log_stats: bool = True):
        configure_default_logging()   # the start-up lines reach stderr, as vLLM's do
        self.engine = LLMEngine(args, stat_loggers=stat_loggers, log_stats=log_stats)
        self._inbox: queue.Queue[InboxMessage] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._dead: BaseException | None = None
        self._stop = False
        self._failed_steps = 0  # consecutive
        self._tokenizer_pool = ThreadPoolExecutor(max_workers=TOKENIZER_THREADS,
                                                  thread_name_prefix="pagedllm-tokenizer")
        self._local = threading.local()   # per tokenizer thread: (tokenizer, processor)
        # the copies are made here, before the output thread starts using the engine's
        # tokenizer: a deep copy taken while another thread decodes would share it
        self._spare_tokenizers = [self.engine.tokenizer_copy() for _ in range(TOKENIZER_THREADS)]
        self._multiprocess = args.engine_process
        # requests waiting for the engine: the scheduler's count in the latest stats, plus
        # those handed to the engine thread since (see num_waiting)
        self._sched_waiting = 0
        self._added_since_stats = 0
        self.engine.stat_loggers.append(self)
        self._thread = threading.Thread(target=self._loop, name="pagedllm-engine", daemon=True)
        self._thread.start()

    # -- public API ------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_path(self) -> str:
        """The model's file or directory, as given or resolved at start."""
        return self.engine.config.model_path

    @property
    def vocab_size(self) -> int:
        return self.engine.config.arch.vocab_size

    def record(self, scheduler_stats, iteration_stats) -> None:
        """Stat-logger hook (engine thread): keeps the scheduler's waiting count."""
        with self._lock:
            self._sched_waiting = scheduler_stats.num_waiting
            self._added_since_stats = 0

    def num_waiting(self) -> int:
        """Waiting requests: the scheduler's count at the latest step plus those queued since
        (errs high); ``--max-waiting-requests`` compares it."""
        with self._lock:
            return self._sched_waiting + self._added_since_stats

    def add_stat_logger(self, stat_logger) -> None:
        """Attach a logger with ``record(SchedulerStats, IterationStats)`` (e.g. Prometheus's)."""
        self.engine.stat_loggers.append(stat_logger)

    def _check_alive(self) -> None:
        if self._dead is not None:
            if isinstance(self._dead, EngineDeadError):
                raise EngineDeadError(str(self._dead))
            raise EngineDeadError(f"the engine has died ({self._dead!r}); restart the server")
        if not self._thread.is_alive():
            raise EngineDeadError("the engine loop has stopped")
        self.engine.check_health()

    async def _in_tokenizer_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenizer_pool, functools.partial(fn, *args))

    def _thread_tokenizer(self):
        """This tokenizer thread's (tokenizer, processor) copy, taken at first use."""
        tp = getattr(self._local, "tp", None)
        if tp is None:
            with self._lock:
                tp = self._local.tp = self._spare_tokenizers.pop()
        return tp

    def _process(self, rid, prompt, params):
        return self.engine.process(rid, prompt, params, processor=self._thread_tokenizer()[1])

    def _render(self, *args):
        return self.engine.apply_chat_template(*args, tokenizer=self._thread_tokenizer()[0])

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, in a tokenizer thread."""
        return await self._in_tokenizer_thread(
            lambda: self._thread_tokenizer()[0].encode(text, add_special_tokens=add_special_tokens))

    async def detokenize(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``, in a tokenizer thread."""
        return await self._in_tokenizer_thread(lambda: self._thread_tokenizer()[0].decode(token_ids))

    async def add_request(self, request_id: str, prompt, sampling_params: SamplingParams) -> "RequestStream":
        """Validate, tokenize (in a tokenizer thread) and queue a request. Returns a
        RequestStream of cumulative RequestOutputs; ``aclose`` early aborts the request.

        Raises:
            ValueError (InvalidParameterError): bad prompt or parameters; nothing is queued.
            EngineDeadError: the engine loop has died.
        """
        return (await self.add_requests([(request_id, prompt, sampling_params)]))[0]

    async def add_requests(self, requests: list[tuple[str, object, SamplingParams]]) -> list["RequestStream"]:
        """``add_request`` for several (request_id, prompt, sampling_params), all or nothing.

        Raises:
            ValueError (InvalidParameterError): a bad prompt or parameter, or a request id
                in use (twice in ``requests`` included); nothing is queued.
            EngineDeadError: the engine loop has died.
        """
        self._check_alive()
        processed = await asyncio.gather(*[self._in_tokenizer_thread(self._process, rid, prompt, params)
                                           for rid, prompt, params in requests])
        ids = [req.request_id for req, _ in processed]
        loop = asyncio.get_running_loop()
        queues = [asyncio.Queue() for _ in processed]
        with self._lock:  # _die fails every stream registered before it marks the engine dead
            self._check_alive()
            taken = [rid for i, rid in enumerate(ids) if rid in self._streams or rid in ids[:i]]
            if taken:
                raise ValueError(f"request_id {taken[0]!r} is already in use")
            for rid, q in zip(ids, queues):
                self._streams[rid] = (loop, q)
            self._added_since_stats += len(ids)
        for req, text in processed:
            self._inbox.put(AddRequest(req, text))
        return [RequestStream(self, rid, q) for rid, q in zip(ids, queues)]

    async def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                                  chat_template: str | None = None,
                                  chat_template_kwargs: dict | None = None,
                                  tools: list[dict] | None = None) -> list[int]:
        """LLMEngine.apply_chat_template in the tokenizer thread (same errors)."""
        self._check_alive()
        return await self._in_tokenizer_thread(self._render, messages,
                                               add_generation_prompt, chat_template, chat_template_kwargs,
                                               tools)

    async def generate(self, prompt, sampling_params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        """``add_request`` + iterate; leaving the loop early aborts the request."""
        stream = await self.add_request(request_id, prompt, sampling_params)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    def fail_all(self, exc: BaseException) -> int:
        """End every open request with ``exc`` and abort it (thread-safe); returns how many."""
        with self._lock:
            rids = list(self._streams)
        for rid in rids:
            self._deliver(rid, exc)
        if rids:
            self._inbox.put(AbortRequests(rids))
        return len(rids)

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe); its KV blocks are freed at the next loop turn."""
        self._inbox.put(AbortRequests([request_id]))

    async def reset_prefix_cache(self) -> int:
        """Drop every cached block no request holds; returns how many. Raises
        EngineDeadError."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:  # _die answers every waiter queued before it marks the engine dead
            self._check_alive()
            self._inbox.put(ResetPrefixCache(fut, loop))
        return await fut

    async def check_health(self) -> None:
        """Raises EngineDeadError when the engine loop has died."""
        self._check_alive()

    def engine_status(self) -> list[tuple[int, str | None]]:
        """With data parallelism, (engine index, why it died or None) per engine; else []."""
        return self.engine.engine_status()

    def stats(self):
        """Scheduler statistics now (SchedulerStats)."""
        return self.engine.get_scheduler_stats()

    def shutdown(self) -> None:
        self._stop = True
        self._inbox.put(Shutdown())
        self._thread.join(timeout=10)
        self._tokenizer_pool.shutdown(wait=False)
        self.engine.shutdown()

    # -- engine thread ---------------------------------------------------------------
    def _deliver(self, rid: str, item) -> None:
        with self._lock:
            s = self._streams.get(rid)
        if s is not None:
            loop, q = s
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:  # the loop is closed
                pass

    def _handle(self, msg: InboxMessage) -> None:
        eng = self.engine
        match msg:
            case AddRequest(request=req, prompt_text=text):
                try:
                    eng.add_processed(req, text)
                except Exception as e:  # e.g. a duplicate id: fail this request only
                    self._deliver(req.request_id, e if isinstance(e, ValueError) else ValueError(str(e)))
            case AbortRequests(request_ids=rids):
                eng.abort_request(rids)
            case ResetPrefixCache(future=fut, loop=loop):
                try:
                    n = eng.reset_prefix_cache()
                except Exception as e:  # answer the waiter, then let the loop die
                    _resolve(loop, fut, exc=e)
                    raise
                _resolve(loop, fut, result=n)
            case Shutdown():
                self._stop = True
            case _:
                raise TypeError(f"unknown inbox message {msg!r}")

    def _loop(self) -> None:
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001  (the thread must not die silently)
            logger.exception("engine loop died")
            self._die(e)

    def _die(self, exc: BaseException) -> None:
        """Mark the engine dead and fail every open stream and queued waiter."""
        with self._lock:
            self._dead = exc
            rids = list(self._streams)
        err = exc if isinstance(exc, EngineDeadError) else EngineDeadError(
            f"the engine has died ({exc!r}); restart the server")
        for rid in rids:
            self._deliver(rid, err)
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(msg, ResetPrefixCache):
                _resolve(msg.loop, msg.future, exc=err)

    def _run(self) -> None:
        eng = self.engine
        mp = self._multiprocess
        while not self._stop:
            try:
                block = not eng.has_unfinished_requests()
                if block:
                    msg = self._inbox.get(timeout=IDLE_WAIT_S if mp else 0.5)
                else:
                    msg = self._inbox.get_nowait()
                self._handle(msg)
                while True:  # drain everything that arrived
                    self._handle(self._inbox.get_nowait())
            except queue.Empty:
                pass
            if self._stop:
                continue
            busy = eng.has_unfinished_requests()
            if not busy and not mp:
                continue
            try:
                # in process: one step; else the core's next outputs (idle: what it sent)
                outputs = eng.step(OUTPUT_WAIT_S if busy else 0) if mp else eng.step()
            except EngineDeadError:
                raise
            except Exception as e:  # fail the requests of this step, keep serving others
                dead_replica = isinstance(e, EngineStepError) and e.engine_dead
                self._failed_steps += not dead_replica
                if self._failed_steps >= MAX_CONSECUTIVE_STEP_FAILURES:
                    raise
                if isinstance(e, EngineStepError):  # the core freed them already
                    for out in e.outputs:
                        self._deliver(out.request_id, out)
                    ids = e.request_ids
                    err = EngineDeadError(str(e)) if dead_replica else RuntimeError(str(e))
                else:  # outside the executor: which requests it hit is unknown, so all
                    logger.exception("engine step failed")
                    ids, err = eng.unfinished_request_ids(), RuntimeError(f"engine step failed: {e}")
                    eng.abort_request(ids)
                for rid in ids:
                    self._deliver(rid, err)
                continue
            self._failed_steps = 0
            for out in outputs:
                self._deliver(out.request_id, out)


def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, result=None,
             exc: BaseException | None = None) -> None:
    """Complete ``fut`` from another thread (no-op if it is done or its loop is closed)."""
    def done():
        if not fut.done():
            fut.set_exception(exc) if exc is not None else fut.set_result(result)
    try:
        loop.call_soon_threadsafe(done)
    except RuntimeError:  # the loop is closed
        pass


class RequestStream:
    """Async iterator over one request's RequestOutputs."""

    def __init__(self, owner: AsyncLLM, request_id: str, q: asyncio.Queue):
        self.owner, self.request_id, self.q = owner, request_id, q
        self.finished = False
        self.closed = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self.closed:
            raise StopAsyncIteration
        try:
            out = await self.q.get()
        except BaseException:
            await self.aclose()
            raise
        if isinstance(out, BaseException):
            self.finished = True
            self.owner._forget(self.request_id)
            raise out
        if out.finished:
            self.finished = True
            self.owner._forget(self.request_id)
        return out

    async def aclose(self) -> None:
        """Stop listening; aborts the request (freeing its blocks) if it is still running."""
        if self.closed:
            return
        self.closed = True
        if not self.finished:
            self.owner.abort(self.request_id)
        self.owner._forget(self.request_id)
