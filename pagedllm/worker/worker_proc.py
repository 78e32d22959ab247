"""One tensor-parallel rank's process (vLLM V1's ``WorkerProc``): joins the
torch.distributed world, builds its ``Worker`` (the model's share of this rank), then
answers the executor's broadcast calls until SHUTDOWN or its parent's death.

Wire (ZMQ over IPC, ``executor/multiproc_executor.py`` the other end): calls arrive on a
SUB socket as ``[method, payload]`` (``execute_model``: a msgpack ``SchedulerOutput``;
others: pickled args); every rank answers each call on a PUSH socket with
``[rank, status, payload]``: rank 0 the result, the others (for ``execute_model``) a
digest of the tokens they sampled, so the executor can check the ranks agree (every
rank samples the same tokens from the same logits and seeded generators).
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import zlib

import msgspec

from pagedllm import envs

logger = logging.getLogger("pagedllm")

READY, FAILED, OK, ERROR = b"ready", b"failed", b"ok", b"error"
EXECUTE, SHUTDOWN, PING = b"execute_model", b"shutdown", b"ping"
PARENT_CHECK_S = 1.0
HEARTBEAT_S = 1.0               # node 0's ping period across nodes
HEARTBEAT_TIMEOUT_S = 15.0      # a remote rank that hears nothing for this long exits


def sampled_digest(sampled_token_ids: list[list[int]]) -> int:
    """CRC-32 of a step's sampled tokens (what non-driver ranks send instead of them)."""
    return zlib.crc32(msgspec.msgpack.encode(sampled_token_ids))


def parse_cpu_bind(spec: str, rank: int, world_size: int) -> set[int]:
    """Rank ``rank``'s cores from a ``PAGEDLLM_CPU_OMP_THREADS_BIND`` value such as
    ``0-3,8|4-7`` (one ``|``-separated list per rank).

    Raises:
        ValueError: not one list per rank, or a part that is not ``N`` or ``N-M``."""
    lists = spec.split("|")
    if len(lists) != world_size:
        raise ValueError(f"PAGEDLLM_CPU_OMP_THREADS_BIND has {len(lists)} core lists for {world_size} ranks: {spec!r}")
    cores: set[int] = set()
    for part in lists[rank].split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            cores.update(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise ValueError(f"PAGEDLLM_CPU_OMP_THREADS_BIND: {part!r} is not N or N-M") from None
    if not cores:
        raise ValueError(f"PAGEDLLM_CPU_OMP_THREADS_BIND: no cores for rank {rank}")
    return cores


def main() -> None:
    """``python -c "from pagedllm.worker.worker_proc import main; main()"``: reads the
    pickled arguments of ``run_worker`` from standard input."""
    run_worker(*pickle.load(sys.stdin.buffer))


def run_worker(config, rank: int, world_size: int, addrs: dict[str, str], parent_pid: int,
               log_level: int) -> None:
    """Body of rank ``rank``'s process (``addrs``: ``executor.multiproc_executor.rank_addresses``);
    exits 0 after SHUTDOWN, 1 after a failed start (the error sent as FAILED) or when the
    parent (or, across nodes, node 0's heartbeat) is gone."""
    import torch
    import zmq

    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the parent decides when ranks stop
    logging.basicConfig(level=log_level, format=f"%(levelname)s %(asctime)s %(name)s[rank {rank}]: %(message)s",
                        datefmt="%H:%M:%S")
    # rank 0 says what every rank would; the others report problems only
    logging.getLogger("pagedllm").setLevel(log_level if rank == 0 else max(log_level, logging.WARNING))
    ctx = zmq.Context()
    calls = ctx.socket(zmq.SUB)
    calls.setsockopt(zmq.SUBSCRIBE, b"")
    calls.connect(addrs["calls"])
    if "heartbeat" in addrs:
        calls.connect(addrs["heartbeat"])
    replies = ctx.socket(zmq.PUSH)
    replies.setsockopt(zmq.LINGER, 1000)
    replies.connect(addrs["replies"])
    me = str(rank).encode()
    status = 0
    try:
        try:
            bind = envs.cpu_omp_threads_bind()
            if bind and config.device.type == "cpu":
                os.sched_setaffinity(0, parse_cpu_bind(bind, rank, world_size))
            if config.device.type == "cuda":
                config.device = torch.device("cuda", rank % max(1, torch.cuda.device_count()))
                torch.cuda.set_device(config.device)
            from pagedllm.distributed import init_distributed_environment, initialize_model_parallel

            init_distributed_environment(world_size, rank, addrs["init"])
            initialize_model_parallel(world_size)
            from pagedllm.worker.worker import Worker

            worker = Worker(config)
        except BaseException as e:  # noqa: BLE001  (the executor raises it)
            logger.debug("rank %d failed to start", rank, exc_info=True)
            replies.send_multipart([me, FAILED, _pickle_error(e)])
            status = 1
            return
        replies.send_multipart([me, READY, b""])
        _serve(worker, rank, calls, replies, parent_pid, "heartbeat" in addrs)
    finally:
        calls.close(linger=0)
        replies.close()
        ctx.term()
        logging.shutdown()
        os._exit(status)


def _serve(worker, rank: int, calls, replies, parent_pid: int, remote: bool) -> None:
    import time

    from pagedllm.messages import SchedulerOutput

    decoder = msgspec.msgpack.Decoder(SchedulerOutput)
    encoder = msgspec.msgpack.Encoder()
    me = str(rank).encode()
    heard = time.monotonic()
    while True:
        if not calls.poll(int(PARENT_CHECK_S * 1000)):
            if os.getppid() != parent_pid:
                logger.warning("rank %d: the executor's process is gone; exiting", rank)
                return
            if remote and time.monotonic() - heard > HEARTBEAT_TIMEOUT_S:
                logger.warning("rank %d: node 0 silent for %.0f s; exiting", rank, HEARTBEAT_TIMEOUT_S)
                return
            continue
        frames = calls.recv_multipart()
        heard = time.monotonic()
        if frames[0] == PING:
            continue
        method, payload = frames
        if method == SHUTDOWN:
            return
        try:
            if method == EXECUTE:
                out = worker.execute_model(decoder.decode(payload))
                reply = encoder.encode(out) if rank == 0 else str(sampled_digest(out.sampled_token_ids)).encode()
            else:
                name = method.decode()
                if name.startswith("_") or not callable(getattr(worker, name, None)):
                    raise ValueError(f"unknown worker method {name!r}")
                reply = pickle.dumps(getattr(worker, name)(*pickle.loads(payload)))
            replies.send_multipart([me, OK, reply])
        except Exception as e:  # noqa: BLE001  (the executor decides what the error means)
            logger.exception("rank %d: %s failed", rank, method.decode())
            replies.send_multipart([me, ERROR, _pickle_error(e)])


def _pickle_error(e: BaseException) -> bytes:
    """``e`` pickled, or a RuntimeError with its text when it does not pickle."""
    try:
        return pickle.dumps(e)
    except Exception:  # noqa: BLE001
        return pickle.dumps(RuntimeError(f"{type(e).__name__}: {e}"))
