"""What generation returns (vLLM's RequestOutput shape)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """A token's raw natural-log probability at one position (vLLM's shape); ``rank`` 1
    = most likely."""

    logprob: float
    rank: int
    decoded_token: str


@dataclass
class CompletionOutput:
    """One of a request's ``n`` completions. ``finish_reason``: "stop", "length", "abort"
    or None while running; ``stop_reason``: the stop string or token id; ``logprobs``: per
    token, token id -> Logprob."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Per-request timings in ``time.time()`` seconds (None before they happen)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def time_in_queue(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """A request as the caller sees it: cumulative ``outputs``, plus ``delta_*`` since the
    previous one. With ``n`` > 1, one sequence per output (``delta_index``), all n in the
    final one; ``prompt_logprobs[0]`` is None. ``num_cached_tokens``: prompt tokens found in
    the prefix cache at the first admission (with ``n`` > 1, sequence 0's)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    delta_index: int = 0
