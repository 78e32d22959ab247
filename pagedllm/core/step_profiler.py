"""Per-step JSONL log and a torch.profiler trace over a window of steps (``--profile-dir``).

``DIR/steps.jsonl``: one JSON object per engine step with keys step, ts (unix s),
step_time_s, schedule_time_s, execute_time_s, update_time_s, num_prefill_tokens,
num_decode_tokens, num_reqs, num_running, num_waiting, kv_blocks_used, kv_blocks_total,
num_preemptions. ``DIR/trace.json``: Chrome-trace of steps [start, start + window),
viewable in Perfetto or chrome://tracing. ``pagedllm profile summarize DIR`` reads both.
"""
from __future__ import annotations

import json
import os

import torch


class StepProfiler:
    """Args:
        out_dir: output folder (created).
        trace_start_step: first traced step (skips warm-up steps).
        trace_num_steps: how many steps the torch.profiler trace covers.
    """

    def __init__(self, out_dir: str, trace_start_step: int = 5, trace_num_steps: int = 20):
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir = out_dir
        self.log = open(os.path.join(out_dir, "steps.jsonl"), "a", buffering=1)
        self.start, self.num = trace_start_step, trace_num_steps
        self.prof: torch.profiler.profile | None = None
        self.done = False

    def before_step(self, step: int) -> None:
        if self.done or self.prof is not None or step < self.start:
            return
        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=acts, record_shapes=False)
        self.prof.__enter__()
        self._traced = 0

    def after_step(self, record: dict) -> None:
        self.log.write(json.dumps(record) + "\n")
        if self.prof is not None:
            self._traced += 1
            if self._traced >= self.num:
                self.finish()

    def finish(self) -> None:
        if self.prof is not None:
            self.prof.__exit__(None, None, None)
            self.prof.export_chrome_trace(os.path.join(self.out_dir, "trace.json"))
            self.prof = None
            self.done = True

    def close(self) -> None:
        self.finish()
        self.log.close()
