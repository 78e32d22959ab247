"""Per-step JSONL log and a torch.profiler trace over a window of steps (``--profile-dir``).

``DIR/steps.jsonl``: one :class:`StepRecord` per engine step that scheduled work, as a
JSON object on one line (appended to by every run; step numbers restart per run).
``DIR/trace.json``: Chrome-trace of steps [start, start + window), viewable in Perfetto
or chrome://tracing. ``pagedllm profile summarize DIR`` reads both; it decodes
``steps.jsonl`` with :data:`STEP_DECODER`, so writer and reader share this one schema.
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
    """One engine step, one line of ``steps.jsonl``.

    Times are wall-clock seconds measured with ``time.perf_counter`` around the step's
    phases, except ``ts``. Counts are of the step itself, except the ``num_running``,
    ``num_waiting`` and ``kv_blocks_*`` snapshots taken after it.

    Attributes:
        step: number of earlier steps that scheduled work, from 0 in each engine (so it
            restarts per run).
        ts: unix time (s, ``time.time()``) when the step ended.
        step_time_s: the whole step (s), from scheduling to the end of the update.
        schedule_time_s: the scheduler's share (s).
        execute_time_s: the model runner's forward and sampling (s).
        update_time_s: applying sampled tokens to requests and building outputs (s).
        num_prefill_tokens: prompt tokens computed in the step.
        num_decode_tokens: generated-token positions computed in the step.
        num_reqs: requests scheduled in the step.
        num_running: requests running after the step.
        num_waiting: requests waiting after the step.
        kv_blocks_used: KV-cache blocks in use after the step.
        kv_blocks_total: KV-cache blocks in the pool.
        num_preemptions: requests preempted in this step (summed by the reader).
    """

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
    """Args:
        out_dir: output folder (created).
        trace_start_step: first traced step (skips warm-up steps).
        trace_num_steps: how many steps the torch.profiler trace covers.
    """

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
        """Append ``record`` to ``steps.jsonl`` (one line, written at once) and end the
        trace once it has covered its window. Raises ``OSError`` if the write fails."""
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
