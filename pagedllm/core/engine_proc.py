"""The engine core in its own process (vLLM V1's ``EngineCoreProc``): a busy loop that
takes inputs, steps the core, and sends outputs over two ZMQ sockets (the front end binds,
this process connects). Every message is multipart ``[kind, payload]``: ``kind`` one byte,
``payload`` msgpack of a ``pagedllm/messages.py`` struct. In: ``ADD``, ``ABORT``,
``UTILITY``, ``SHUTDOWN``; out: ``READY``, ``OUTPUTS``, ``UTILITY``, ``FAILED`` (then exit
status 1). Wire format and failure model in full: docs/notes/core.md.
"""
from __future__ import annotations

import logging
import os
import time

import msgspec

from pagedllm.messages import EngineCoreFailure, EngineCoreRequest, UtilityCall, UtilityResult

logger = logging.getLogger("pagedllm")

# message kinds (first frame)
ADD, ABORT, UTILITY, SHUTDOWN = b"a", b"x", b"u", b"q"
READY, OUTPUTS, FAILED = b"r", b"o", b"f"

# The core's methods a UtilityCall may name.
UTILITY_METHODS = ("reset_prefix_cache", "get_scheduler_stats")

# Seconds between checks that the front end's process is still alive, while idle.
PARENT_CHECK_S = 0.5


def failure_of(exc: BaseException) -> EngineCoreFailure:
    """The ``EngineCoreFailure`` describing ``exc``."""
    return EngineCoreFailure(type(exc).__name__, str(exc), getattr(exc, "param", None))


class EngineCoreProc:
    """The loop around a started ``EngineCore`` with connected PULL / PUSH sockets; it
    ends when this process's parent is no longer ``parent_pid``."""

    def __init__(self, core, input_socket, output_socket, parent_pid: int):
        self.core = core
        self.input = input_socket
        self.output = output_socket
        self.parent_pid = parent_pid
        self.encoder = msgspec.msgpack.Encoder()
        self.req_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        self.ids_decoder = msgspec.msgpack.Decoder(list[str])
        self.util_decoder = msgspec.msgpack.Decoder(UtilityCall)
        self.running = True

    def send(self, kind: bytes, obj) -> None:
        self.output.send_multipart([kind, self.encoder.encode(obj)], copy=False)

    def _handle(self, frames: list[bytes]) -> None:
        kind, payload = frames[0], frames[1] if len(frames) > 1 else b""
        core = self.core
        if kind == ADD:
            core.add_request(self.req_decoder.decode(payload))
        elif kind == ABORT:
            outs = core.abort_requests(self.ids_decoder.decode(payload))
            self.send(OUTPUTS, outs)   # the freed blocks, seen by an idle front end too
        elif kind == UTILITY:
            call = self.util_decoder.decode(payload)
            try:
                if call.method not in UTILITY_METHODS:
                    raise ValueError(f"unknown utility method {call.method!r}")
                result = getattr(core, call.method)()
                reply = UtilityResult(call.call_id, msgspec.Raw(self.encoder.encode(result)))
            except Exception as e:  # noqa: BLE001  (the caller gets the error)
                reply = UtilityResult(call.call_id, msgspec.Raw(b"\xc0"), f"{type(e).__name__}: {e}")
            self.send(UTILITY, reply)
        elif kind == SHUTDOWN:
            self.running = False
        else:
            raise ValueError(f"unknown message kind {kind!r}")

    def _parent_alive(self) -> bool:
        return os.getppid() == self.parent_pid

    def run(self) -> None:
        """Loop until SHUTDOWN or the parent's death; raises errors from outside a step."""
        import zmq

        core = self.core
        last_check = time.monotonic()
        while self.running:
            busy = core.has_unfinished_requests()
            # idle: wait for input (up to PARENT_CHECK_S); busy: take what has arrived
            if self.input.poll(0 if busy else int(PARENT_CHECK_S * 1000)):
                while True:
                    try:
                        frames = self.input.recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(frames)
                    if not self.running:
                        return
            now = time.monotonic()
            if now - last_check >= PARENT_CHECK_S:
                last_check = now
                if not self._parent_alive():
                    logger.warning("engine core: the front end's process is gone; exiting")
                    return
                core.executor.check_health()   # a rank that died while idle: fail now, not at the next request
            if not core.has_unfinished_requests():
                continue
            outs = core.step()
            if outs.outputs or outs.failed_request_ids:
                self.send(OUTPUTS, outs)


def main() -> None:
    """Run ``run_engine_core`` with pickled arguments read from stdin (a fresh interpreter,
    not multiprocessing's spawn; why: docs/notes/core.md)."""
    import pickle
    import sys

    run_engine_core(*pickle.load(sys.stdin.buffer))


def run_engine_core(config, input_addr: str, output_addr: str, parent_pid: int, log_level: int) -> None:
    """The engine process's body: build the core from ``config``, send READY with its
    ``EngineCoreInfo``, loop. Exits 1 after sending FAILED on failure, else 0."""
    import signal

    import zmq

    # Ctrl-C reaches the whole process group: the front end decides when this process
    # stops (SHUTDOWN, or its own death), so in-flight requests can drain.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(levelname)s %(asctime)s %(name)s[core]: %(message)s",
                        datefmt="%H:%M:%S")
    logging.getLogger("pagedllm").setLevel(log_level)
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 500)   # a FAILED message gets out; a dead front end delays exit little
    out.connect(output_addr)
    encoder = msgspec.msgpack.Encoder()
    status = 0
    try:
        from pagedllm.core.engine_core import EngineCore

        try:
            core = EngineCore(config)
        except BaseException as e:  # noqa: BLE001  (the front end raises it)
            logger.debug("engine core failed to start", exc_info=True)
            out.send_multipart([FAILED, encoder.encode(failure_of(e))])
            status = 1
            return
        out.send_multipart([READY, encoder.encode(core.info)])
        try:
            EngineCoreProc(core, inp, out, parent_pid).run()
        except BaseException as e:  # noqa: BLE001
            logger.exception("engine core loop died")
            out.send_multipart([FAILED, encoder.encode(failure_of(e))])
            status = 1
        finally:
            core.shutdown()
    finally:
        inp.close(linger=0)
        out.close()
        ctx.term()
        logging.shutdown()
        os._exit(status)   # not sys.exit: a lingering worker thread must not hold the exit
