"""The multi-process executor (vLLM V1's ``MultiprocExecutor``): one worker process per
tensor-parallel rank in a torch.distributed world. Each step's ``SchedulerOutput`` is
published once to every rank (ZMQ PUB, msgpack; IPC on one node, TCP from node 0 across
``--nnodes``, whose other nodes run ``run_headless``); every rank samples the same tokens,
rank 0 returns its ``ModelRunnerOutput`` and the others a digest that must match.

Failure model: a rank's process that exits, an error on some ranks only, or ranks that
disagree raise ``ExecutorDeadError`` within ``POLL_S`` (the ranks are killed); an error on
every rank fails the step only. Details: docs/scaling.md.
"""
from __future__ import annotations

import logging
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import weakref

import msgspec

from pagedllm.config import EngineConfig
from pagedllm.errors import ExecutorDeadError
from pagedllm.executor.ranked import RankedExecutor
from pagedllm.messages import ModelRunnerOutput, SchedulerOutput
from pagedllm.worker import worker_proc as wire

logger = logging.getLogger("pagedllm")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (for the torch.distributed rendezvous)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class MultiprocExecutor(RankedExecutor):
    """Args:
        config: the resolved engine config; ``config.args.tensor_parallel_size`` ranks.

    Raises:
        the error a rank raised while starting (e.g. ``InvalidParameterError`` naming
        ``tensor_parallel_size`` when the model's heads do not split), or
        ``ExecutorDeadError`` when a rank's process exits first.
    """

    POLL_S = 0.1          # how often a wait checks that every rank's process is alive
    START_TIMEOUT_S = 900.0
    backend = "mp"

    def __init__(self, config: EngineConfig):
        import zmq

        args = config.args
        if args.node_rank != 0:
            raise ValueError(f"node_rank {args.node_rank} runs no engine: start it with `pagedllm serve --headless`")
        self.world_size = args.tensor_parallel_size
        self._dir = tempfile.mkdtemp(prefix="pagedllm-workers-")
        addrs = rank_addresses(args, self._dir)
        self._ctx = zmq.Context()
        self._calls = self._ctx.socket(zmq.PUB)
        self._calls.setsockopt(zmq.LINGER, 0)
        self._calls.bind(addrs["calls"])
        self._replies = self._ctx.socket(zmq.PULL)
        self._replies.setsockopt(zmq.LINGER, 0)
        self._replies.bind(addrs["replies"])
        self._encoder = msgspec.msgpack.Encoder()
        self._output_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)
        self._config = config
        self._parent = os.getppid()   # an engine whose parent exits while it starts stops too
        self._heartbeat = None
        if "heartbeat" in addrs:
            self._heartbeat = _Heartbeat(self._ctx, addrs["heartbeat"])
        self._procs: list[subprocess.Popen] = []
        # an executor dropped without shutdown() (or alive at interpreter exit) kills its ranks
        self._finalizer = weakref.finalize(self, _kill_all, self._procs, self._dir)
        try:
            spawn_ranks(config, addrs, self._procs)
            if args.nnodes > 1:
                logger.info("waiting for the ranks of %d other node(s) (`pagedllm serve --headless --node-rank N` "
                            "with the same flags) at %s", args.nnodes - 1, addrs["init"])
            self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        logger.info("tensor parallel: %d ranks, %d here (pids %s), torch.distributed %s", self.world_size,
                    len(self._procs), " ".join(str(p.pid) for p in self._procs), addrs["init"])

    # -- waiting for ranks ---------------------------------------------------------------
    def _check_alive(self) -> None:
        for rank, p in enumerate(self._procs):
            if p.poll() is not None:
                self._fail(f"tensor-parallel rank {rank}'s process exited (code {p.returncode})")

    def _recv(self, deadline: float | None = None) -> tuple[int, bytes, bytes] | None:
        """One rank's reply; None at ``deadline``; checks liveness every ``POLL_S``."""
        while True:
            if self._replies.poll(int(self.POLL_S * 1000)):
                rank, status, payload = self._replies.recv_multipart()
                return int(rank), status, payload
            self._check_alive()
            if deadline is not None and time.monotonic() > deadline:
                return None

    def _wait_ready(self) -> None:
        """Every rank's READY; raises a rank's start-up error, ``ValueError`` when a rank runs
        with other settings (another node started with other flags), ``ExecutorDeadError``
        when a local rank exits, this process's parent does, or START_TIMEOUT_S passes."""
        ready: set[int] = set()
        deadline = time.monotonic() + self.START_TIMEOUT_S
        mine = wire.config_fingerprint(self._config)
        while len(ready) < self.world_size:
            got = self._recv(min(deadline, time.monotonic() + 1.0))
            if os.getppid() != self._parent:
                raise ExecutorDeadError("the engine's parent process exited while the ranks were starting")
            if got is None:
                if time.monotonic() < deadline:
                    continue
                raise ExecutorDeadError(f"tensor-parallel ranks {sorted(set(range(self.world_size)) - ready)} "
                                        f"did not start within {self.START_TIMEOUT_S:.0f} s")
            rank, status, payload = got
            if status == wire.FAILED:
                raise pickle.loads(payload)
            theirs = pickle.loads(payload)
            differ = {k: (mine[k], theirs.get(k)) for k in mine if theirs.get(k) != mine[k]}
            if differ:
                raise ValueError(f"tensor-parallel rank {rank} runs with other settings than node 0 ("
                                 + ", ".join(f"{k}: {a!r} here, {b!r} there" for k, (a, b) in differ.items())
                                 + "): start every node with the same engine flags")
            ready.add(rank)

    def check_health(self) -> None:
        """Raises ExecutorDeadError when a local rank's process has exited (called while idle)."""
        self._check_dead()
        self._check_alive()

    def _gather(self) -> list[bytes]:
        """Every rank's OK payload for the call just sent, in rank order (``_verdict`` on
        the errors; a rank that has not answered ``MISMATCH_WAIT_S`` after another's error
        counts as missing)."""
        payloads: dict[int, bytes] = {}
        errors: dict[int, BaseException] = {}
        deadline = None
        while len(payloads) + len(errors) < self.world_size:
            got = self._recv(deadline)
            if got is None:
                break
            rank, status, payload = got
            if status == wire.OK:
                payloads[rank] = payload
            else:
                errors[rank] = pickle.loads(payload)
                deadline = deadline or time.monotonic() + self.MISMATCH_WAIT_S
        self._verdict(errors, sorted(set(range(self.world_size)) - set(payloads) - set(errors)))
        return [payloads[r] for r in range(self.world_size)]

    def _call_ranks(self, method: str, *args) -> list:
        self._calls.send_multipart([method.encode(), pickle.dumps(args)])
        return [pickle.loads(p) for p in self._gather()]

    def _step_ranks(self, scheduler_output: SchedulerOutput) -> tuple[ModelRunnerOutput, list[int]]:
        self._calls.send_multipart([wire.EXECUTE, self._encoder.encode(scheduler_output)])
        payloads = self._gather()
        return self._output_decoder.decode(payloads[0]), [int(p) for p in payloads[1:]]

    def _kill_ranks(self) -> None:
        _kill_all(self._procs, None)

    def shutdown(self) -> None:
        """Ask every rank to stop, wait up to 5 s, kill what is left; idempotent."""
        if getattr(self, "_ctx", None) is None:
            return
        try:
            if self._procs and not self._dead:
                self._calls.send_multipart([wire.SHUTDOWN, b""])
                deadline = time.monotonic() + 5
                for p in self._procs:
                    try:
                        p.wait(max(0.0, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        pass
        finally:
            self._kill_ranks()
            if self._heartbeat is not None:
                self._heartbeat.stop()
            self._calls.close()
            self._replies.close()
            self._ctx.term()
            self._ctx = None
            self._finalizer()


def _kill_all(procs: list[subprocess.Popen], directory: str | None) -> None:
    """Kill and reap every rank's process still running; remove the IPC ``directory``."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            pass
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


def rank_addresses(args, directory: str) -> dict[str, str]:
    """Where the ranks meet: ``init`` (torch.distributed), ``calls`` and ``replies`` (the
    executor's sockets), and across nodes ``heartbeat``: IPC files in ``directory`` and a
    free loopback port on one node; node 0's ``master_addr`` and ``master_port`` + 0..3
    across nodes."""
    if args.nnodes == 1:
        return {"init": f"tcp://127.0.0.1:{free_port()}", "calls": f"ipc://{directory}/calls",
                "replies": f"ipc://{directory}/replies"}
    host, port = args.master_addr, args.master_port
    return {"init": f"tcp://{host}:{port}", "calls": f"tcp://{host}:{port + 1}",
            "replies": f"tcp://{host}:{port + 2}", "heartbeat": f"tcp://{host}:{port + 3}"}


def spawn_ranks(config: EngineConfig, addrs: dict[str, str], procs: list[subprocess.Popen]) -> None:
    """Start this node's share of the ranks (node ``node_rank`` of ``nnodes`` runs ranks
    ``node_rank * tp / nnodes`` on), appending each process to ``procs`` as it starts."""
    args = config.args
    per_node = args.tensor_parallel_size // args.nnodes
    level = logging.getLogger("pagedllm").getEffectiveLevel()
    for rank in range(args.node_rank * per_node, (args.node_rank + 1) * per_node):
        proc = subprocess.Popen([sys.executable, "-c", f"from {wire.__name__} import main; main()"],
                                stdin=subprocess.PIPE)
        procs.append(proc)
        proc.stdin.write(pickle.dumps((config, rank, args.tensor_parallel_size, addrs, os.getpid(), level)))
        proc.stdin.close()


def run_headless(config: EngineConfig) -> int:
    """``pagedllm serve --headless`` on node ``node_rank`` > 0: run this node's ranks until
    they exit (node 0's SHUTDOWN, its loss, or a rank's failure, which ends the others);
    SIGINT/SIGTERM kill them. Returns the highest exit code."""
    import signal

    args = config.args
    if args.nnodes < 2 or args.node_rank == 0:
        raise ValueError("--headless runs the ranks of a node other than 0: give --nnodes > 1 and --node-rank > 0")

    procs: list[subprocess.Popen] = []
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(1))
    try:
        spawn_ranks(config, rank_addresses(args, ""), procs)
        logger.info("headless node %d of %d: ranks in processes %s, waiting for node 0 at %s", args.node_rank,
                    args.nnodes, " ".join(str(p.pid) for p in procs), args.master_addr)
        while not stop and any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                break   # a failed rank: the node's share is lost
            time.sleep(0.2)
    finally:
        _kill_all(procs, None)
    code = max((abs(p.returncode or 0) for p in procs), default=0)
    logger.info("headless node %d: ranks exited (%s); exiting", args.node_rank,
                "node 0 shut down" if code == 0 else f"exit codes {[p.returncode for p in procs]}")
    return code


class _Heartbeat:
    """A thread publishing a ping every ``wire.HEARTBEAT_S`` on its own socket (remote ranks
    exit when node 0 goes silent)."""

    def __init__(self, ctx, addr: str):
        import threading

        import zmq

        self._sock = ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(addr)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagedllm-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(wire.HEARTBEAT_S):
            self._sock.send(wire.PING)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * wire.HEARTBEAT_S)
        self._sock.close()
