"""What every executor of several tensor-parallel ranks shares (``multiproc_executor``,
``ray_executor``): the Executor methods as calls on every rank, rank 0's step output checked
against the other ranks' token digests, and one verdict on errors: raised by every rank, a
failed step; by some ranks only (the others wait in a collective), a dead group."""
from __future__ import annotations

from abc import abstractmethod

from pagedllm.errors import ExecutorDeadError
from pagedllm.executor.abstract import Executor
from pagedllm.messages import ModelRunnerOutput, SchedulerOutput
from pagedllm.worker.worker_proc import sampled_digest


class RankedExecutor(Executor):
    """Subclasses set ``world_size`` and ``backend`` (its name in the start-up line) and
    supply the three transport methods below."""

    MISMATCH_WAIT_S = 2.0   # after one rank's error, how long the others get to report theirs
    world_size: int
    backend: str
    _dead: str | None = None

    @abstractmethod
    def _call_ranks(self, method: str, *args) -> list:
        """``Worker.<method>(*args)`` on every rank; the results in rank order (``_verdict``
        on the errors)."""

    @abstractmethod
    def _step_ranks(self, scheduler_output: SchedulerOutput) -> tuple[ModelRunnerOutput, list[int]]:
        """One step on every rank: rank 0's output and ranks 1..n-1's ``sampled_digest``."""

    @abstractmethod
    def _kill_ranks(self) -> None:
        """Stop every rank now."""

    def _check_dead(self) -> None:
        if self._dead:
            raise ExecutorDeadError(self._dead)

    def _fail(self, reason: str) -> None:
        """Mark the group dead, kill its ranks, raise ExecutorDeadError(reason)."""
        self._dead = reason
        self._kill_ranks()
        raise ExecutorDeadError(reason)

    def _verdict(self, errors: dict[int, BaseException], missing: list[int]) -> None:
        """Nothing without errors; rank 0's error when every rank raised one; else (some
        raised, the rest ``missing`` or fine) ``_fail``."""
        if not errors:
            return
        if len(errors) < self.world_size:
            first = next(iter(errors.values()))
            self._fail(f"tensor-parallel ranks out of step: {type(first).__name__}: {first} on ranks "
                       f"{sorted(errors)}" + (f", no answer from ranks {missing}" if missing else " only"))
        raise errors[0]

    def _call(self, method: str, *args) -> list:
        self._check_dead()
        return self._call_ranks(method, *args)

    def kv_bytes_per_block(self) -> int:
        return self._call("kv_bytes_per_block")[0]

    def determine_num_kv_blocks(self) -> int:
        return min(self._call("determine_num_kv_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._call("initialize_kv_cache", num_blocks)

    def describe_compute_path(self) -> str:
        return f"{self._call('describe_compute_path')[0]}, tensor parallel {self.world_size} ranks ({self.backend})"

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._check_dead()
        out, digests = self._step_ranks(scheduler_output)
        want = sampled_digest(out.sampled_token_ids)
        differ = [r for r, d in enumerate(digests, start=1) if d != want]
        if differ:
            self._fail(f"tensor-parallel ranks {differ} sampled other tokens than rank 0")
        return out
