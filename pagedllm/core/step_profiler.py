"""``--profile-dir``: ``DIR/steps.jsonl`` (one :class:`StepRecord` line per step that
scheduled work, appended per run) and ``DIR/trace.json`` (a torch.profiler Chrome trace
of a window of steps). ``pagedllm profile summarize`` reads both via :data:`STEP_DECODER`.
"""
from __future__ import annotations

import atexit
import os
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    import torch

__all__ = ["StepRecord", "STEP_DECODER", "StepProfiler"]


class StepRecord(msgspec.Struct, kw_only=True, frozen=True):
    """One line of ``steps.jsonl``. ``*_time_s``: ``time.perf_counter`` seconds of the
    step's phases; ``ts``: ``time.time()`` at its end; ``step`` counts from 0 per engine.
    Counts are of the step, except ``num_running``, ``num_waiting``, ``kv_blocks_*``
    (snapshots after it)."""

    step: int
    ts: float
    step_time_s: float
    schedule_time_s: float
    execute_time_s: float
    update_time_s: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_reqs: int
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions: int


#: Decodes one ``steps.jsonl`` line into a :class:`StepRecord`. Raises ``msgspec.DecodeError``
#: (a ``ValueError``; ``msgspec.ValidationError`` for a missing or mistyped field, naming it).
#: Unknown keys are ignored, so a newer writer's log still reads.
STEP_DECODER = msgspec.json.Decoder(StepRecord)
_ENCODER = msgspec.json.Encoder()


class StepProfiler:
    """Writes into ``out_dir`` (created); traces ``trace_num_steps`` steps from
    ``trace_start_step``."""

    def __init__(self, out_dir: str, trace_start_step: int = 5, trace_num_steps: int = 20):
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir = out_dir
        self.log = open(os.path.join(out_dir, "steps.jsonl"), "ab", buffering=0)
        self.start, self.num = trace_start_step, trace_num_steps
        self.prof: torch.profiler.profile | None = None
        self.done = False

    def before_step(self, step: int) -> None:
        if self.done or self.prof is not None or step < self.start:
            return
        import torch

        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=acts, record_shapes=False)
        self.prof.__enter__()
        self._traced = 0
        # A run shorter than the window must still stop the profiler and write its trace:
        # left running, it crashes the interpreter at exit.
        atexit.register(self.finish)

    def after_step(self, record: StepRecord) -> None:
        """Append ``record`` to ``steps.jsonl``; end the trace after its window. Raises
        ``OSError`` if the write fails."""
        self.log.write(_ENCODER.encode(record) + b"\n")
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
