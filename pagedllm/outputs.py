"""What generation returns (vLLM's RequestOutput shape)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """A token's log probability at one position (vLLM's shape).

    Attributes:
        logprob: natural log of its probability under the model's raw distribution.
        rank: 1 = the most likely token at that position.
        decoded_token: the token's text on its own.
    """

    logprob: float
    rank: int
    decoded_token: str


@dataclass
class CompletionOutput:
    """One completion: text, token ids and why it ended.

    Attributes:
        index: which of the request's ``n`` sequences this is.
        finish_reason: "stop" (EOS, stop string or stop token), "length" (max_tokens or
            max_model_len), "abort", or None while running.
        stop_reason: the stop string or stop token id that ended it, else None.
        logprobs: with ``SamplingParams.logprobs``, per generated token a dict token id ->
            Logprob holding the generated token and the top ``logprobs`` tokens; else None.
        cumulative_logprob: sum of the generated tokens' logprobs (with ``logprobs``).
    """

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
    """Per-request timings, wall-clock seconds since the epoch (``time.time()``).

    arrival_time: request received; first_scheduled_time: first admitted to a batch;
    first_token_time: first output token produced; finished_time: finished (None before).
    Derived: ``time_in_queue`` = first_scheduled - arrival, ``ttft`` = first_token - arrival.
    """

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
    """A request's state as seen by the caller.

    ``outputs[0].text`` / ``token_ids`` are cumulative; in streaming, ``delta_text`` and
    ``delta_token_ids`` hold what is new since the previous RequestOutput. With ``n`` > 1,
    each output before the last carries the one sequence that has news (its ``index``
    says which) and the final output (``finished``) all n, in index order;
    ``delta_index`` is the index of the sequence the delta belongs to.
    ``prompt_logprobs``: with ``SamplingParams.prompt_logprobs``, None for the first
    prompt token, then per prompt token a dict as ``CompletionOutput.logprobs``.
    """

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
