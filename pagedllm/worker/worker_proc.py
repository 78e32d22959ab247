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
from pagedllm.distributed.utils import parse_cpu_bind

logger = logging.getLogger("pagedllm")

READY, FAILED, OK, ERROR = b"ready", b"failed", b"ok", b"error"
EXECUTE, SHUTDOWN, PING = b"execute_model", b"shutdown", b"ping"
PARENT_CHECK_S = 1.0
HEARTBEAT_S = 1.0               # node 0's ping period across nodes
HEARTBEAT_TIMEOUT_S = 15.0      # a remote rank that hears nothing for this long exits


def sampled_digest(sampled_token_ids: list[list[int]]) -> int:
    """CRC-32 of a step's sampled tokens (what non-driver ranks send instead of them)."""
    return zlib.crc32(msgspec.msgpack.encode(sampled_token_ids))


def config_fingerprint(config) -> dict:
    """The settings every rank of one engine must share (compared across nodes at start)."""
    a = config.args
    return {"model": config.model_path, "dtype": str(config.dtype), "kv_cache_dtype": str(config.kv_cache_dtype),
            "quantization": a.quantization, "tensor_parallel_size": a.tensor_parallel_size, "nnodes": a.nnodes,
            "max_model_len": config.max_model_len, "block_size": a.block_size, "seed": a.seed,
            "speculative_config": repr(config.speculative_config), "attention_backend": a.attention_backend}


def _watchdog(parent_pid: int, heartbeat_addr: str | None, rank: int) -> None:
    """A thread that ends the process when its parent is gone or, across nodes, node 0 has
    been silent for ``HEARTBEAT_TIMEOUT_S`` (whatever the main thread is blocked in: a
    rendezvous, a collective)."""
    import threading
    import time

    def run():
        sock = None
        if heartbeat_addr is not None:
            import zmq

            sock = zmq.Context.instance().socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(heartbeat_addr)
        heard = time.monotonic()
        while True:
            if sock is not None and sock.poll(int(PARENT_CHECK_S * 1000)):
                while sock.poll(0):
                    sock.recv()
                heard = time.monotonic()
            elif sock is None:
                time.sleep(PARENT_CHECK_S)
            if os.getppid() != parent_pid:
                logger.warning("rank %d: its parent process is gone; exiting", rank)
                os._exit(1)
            if sock is not None and time.monotonic() - heard > HEARTBEAT_TIMEOUT_S:
                logger.warning("rank %d: node 0 silent for %.0f s; exiting", rank, HEARTBEAT_TIMEOUT_S)
                os._exit(1)

    threading.Thread(target=run, name="pagedllm-rank-watchdog", daemon=True).start()


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
    _watchdog(parent_pid, addrs.get("heartbeat"), rank)
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
        replies.send_multipart([me, READY, pickle.dumps(config_fingerprint(config))])
        _serve(worker, rank, calls, replies)
    finally:
        calls.close(linger=0)
        replies.close()
        ctx.term()
        logging.shutdown()
        os._exit(status)


def _serve(worker, rank: int, calls, replies) -> None:
    """Answer calls until SHUTDOWN (the watchdog ends the process if the parent goes)."""
    from pagedllm.messages import SchedulerOutput

    decoder = msgspec.msgpack.Decoder(SchedulerOutput)
    encoder = msgspec.msgpack.Encoder()
    me = str(rank).encode()
    while True:
        method, payload = calls.recv_multipart()
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
