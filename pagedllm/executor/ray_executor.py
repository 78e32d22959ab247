"""The Ray executor (``--distributed-executor-backend ray``, vLLM's ``RayDistributedExecutor``
in small): one Ray actor per tensor-parallel rank, placed by a placement group (one CPU,
or one GPU, per rank; ``PACK``), joined in a torch.distributed world whose rendezvous is
rank 0's node. Ray places the ranks on the cluster's machines; the step itself is the
same as the multi-process executor's: every rank runs it, rank 0's output is returned and
the others' token digests must match.

Cluster: the one ``RAY_ADDRESS`` (or ``ray start``) names, else a local one started here
and stopped at shutdown. Failure model: an actor that dies, or an error on some ranks
only, raises ``ExecutorDeadError``; an error on every rank fails the step.
"""
from __future__ import annotations

import logging
import time

from pagedllm.config import EngineConfig
from pagedllm.executor.ranked import RankedExecutor
from pagedllm.messages import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("pagedllm")


class RayWorkerWrapper:
    """A rank's actor: ``init_worker`` joins the world and loads this rank's share."""

    def __init__(self, config: EngineConfig, rank: int, world_size: int):
        self.config, self.rank, self.world_size, self.worker = config, rank, world_size, None

    def node_ip_and_port(self) -> tuple[str, int]:
        import ray

        from pagedllm.executor.multiproc_executor import free_port

        ip = ray.util.get_node_ip_address()
        return ip, free_port(ip)

    def init_worker(self, init_method: str) -> None:
        from pagedllm.distributed import init_distributed_environment, initialize_model_parallel
        from pagedllm.worker.worker import Worker

        init_distributed_environment(self.world_size, self.rank, init_method)
        initialize_model_parallel(self.world_size)
        self.worker = Worker(self.config)

    def call(self, method: str, *args):
        return getattr(self.worker, method)(*args)

    def execute_model(self, so: SchedulerOutput):
        from pagedllm.worker.worker_proc import sampled_digest

        out = self.worker.execute_model(so)
        return out if self.rank == 0 else sampled_digest(out.sampled_token_ids)


class RayDistributedExecutor(RankedExecutor):
    """Raises ImportError naming the extra when Ray is missing; what a rank raised while
    starting (as its type); ``ExecutorDeadError`` when an actor dies."""

    backend = "ray"

    def __init__(self, config: EngineConfig):
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise ImportError("--distributed-executor-backend ray needs Ray: pip install 'pagedllm[ray]'") from None
        self._ray = ray
        self.world_size = config.args.tensor_parallel_size
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(ignore_reinit_error=True, include_dashboard=False, log_to_driver=False,
                     logging_level=logging.WARNING)
        self._pg = None
        self.workers = []
        try:
            resource = {"GPU": 1} if config.device.type == "cuda" else {"CPU": 1}
            self._pg = placement_group([dict(resource) for _ in range(self.world_size)], strategy="PACK")
            ray.get(self._pg.ready(), timeout=300)
            actor = ray.remote(RayWorkerWrapper)
            for rank in range(self.world_size):
                strategy = PlacementGroupSchedulingStrategy(placement_group=self._pg,
                                                            placement_group_bundle_index=rank)
                self.workers.append(actor.options(scheduling_strategy=strategy,
                                                  num_cpus=resource.get("CPU", 0),
                                                  num_gpus=resource.get("GPU", 0)
                                                  ).remote(config, rank, self.world_size))
            ip, port = ray.get(self.workers[0].node_ip_and_port.remote())
            init_method = f"tcp://{ip}:{port}"
            self._gather([w.init_worker.remote(init_method) for w in self.workers])
        except BaseException:
            self.shutdown()
            raise
        logger.info("tensor parallel: %d Ray actors, torch.distributed %s", self.world_size, init_method)

    def _gather(self, refs: list) -> list:
        """Every rank's result in rank order (``_verdict`` on the errors);
        ``ExecutorDeadError`` when an actor died."""
        ray = self._ray
        results: dict[int, object] = {}
        errors: dict[int, BaseException] = {}
        index = {r: i for i, r in enumerate(refs)}
        pending, deadline = list(refs), None
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=0.1)
            for ref in done:
                i = index[ref]
                try:
                    results[i] = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    self._fail(f"tensor-parallel rank {i}'s Ray actor died: {e}")
                except ray.exceptions.RayTaskError as e:
                    errors[i] = e.as_instanceof_cause()
                    deadline = deadline or time.monotonic() + self.MISMATCH_WAIT_S
            if errors and pending and time.monotonic() > deadline:
                break
        self._verdict(errors, sorted(index[r] for r in pending))
        return [results[i] for i in range(len(refs))]

    def _kill_ranks(self) -> None:
        for w in self.workers:
            self._ray.kill(w)

    def _call_ranks(self, method: str, *args) -> list:
        return self._gather([w.call.remote(method, *args) for w in self.workers])

    def _step_ranks(self, scheduler_output: SchedulerOutput) -> tuple[ModelRunnerOutput, list[int]]:
        outs = self._gather([w.execute_model.remote(scheduler_output) for w in self.workers])
        return outs[0], outs[1:]

    def shutdown(self) -> None:
        """Kill the actors, remove the placement group, stop a Ray started here; idempotent."""
        ray = getattr(self, "_ray", None)
        if ray is None:
            return
        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:  # noqa: BLE001  (already gone)
                pass
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._pg)
            except Exception:  # noqa: BLE001
                pass
        if self._owns_ray:
            ray.shutdown()
        self._ray = None
