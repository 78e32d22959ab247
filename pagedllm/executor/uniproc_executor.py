"""The single-process executor: one Worker in this process, called directly."""
from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.executor.abstract import Executor
from pagedllm.messages import ModelRunnerOutput, SchedulerOutput
from pagedllm.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig):
        self.driver_worker = Worker(config)

    def kv_bytes_per_block(self) -> int:
        return self.driver_worker.kv_bytes_per_block()

    def determine_num_kv_blocks(self) -> int:
        return self.driver_worker.determine_num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.driver_worker.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.driver_worker.execute_model(scheduler_output)

    def describe_compute_path(self) -> str:
        return self.driver_worker.describe_compute_path()
