"""AsyncLLM: an asyncio front end over the engine, for the HTTP server.

The engine steps in one background thread (torch releases the GIL during kernels, so the
event loop keeps serving connections while the model runs). Coroutines validate and
tokenize in the caller's thread, hand the Request to the engine thread through a queue,
and receive RequestOutputs on a per-request asyncio.Queue. Aborts (client disconnects)
go through the same queue and free the request's blocks at the next loop turn.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator

from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm")


class EngineDeadError(RuntimeError):
    pass


class AsyncLLM:
    """Args:
        args: EngineArgs; stat_loggers: extra stat loggers (e.g. Prometheus).
    """

    def __init__(self, args: EngineArgs, stat_loggers: list | None = None, log_stats: bool = True):
        self.engine = LLMEngine(args, stat_loggers=stat_loggers, log_stats=log_stats)
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._counter = 0
        self._dead: BaseException | None = None
        self._stop = False
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

    def new_request_id(self, prefix: str = "req") -> str:
        with self._lock:
            self._counter += 1
            return f"{prefix}-{self._counter}"

    def add_request(self, request_id: str, prompt, sampling_params: SamplingParams) -> "RequestStream":
        """Validate, tokenize and queue a request; call from a running event loop.

        Returns:
            A RequestStream yielding RequestOutputs (cumulative, with deltas) until the
            request finishes; closing it early (``aclose``) aborts the request.

        Raises:
            ValueError (InvalidParameterError): bad prompt or parameters; nothing is queued.
            EngineDeadError: the engine loop has died.
        """
        if self._dead is not None or not self._thread.is_alive():
            raise EngineDeadError(f"engine loop died: {self._dead!r}")
        req, text = self.engine.process(request_id, prompt, sampling_params)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._streams[request_id] = (loop, q)
        self._inbox.put(("add", req, text))
        return RequestStream(self, request_id, q)

    async def generate(self, prompt, sampling_params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        """``add_request`` + iterate; leaving the loop early aborts the request."""
        stream = self.add_request(request_id, prompt, sampling_params)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe); its KV blocks are freed at the next loop turn."""
        self._inbox.put(("abort", request_id))

    async def reset_prefix_cache(self) -> int:
        fut = asyncio.get_running_loop().create_future()
        self._inbox.put(("reset", fut, asyncio.get_running_loop()))
        return await fut

    async def check_health(self) -> None:
        """Raises EngineDeadError when the engine loop has died."""
        if self._dead is not None or not self._thread.is_alive():
            raise EngineDeadError(f"engine loop died: {self._dead!r}")

    def stats(self):
        return self.engine.core.stats()

    def shutdown(self) -> None:
        self._stop = True
        self._inbox.put(("stop",))
        self._thread.join(timeout=10)
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

    def _handle(self, msg) -> None:
        kind = msg[0]
        eng = self.engine
        if kind == "add":
            _, req, text = msg
            try:
                eng.add_processed(req, text)
            except Exception as e:  # e.g. a duplicate id: fail this request only
                self._deliver(req.request_id, e if isinstance(e, ValueError) else ValueError(str(e)))
        elif kind == "abort":
            eng.abort_request(msg[1])
        elif kind == "reset":
            _, fut, loop = msg
            n = eng.reset_prefix_cache()
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(n))
        elif kind == "stop":
            self._stop = True

    def _loop(self) -> None:
        eng = self.engine
        while not self._stop:
            try:
                block = not eng.has_unfinished_requests()
                msg = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
                self._handle(msg)
                while True:  # drain everything that arrived
                    self._handle(self._inbox.get_nowait())
            except queue.Empty:
                pass
            if self._stop or not eng.has_unfinished_requests():
                continue
            try:
                outputs = eng.step()
            except Exception as e:  # fail the requests of this step, keep serving others
                logger.exception("engine step failed")
                so = getattr(eng.core, "last_step", None)
                ids = [r.req_id for r in so.scheduled] if so is not None else list(eng.states)
                for rid in ids:
                    eng.abort_request(rid)
                    self._deliver(rid, RuntimeError(f"engine step failed: {e}"))
                continue
            for out in outputs:
                self._deliver(out.request_id, out)


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
