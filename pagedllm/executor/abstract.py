"""The executor interface: what the engine core asks of the workers (vLLM V1's
``Executor``); ``uniproc`` drives one worker in this process, ``multiproc`` one process
per tensor-parallel rank, ``ray_executor`` one Ray actor per rank."""
from __future__ import annotations

from abc import ABC, abstractmethod

from pagedllm.config import EngineConfig
from pagedllm.messages import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    """Building an executor from the resolved config loads the model."""

    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        """The executor for ``config.args.executor_backend``: "uni" one worker in this
        process, "mp" one process per tensor-parallel rank, ``ray_executor`` one Ray actor per rank."""
        if config.args.executor_backend == "ray":
            from pagedllm.executor.ray_executor import RayDistributedExecutor

            return RayDistributedExecutor
        if config.args.executor_backend == "mp":
            from pagedllm.executor.multiproc_executor import MultiprocExecutor

            return MultiprocExecutor
        from pagedllm.executor.uniproc_executor import UniProcExecutor

        return UniProcExecutor

    @abstractmethod
    def __init__(self, config: EngineConfig): ...

    @abstractmethod
    def kv_bytes_per_block(self) -> int:
        """Bytes one KV block takes across all layers (on each worker)."""

    @abstractmethod
    def determine_num_kv_blocks(self) -> int:
        """KV blocks that fit the memory budget (the minimum over workers)."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV blocks on every worker."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every worker; returns the driver's output. Raises whatever the
        model or a kernel raised."""

    @abstractmethod
    def describe_compute_path(self) -> str:
        """One line for the start-up log: kernels and linear implementation in use."""

    def check_health(self) -> None:
        """Raises ExecutorDeadError when a worker is known to be gone (while idle; a step
        notices by itself). Nothing to check in-process."""

    def shutdown(self) -> None:
        """Release workers (nothing to do in-process)."""
