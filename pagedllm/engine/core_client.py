"""EngineCoreClient: the front end's only way to the engine core (vLLM V1's shape),
passing ``pagedllm/messages.py`` structs. ``MPClient`` (default) runs the core in its own
process over ZMQ; ``InprocClient`` calls it in this process (``engine_process=False``).
"""
from __future__ import annotations

import itertools
import logging
import os
import queue
import shutil
import tempfile
import threading
import weakref
from abc import ABC, abstractmethod
from concurrent.futures import Future

import msgspec

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.core import engine_proc as wire   # the process's entry point and wire format
from pagedllm.errors import EngineDeadError, InvalidParameterError
from pagedllm.messages import (EngineCoreFailure, EngineCoreInfo, EngineCoreOutputs, EngineCoreRequest,
                               SchedulerStats, UtilityCall, UtilityResult)

logger = logging.getLogger("pagedllm")


class EngineCoreClient(ABC):
    """``info``: the ``EngineCoreInfo`` the core reported once started."""

    info: EngineCoreInfo

    @staticmethod
    def make_client(config: EngineConfig) -> EngineCoreClient:
        """The client for ``config`` (out of process unless ``engine_process`` is False);
        loads the model.

        Raises:
            ValueError / InvalidParameterError: the core could not start (as raised there).
            EngineDeadError: its process died while starting.
        """
        if config.args.data_parallel_size > 1:
            return DPClient(config)
        if config.args.engine_process:
            return MPClient(config)
        return InprocClient(config)

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a validated request."""

    @abstractmethod
    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        """The next step's outputs (in process: runs a step; else waits up to ``timeout``
        s, returning empty outputs with ``scheduler_stats`` None when none came).

        Raises:
            EngineDeadError: the core has died.
        """

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> EngineCoreOutputs:
        """Abort requests before the core's next step; final outputs in process, else empty
        (the news follows in ``get_output``)."""

    @abstractmethod
    def reset_prefix_cache(self) -> int:
        """Drop every cached block no request holds; returns how many."""

    @abstractmethod
    def get_scheduler_stats(self) -> SchedulerStats:
        """The scheduler's statistics now."""

    def check_health(self) -> None:
        """Raises EngineDeadError when the core has died."""

    def engine_status(self) -> list[tuple[int, str | None]]:
        """With data parallelism, (engine index, why it died or None) per engine; else []."""
        return []

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the core and release its resources."""


class InprocClient(EngineCoreClient):
    """The core in this process (``engine_core`` is for tests and tools only)."""

    def __init__(self, config: EngineConfig):
        from pagedllm.core import EngineCore

        self.engine_core = EngineCore(config)
        self.info = self.engine_core.info

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        return self.engine_core.step()

    def abort_requests(self, request_ids: list[str]) -> EngineCoreOutputs:
        return self.engine_core.abort_requests(request_ids)

    def reset_prefix_cache(self) -> int:
        return self.engine_core.reset_prefix_cache()

    def get_scheduler_stats(self) -> SchedulerStats:
        return self.engine_core.get_scheduler_stats()

    def shutdown(self) -> None:
        self.engine_core.shutdown()


class MPClient(EngineCoreClient):
    """The core in its own process (``core.engine_proc.run_engine_core``, own process
    group), over two ZMQ IPC sockets this client binds. Within ``POLL_S`` of the process
    dying, every call raises ``EngineDeadError`` naming the exit code. ``shutdown`` (also
    at interpreter exit) stops it, terminating after ``SHUTDOWN_WAIT_S``. Failure model in
    full: docs/notes/engine.md.

    Raises (constructor): the core's start-up ValueError as its type (with ``param``);
    ``EngineDeadError`` when the process died while starting.
    """

    POLL_S = 0.1
    SHUTDOWN_WAIT_S = 5.0

    def __init__(self, config: EngineConfig, outputs: queue.Queue | None = None, engine_index: int = 0):
        import pickle
        import subprocess
        import sys

        import zmq

        self.engine_index = engine_index   # outputs go to ``outputs`` as (engine_index, outs)
        self._shared_outputs = outputs

        self._dir = tempfile.mkdtemp(prefix="pagedllm-core-")
        in_addr, out_addr = f"ipc://{self._dir}/input", f"ipc://{self._dir}/output"
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.bind(in_addr)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(out_addr)
        self._send_lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self._outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._outputs: queue.Queue = queue.Queue()
        self._calls: dict[int, tuple[Future, type]] = {}
        self._call_ids = itertools.count()
        self._dead: str | None = None
        self._closed = False
        # set when the process's exit is expected (shutdown, or the finalizer at
        # interpreter exit): the output thread then stops without reporting a death
        self._stopping = threading.Event()
        self._thread = None
        level = logging.getLogger("pagedllm").getEffectiveLevel()
        # its own session (so its own process group): see docs/notes/engine.md
        self._proc = subprocess.Popen(
            [sys.executable, "-c", f"from {wire.__name__} import main; main()"],
            stdin=subprocess.PIPE, start_new_session=True)
        self._finalizer = weakref.finalize(self, MPClient._cleanup, self._proc, self._ctx, self._dir,
                                           self._stopping)
        try:
            self._proc.stdin.write(pickle.dumps((config, in_addr, out_addr, os.getpid(), level)))
            self._proc.stdin.close()
            self.info = self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self._thread = threading.Thread(target=self._read_outputs, name="pagedllm-core-output", daemon=True)
        self._thread.start()
        logger.info("engine core running in process %d", self._proc.pid)

    def _alive(self) -> bool:
        return self._proc.poll() is None

    @property
    def pid(self) -> int:
        """The engine process's pid."""
        return self._proc.pid

    # -- start-up ----------------------------------------------------------------------
    def _wait_ready(self) -> EngineCoreInfo:

        while True:
            if self._output.poll(int(self.POLL_S * 1000)):
                kind, payload = self._output.recv_multipart()
                if kind == wire.READY:
                    return msgspec.msgpack.decode(payload, type=EngineCoreInfo)
                if kind == wire.FAILED:
                    raise _start_error(msgspec.msgpack.decode(payload, type=EngineCoreFailure))
                raise EngineDeadError(f"engine core sent {kind!r} before it was ready")
            if not self._alive():
                raise EngineDeadError(f"the engine core process exited while starting "
                                      f"(exit code {self._proc.returncode})")

    # -- output thread -------------------------------------------------------------------
    def _read_outputs(self) -> None:

        reason = None
        try:
            while not self._closed:
                if not self._output.poll(int(self.POLL_S * 1000)):
                    if self._stopping.is_set():
                        continue
                    if not self._alive():
                        reason = f"the engine core process died (exit code {self._proc.returncode})"
                        break
                    continue
                kind, payload = self._output.recv_multipart()
                if kind == wire.OUTPUTS:
                    outs = self._outputs_decoder.decode(payload)
                    if self._shared_outputs is not None:
                        self._shared_outputs.put((self.engine_index, outs))
                    else:
                        self._outputs.put(outs)
                elif kind == wire.UTILITY:
                    res = msgspec.msgpack.decode(payload, type=UtilityResult)
                    fut, rtype = self._calls.pop(res.call_id, (None, None))
                    if fut is None:
                        continue
                    if res.error is not None:
                        fut.set_exception(RuntimeError(f"engine core: {res.error}"))
                    else:
                        fut.set_result(msgspec.msgpack.decode(res.result, type=rtype))
                elif kind == wire.FAILED:
                    f = msgspec.msgpack.decode(payload, type=EngineCoreFailure)
                    reason = f"the engine core failed ({f.error_type}: {f.message})"
                    break
        except Exception as e:  # noqa: BLE001  (a broken socket or message: the core is lost)
            if not self._closed and not self._stopping.is_set():
                logger.exception("engine core output thread failed")
                reason = f"the engine core connection failed ({type(e).__name__}: {e})"
        if reason is not None and not self._closed and not self._stopping.is_set():
            self._set_dead(reason)

    def _set_dead(self, reason: str) -> None:
        logger.error("%s", reason)
        self._dead = reason
        self._outputs.put(None)   # wakes a waiting get_output
        if self._shared_outputs is not None:
            self._shared_outputs.put((self.engine_index, None))
        err = EngineDeadError(f"{reason}; restart the server")
        for fut, _ in list(self._calls.values()):
            if not fut.done():
                fut.set_exception(err)
        self._calls.clear()

    # -- calls -----------------------------------------------------------------------
    def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"{self._dead}; restart the server")
        if self._closed:
            raise EngineDeadError("the engine core has been shut down")

    def _send(self, kind: bytes, obj) -> None:
        self.check_health()
        payload = b"" if obj is None else self._encoder.encode(obj)
        with self._send_lock:
            self._input.send_multipart([kind, payload], copy=False)

    def add_request(self, request: EngineCoreRequest) -> None:

        self._send(wire.ADD, request)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        self.check_health()
        try:
            outs = self._outputs.get(timeout=timeout)
        except queue.Empty:
            return EngineCoreOutputs()
        if outs is None:
            self._outputs.put(None)   # every later waiter wakes too
            self.check_health()
        return outs

    def abort_requests(self, request_ids: list[str]) -> EngineCoreOutputs:

        if request_ids:
            self._send(wire.ABORT, list(request_ids))
        return EngineCoreOutputs()

    def _call(self, method: str, rtype: type):

        fut: Future = Future()
        call_id = next(self._call_ids)
        self._calls[call_id] = (fut, rtype)
        try:
            self._send(wire.UTILITY, UtilityCall(call_id, method))
        except BaseException:
            self._calls.pop(call_id, None)
            raise
        if self._dead is not None and not fut.done():   # died between the check and the send
            self.check_health()
        return fut.result()

    def reset_prefix_cache(self) -> int:
        return self._call("reset_prefix_cache", int)

    def get_scheduler_stats(self) -> SchedulerStats:
        return self._call("get_scheduler_stats", SchedulerStats)

    def shutdown(self) -> None:
        import zmq

        if self._closed:
            return
        self._stopping.set()   # the process's exit from here on is expected, not a death
        if self._dead is None and self._alive():
            try:
                # never block: an engine that failed while starting may have no socket
                # connected to ours (a blocking PUSH send would wait forever); it is
                # stopped by _cleanup below then
                with self._send_lock:
                    self._input.send_multipart([wire.SHUTDOWN, b""], flags=zmq.NOBLOCK)
                self._proc.wait(self.SHUTDOWN_WAIT_S)
            except Exception:  # noqa: BLE001  (a timeout: stopped by _cleanup below)
                pass
        self._closed = True
        thread = self._thread
        if thread is not None:
            thread.join(timeout=2 * self.POLL_S + 1)
        self._finalizer()

    @staticmethod
    def _cleanup(proc, ctx, path: str, stopping: threading.Event) -> None:
        """Stop the process if it still runs, close the sockets, remove their folder."""
        from pagedllm.utils import stop_process

        stopping.set()
        stop_process(proc, 2)
        ctx.destroy(linger=0)
        shutil.rmtree(path, ignore_errors=True)


class DPClient(EngineCoreClient):
    """``data_parallel_size`` engine cores, each an ``MPClient`` with its own process, model
    replica and tensor-parallel ranks (vLLM's data-parallel load-balancing client). A
    request goes to the engine with the lowest ``4 * waiting + running`` (the engines'
    last reported counts plus what was sent since), unless the engine that last took the
    same prompt prefix (its first 4 blocks) is within ``AFFINITY_ABS`` / ``AFFINITY_REL``
    of that (its cached blocks are reused).
    Outputs of every engine arrive in one queue; the stats returned are the engines' sum
    with each engine's gauges in ``SchedulerStats.engines``. An engine that dies fails its
    own requests (``EngineCoreOutputs.engine_dead``) and gets no more; the client serves
    on while one is alive and raises ``EngineDeadError`` when none is.
    """

    # the engine holding a prefix keeps it unless its load exceeds the least loaded one's by
    # more than AFFINITY_ABS units (4 per waiting request) and AFFINITY_REL of that load
    # (cache first, as SGLang's cache-aware router; balance when the loads diverge)
    AFFINITY_ABS = 64
    AFFINITY_REL = 0.5
    PREFIX_KEYS = 4096        # prefixes remembered (least recently used forgotten)

    def __init__(self, config: EngineConfig):
        import copy
        import dataclasses
        from collections import OrderedDict
        from concurrent.futures import ThreadPoolExecutor

        n = config.args.data_parallel_size
        self._outputs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()

        def start(i: int) -> MPClient:
            cfg = copy.copy(config)
            cfg.args = dataclasses.replace(config.args, data_parallel_rank=i)
            return MPClient(cfg, self._outputs, i)

        self.engines: list[MPClient] = []
        with ThreadPoolExecutor(n) as pool:   # every engine loads its model at once
            futures = [pool.submit(start, i) for i in range(n)]
            errors = []
            for f in futures:
                try:
                    self.engines.append(f.result())
                except BaseException as e:  # noqa: BLE001  (raised below, after the others stop)
                    errors.append(e)
        if errors:
            for e in self.engines:
                e.shutdown()
            raise errors[0]
        infos = [e.info for e in self.engines]
        self.info = EngineCoreInfo(min(i.max_model_len for i in infos), sum(i.num_kv_blocks for i in infos),
                                   infos[0].block_size, f"{infos[0].compute_path}, data parallel {n} engines")
        self._block_size = infos[0].block_size
        self._stats = [SchedulerStats() for _ in range(n)]
        self._sent = [0] * n                     # requests sent since the engine's last stats
        self._owner: dict[str, int] = {}
        self._prefix_owner: OrderedDict[int, int] = OrderedDict()
        self._dead: dict[int, str] = {}
        self._affinity = envs.dp_prefix_affinity()

    def _load(self, i: int) -> int:
        s = self._stats[i]
        return 4 * (s.num_waiting + self._sent[i]) + s.num_running

    def engine_for(self, prompt_token_ids: list[int]) -> int:
        """The engine the next request with this prompt goes to (the routing rule above)."""
        alive = [i for i in range(len(self.engines)) if i not in self._dead]
        if not alive:
            raise EngineDeadError("every data-parallel engine has died; restart the server")
        loads = {i: self._load(i) for i in alive}
        best = min(alive, key=loads.__getitem__)
        key = hash(tuple(prompt_token_ids[:4 * self._block_size]))
        held = self._prefix_owner.get(key) if self._affinity else None
        if held in loads and loads[held] <= loads[best] + max(self.AFFINITY_ABS, self.AFFINITY_REL * loads[best]):
            best = held
        self._prefix_owner[key] = best
        self._prefix_owner.move_to_end(key)
        while len(self._prefix_owner) > self.PREFIX_KEYS:
            self._prefix_owner.popitem(last=False)
        return best

    def add_request(self, request: EngineCoreRequest) -> None:
        while True:
            with self._lock:
                i = self.engine_for(request.prompt_token_ids)
                self._owner[request.request_id] = i
                self._sent[i] += 1
            try:
                self.engines[i].add_request(request)
                return
            except EngineDeadError as e:   # died before its output thread said so: the next one
                with self._lock:
                    self._owner.pop(request.request_id, None)
                    self._dead.setdefault(i, str(e))

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        self.check_health()
        try:
            i, outs = self._outputs.get(timeout=timeout)
        except queue.Empty:
            return EngineCoreOutputs()
        if outs is None:
            return self._engine_died(i)
        with self._lock:
            for o in outs.outputs:
                if o.finish_reason is not None:
                    self._owner.pop(o.request_id, None)
            for rid in outs.failed_request_ids:
                self._owner.pop(rid, None)
            if outs.scheduler_stats is not None:
                self._stats[i] = outs.scheduler_stats
                self._sent[i] = 0
                outs.scheduler_stats = self._sum_stats(outs.scheduler_stats)
        return outs

    def _engine_died(self, i: int) -> EngineCoreOutputs:
        """Engine ``i``'s requests, failed (their streams end with EngineDeadError)."""
        with self._lock:
            reason = self.engines[i]._dead or "it stopped"
            self._dead.setdefault(i, reason)
            lost = [rid for rid, owner in self._owner.items() if owner == i]
            for rid in lost:
                del self._owner[rid]
            # gauges to zero; cumulative counters kept (a Prometheus counter never goes down)
            self._stats[i] = msgspec.structs.replace(self._stats[i], num_running=0, num_waiting=0,
                                                     num_blocks_used=0, num_blocks_total=0, kv_cache_usage=0.0)
            self._sent[i] = 0
            stats = self._sum_stats(self._stats[i])
        logger.error("data-parallel engine %d died (%s); %d of %d engines serve on", i, reason,
                     len(self.engines) - len(self._dead), len(self.engines))
        self.check_health()
        return EngineCoreOutputs([], stats, lost, f"data-parallel engine {i} died: {reason}", engine_dead=True)

    def _sum_stats(self, last: SchedulerStats) -> SchedulerStats:
        """The engines' stats summed (``step_*`` from ``last``, the step just reported)."""
        st = self._stats
        total = SchedulerStats(
            num_running=sum(s.num_running for s in st), num_waiting=sum(s.num_waiting for s in st),
            num_blocks_used=sum(s.num_blocks_used for s in st), num_blocks_total=sum(s.num_blocks_total for s in st),
            num_preemptions_total=sum(s.num_preemptions_total for s in st),
            prefix_cache_queries=sum(s.prefix_cache_queries for s in st),
            prefix_cache_hits=sum(s.prefix_cache_hits for s in st),
            step_num_reqs=last.step_num_reqs, step_num_prefill_tokens=last.step_num_prefill_tokens,
            step_num_decode_tokens=last.step_num_decode_tokens,
            spec_decode_num_drafts=sum(s.spec_decode_num_drafts for s in st),
            spec_decode_num_draft_tokens=sum(s.spec_decode_num_draft_tokens for s in st),
            spec_decode_num_accepted_tokens=sum(s.spec_decode_num_accepted_tokens for s in st),
            engines=[(s.num_running, s.num_waiting, s.kv_cache_usage, i not in self._dead)
                     for i, s in enumerate(st)])
        total.kv_cache_usage = total.num_blocks_used / max(1, total.num_blocks_total)
        width = max(len(s.spec_decode_num_accepted_tokens_per_pos) for s in st)
        total.spec_decode_num_accepted_tokens_per_pos = [
            sum(s.spec_decode_num_accepted_tokens_per_pos[j] for s in st
                if j < len(s.spec_decode_num_accepted_tokens_per_pos)) for j in range(width)]
        return total

    def abort_requests(self, request_ids: list[str]) -> EngineCoreOutputs:
        by_engine: dict[int, list[str]] = {}
        with self._lock:
            for rid in request_ids:
                i = self._owner.get(rid)
                if i is not None:
                    by_engine.setdefault(i, []).append(rid)
        for i, ids in by_engine.items():
            if i not in self._dead:
                try:
                    self.engines[i].abort_requests(ids)
                except EngineDeadError:
                    pass   # its requests are failed when its death is read
        return EngineCoreOutputs()

    def _alive(self) -> list[int]:
        return [i for i in range(len(self.engines)) if i not in self._dead]

    def reset_prefix_cache(self) -> int:
        with self._lock:
            self._prefix_owner.clear()
        return sum(self.engines[i].reset_prefix_cache() for i in self._alive())

    def get_scheduler_stats(self) -> SchedulerStats:
        with self._lock:
            for i in self._alive():
                self._stats[i] = self.engines[i].get_scheduler_stats()
                self._sent[i] = 0
            return self._sum_stats(self._stats[0])

    def check_health(self) -> None:
        if len(self._dead) == len(self.engines):
            raise EngineDeadError(f"every data-parallel engine has died ({'; '.join(self._dead.values())}); "
                                  "restart the server")

    def engine_status(self) -> list[tuple[int, str | None]]:
        return [(i, self._dead.get(i)) for i in range(len(self.engines))]

    def shutdown(self) -> None:
        for e in self.engines:
            e.shutdown()


def _start_error(f: EngineCoreFailure) -> BaseException:
    """The front end's exception for a core start-up failure (ValueErrors keep type/param)."""
    if f.error_type == "InvalidParameterError" and f.param is not None:
        return InvalidParameterError(f.param, f.message)
    if f.error_type in ("ValueError", "InvalidParameterError"):
        return ValueError(f.message)
    return EngineDeadError(f"the engine core failed to start ({f.error_type}: {f.message})")
