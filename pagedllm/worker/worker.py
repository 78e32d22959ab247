"""Worker: one device's share of the engine. It sets up the device (threads, seed), owns
the ModelRunner, and answers the executor: how many KV blocks fit, allocate them, run a
step. One worker per device; with tensor parallelism there would be one per rank."""
from __future__ import annotations

import logging
import time

import torch

from pagedllm.config import EngineConfig, cpu_ranks_per_node
from pagedllm.messages import ModelRunnerOutput, SchedulerOutput
from pagedllm.utils import parse_size
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger("pagedllm")


def _ranks_sharing_cores(args) -> int:
    """CPU ranks of this node on the same cores: tensor x data parallel ranks, 1 when each
    tensor-parallel rank is bound to cores of its own (PAGEDLLM_CPU_OMP_THREADS_BIND)."""
    from pagedllm import envs

    if args.tensor_parallel_size > 1 and envs.cpu_omp_threads_bind():
        return 1
    return max(1, cpu_ranks_per_node(args))


class Worker:
    """Loads the model on ``config.device`` (the slow part of start-up: seconds)."""

    def __init__(self, config: EngineConfig):
        args = config.args
        self.thread_governor = None
        if config.device.type == "cpu":
            self._set_up_cpu_threads(args.num_threads, _ranks_sharing_cores(args))
        if config.device.type == "cuda":
            torch.cuda.set_device(config.device)   # Triton launches and CUDA graphs use the current device
        torch.manual_seed(args.seed)
        t0 = time.time()
        self.config = config
        self.model_runner = ModelRunner(config)
        logger.info("loaded %s (%s, %s) on %s in %.1f s; %s", config.served_model_name,
                    config.arch.architecture, str(config.dtype).replace("torch.", ""),
                    config.device, time.time() - t0, self.model_runner.describe_compute_path())

    def _set_up_cpu_threads(self, num_threads: int | None, ranks: int = 1) -> None:
        """``--num-threads`` (warned about when it, times the ``ranks`` sharing these cores,
        is above the usable cores), else torch's count capped to them; then the governor
        that lends cores back while other processes take them."""
        from pagedllm.worker.cpu_threads import default_num_threads, make_thread_governor, thread_count_warning

        if num_threads:
            warning = thread_count_warning(num_threads, ranks=ranks)
            if warning:
                logger.warning("%s", warning)
        else:
            num_threads = default_num_threads()
        torch.set_num_threads(num_threads)
        self.thread_governor = make_thread_governor(num_threads, sibling_threads=(ranks - 1) * num_threads)

    def kv_bytes_per_block(self) -> int:
        return self.model_runner.kv_bytes_per_block()

    def determine_num_kv_blocks(self) -> int:
        """KV blocks the memory budget allows (``kv_cache_memory`` on CPU; on CUDA what
        ``gpu_memory_utilization`` leaves after weights, a profiling step's activation peak
        and memory outside torch: ``worker/memory_profile.py``); may be <= 0."""
        args = self.config.args
        per_block = self.kv_bytes_per_block()
        if self.config.device.type == "cuda":
            from pagedllm.worker.memory_profile import profile_cuda_memory

            profile = profile_cuda_memory(self.model_runner)
            logger.info("GPU memory: %s (a profiling step of %d tokens)",
                        profile.describe(args.gpu_memory_utilization), args.max_num_batched_tokens)
            return profile.kv_cache_budget(args.gpu_memory_utilization) // per_block
        return parse_size(args.kv_cache_memory) // per_block

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)
        decoder = self.model_runner.describe_decoder()
        if decoder is not None:   # decided only now that the layers are bound to the cache
            logger.info("decoder layers: %s", decoder)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        out = self.model_runner.execute_model(scheduler_output)
        if self.thread_governor is not None:
            self.thread_governor.after_step()
        return out

    def describe_compute_path(self) -> str:
        return self.model_runner.describe_compute_path()
