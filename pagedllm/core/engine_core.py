"""EngineCore: the schedule → execute → update loop. It takes ``EngineCoreRequest``s and
returns ``EngineCoreOutputs`` (``pagedllm/messages.py``), so the front end never holds a
core object; it drives the workers through an ``Executor``."""
from __future__ import annotations

import logging
import time

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.step_profiler import StepProfiler, StepRecord
from pagedllm.errors import ExecutorDeadError
from pagedllm.executor.abstract import Executor
from pagedllm.messages import EngineCoreInfo, EngineCoreOutputs, EngineCoreRequest
from pagedllm.structured_output import StructuredOutputManager

logger = logging.getLogger("pagedllm")


class EngineCore:
    """Builds the executor (loads the model), sizes the KV cache
    (``num_gpu_blocks_override`` or the memory budget) and steps the scheduler.

    Raises:
        ValueError: no memory left for the KV cache, or an explicit ``max_model_len`` that
            does not fit (an implicit one is lowered).
    """

    def __init__(self, config: EngineConfig):
        args = config.args
        self.config = config
        self.executor = Executor.get_class(config)(config)
        num_blocks = args.num_gpu_blocks_override or self.executor.determine_num_kv_blocks()
        if num_blocks < 1:
            raise ValueError("no memory left for the KV cache: raise --kv-cache-memory "
                             "or --gpu-memory-utilization")
        kvc = config.kv_cache_config
        usable = num_blocks - kvc.needs_null_block
        need = lambda n: kvc.blocks_per_request(n, args.block_size, args.max_num_batched_tokens)  # noqa: E731
        if need(config.max_model_len) > usable:
            if args.max_model_len:
                raise ValueError(
                    f"max_model_len ({config.max_model_len}) is larger than the KV cache can hold "
                    f"({need(config.max_model_len)} blocks needed, {usable} in the cache): raise "
                    f"--kv-cache-memory or lower --max-model-len")
            lo, hi = 0, config.max_model_len          # the longest request that fits
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if need(mid) <= usable else (lo, mid - 1)
            logger.warning("max_model_len lowered from %d to %d to fit the KV cache", config.max_model_len, lo)
            config.max_model_len = lo
        self.executor.initialize_kv_cache(num_blocks)
        self.kv = KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching,
                                 [g.sliding_window for g in kvc.groups])
        spec = config.speculative_config
        # grammars for structured outputs (the tokenizer is loaded at the first one)
        self.structured_output = StructuredOutputManager(config.model_path, config.arch.vocab_size,
                                                         config.arch.eos_token_ids)
        self.scheduler = Scheduler(self.kv, args.max_num_batched_tokens, args.max_num_seqs,
                                   config.max_model_len, args.enable_chunked_prefill,
                                   spec.num_lookahead_slots if spec is not None else 0,
                                   self.structured_output)
        per_block = self.executor.kv_bytes_per_block()
        groups = "" if kvc.num_groups == 1 else (
            f", {kvc.num_groups} KV-cache groups of {kvc.layers_per_block} layers "
            f"({sum(g.sliding_window is not None for g in kvc.groups)} sliding-window)")
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB%s); max concurrency at "
                    "max_model_len %d: %.2fx", num_blocks, args.block_size,
                    num_blocks * per_block / 2**30, groups, config.max_model_len,
                    usable / max(1, need(config.max_model_len)))
        self.info = EngineCoreInfo(config.max_model_len, num_blocks, args.block_size,
                                   self.executor.describe_compute_path())
        self.step_count = 0
        self.profiler = None
        if args.profile_dir:
            start, num = envs.profile_steps()
            self.profiler = StepProfiler(args.profile_dir, start, num)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request the front end has validated (see ``Processor``)."""
        self.scheduler.add_request(Request.from_engine_core_request(request))

    def abort_requests(self, request_ids: list[str]) -> EngineCoreOutputs:
        """Abort requests now (unknown ids ignored), freeing blocks; returns final outputs."""
        done = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        return EngineCoreOutputs([self.scheduler.abort_output(r) for r in done], self.scheduler.stats())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        """One schedule → execute → update iteration. An executor error fails only the
        step's requests (``failed_request_ids``); scheduling/updating errors propagate."""
        prof = self.profiler
        if prof is not None:
            prof.before_step(self.step_count)
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        failed_grammars = self.scheduler.take_failed_outputs()
        t1 = time.perf_counter()
        if so.is_empty:   # the runner still learns which requests finished
            self.executor.execute_model(so)
            if not failed_grammars and self.structured_output.num_compiling:
                self.structured_output.wait_for_compiles(timeout=0.05)   # rather than spin
            return EngineCoreOutputs(failed_grammars, self.scheduler.stats())
        try:
            runner_output = self.executor.execute_model(so)
        except ExecutorDeadError:
            raise          # no step can run any more: the loop fails every request
        except Exception as e:  # noqa: BLE001  (fail this step's requests, not the engine)
            logger.exception("engine step failed")
            failed = list(so.num_scheduled_tokens)
            self.scheduler.finish_requests(failed, RequestStatus.FINISHED_ABORTED)
            return EngineCoreOutputs(failed_grammars, self.scheduler.stats(), failed, f"{type(e).__name__}: {e}")
        t2 = time.perf_counter()
        outputs = failed_grammars + self.scheduler.update_from_output(so, runner_output)
        t3 = time.perf_counter()
        stats = self.scheduler.stats()
        stats.step_num_reqs = len(so.num_scheduled_tokens)
        stats.step_num_prefill_tokens = so.num_prefill_tokens
        stats.step_num_decode_tokens = so.num_decode_tokens
        if prof is not None:
            prof.after_step(StepRecord(
                step=self.step_count, ts=time.time(), step_time_s=t3 - t0,
                schedule_time_s=t1 - t0, execute_time_s=t2 - t1, update_time_s=t3 - t2,
                num_prefill_tokens=so.num_prefill_tokens, num_decode_tokens=so.num_decode_tokens,
                num_reqs=stats.step_num_reqs, num_running=stats.num_running,
                num_waiting=stats.num_waiting, kv_blocks_used=stats.num_blocks_used,
                kv_blocks_total=stats.num_blocks_total, num_preemptions=so.num_preempted))
        self.step_count += 1
        return EngineCoreOutputs(outputs, stats)

    def get_scheduler_stats(self):
        return self.scheduler.stats()

    def reset_prefix_cache(self) -> int:
        """Drop cached blocks no request holds; returns how many."""
        return self.kv.reset_prefix_cache()

    def shutdown(self) -> None:
        self.executor.shutdown()
        self.structured_output.shutdown()
        if self.profiler is not None:
            self.profiler.close()
            self.profiler = None
