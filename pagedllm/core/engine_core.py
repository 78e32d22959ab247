"""EngineCore: the schedule → execute → update loop over one ModelRunner."""
from __future__ import annotations

import logging
import time

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import EngineCoreOutput, Scheduler, SchedulerStats
from pagedllm.request import Request, RequestStatus
from pagedllm.utils import cdiv, parse_size

logger = logging.getLogger("pagedllm")


class EngineCore:
    """Loads the model, sizes the KV cache, and steps the scheduler.

    KV sizing: on CPU ``kv_cache_memory`` bytes; on CUDA ``gpu_memory_utilization`` of the
    device's memory minus what is in use after loading the model; or exactly
    ``num_gpu_blocks_override`` blocks.

    Raises:
        ValueError: the cache cannot hold one request of ``max_model_len`` tokens
            (when max_model_len was given explicitly; otherwise it is lowered to fit).
    """

    def __init__(self, config: EngineConfig):
        from pagedllm.worker.model_runner import ModelRunner

        args = config.args
        if config.device.type == "cpu" and args.num_threads:
            torch.set_num_threads(args.num_threads)
        torch.manual_seed(args.seed)
        t0 = time.time()
        self.config = config
        self.runner = ModelRunner(config)
        logger.info("loaded %s (%s, %s) on %s in %.1f s; %s", config.served_model_name,
                    config.arch.architecture, str(config.dtype).replace("torch.", ""),
                    config.device, time.time() - t0, self.runner.describe_compute_path())
        per_block = self.runner.kv_bytes_per_block()
        if args.num_gpu_blocks_override:
            num_blocks = args.num_gpu_blocks_override
        elif config.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(config.device)
            budget = total * args.gpu_memory_utilization - (total - free)
            num_blocks = int(budget // per_block)
        else:
            num_blocks = parse_size(args.kv_cache_memory) // per_block
        if num_blocks < 1:
            raise ValueError("no memory left for the KV cache: raise --kv-cache-memory "
                             "or --gpu-memory-utilization")
        capacity = num_blocks * args.block_size
        if config.max_model_len > capacity:
            if args.max_model_len:
                raise ValueError(
                    f"max_model_len ({config.max_model_len}) is larger than the KV cache can hold "
                    f"({capacity} tokens in {num_blocks} blocks): raise --kv-cache-memory or lower "
                    f"--max-model-len")
            logger.warning("max_model_len lowered from %d to %d to fit the KV cache",
                           config.max_model_len, capacity)
            config.max_model_len = capacity
        self.runner.initialize_kv_cache(num_blocks)
        self.kv = KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, args.max_num_batched_tokens, args.max_num_seqs,
                                   config.max_model_len, args.enable_chunked_prefill)
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB); max concurrency at "
                    "max_model_len %d: %.2fx", num_blocks, args.block_size,
                    num_blocks * per_block / 2**30, config.max_model_len,
                    capacity / config.max_model_len)
        self.step_count = 0
        self.profiler = None
        if args.profile_dir:
            from pagedllm import envs
            from pagedllm.core.step_profiler import StepProfiler
            start, num = envs.profile_steps()
            self.profiler = StepProfiler(args.profile_dir, start, num)

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    def add_request(self, req: Request) -> None:
        """Raises ValueError when the request can never be served (see Scheduler.add_request)."""
        self.scheduler.add_request(req)

    def abort_requests(self, request_ids) -> list[EngineCoreOutput]:
        """Abort requests now; their blocks are freed before this returns."""
        done = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        return [self.scheduler.abort_output(r) for r in done]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        """One schedule → execute → update iteration; returns per-request outputs."""
        prof = self.profiler
        if prof is not None:
            prof.before_step(self.step_count)
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        self.last_step = so
        t1 = time.perf_counter()
        sampled = self.runner.execute_model(so)
        t2 = time.perf_counter()
        outputs = self.scheduler.update_from_output(so, sampled) if so.scheduled else []
        t3 = time.perf_counter()
        if prof is not None and so.scheduled:
            st = self.scheduler.stats()
            from pagedllm.core.step_profiler import StepRecord
            prof.after_step(StepRecord(
                step=self.step_count, ts=time.time(), step_time_s=t3 - t0,
                schedule_time_s=t1 - t0, execute_time_s=t2 - t1, update_time_s=t3 - t2,
                num_prefill_tokens=so.num_prefill_tokens, num_decode_tokens=so.num_decode_tokens,
                num_reqs=len(so.scheduled), num_running=st.num_running,
                num_waiting=st.num_waiting, kv_blocks_used=st.num_blocks_used,
                kv_blocks_total=st.num_blocks_total, num_preemptions=so.num_preempted))
        if so.scheduled:
            self.step_count += 1
        return outputs

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def reset_prefix_cache(self) -> int:
        """Drop cached blocks no request holds; returns how many."""
        return self.kv.reset_prefix_cache()

    def shutdown(self) -> None:
        if self.profiler is not None:
            self.profiler.close()
            self.profiler = None
