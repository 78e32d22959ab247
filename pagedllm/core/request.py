"""The engine core's state of one request."""
from __future__ import annotations

import enum
import time

from pagedllm.messages import EngineCoreRequest
from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


class Request:
    """A request as the scheduler sees it. ``num_computed_tokens``: tokens whose K/V are
    (or after this step's forward will be) cached; ``block_hashes``: one per full block of
    ``all_token_ids``; times in ``time.time()`` seconds, None until they happen;
    ``spec_token_ids``: next step's drafts."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_ids: set[int], arrival_time: float | None = None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = set(eos_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []
        self.stop_reason: int | str | None = None
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.num_cached_tokens = -1
        self.spec_token_ids: list[int] = []
        # prompt logprobs computed but not yet sent (they go out with the first token)
        self.pending_prompt_logprobs: list = []

    @classmethod
    def from_engine_core_request(cls, r: EngineCoreRequest) -> Request:
        return cls(r.request_id, r.prompt_token_ids, r.sampling_params, set(r.eos_token_ids),
                   r.arrival_time)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
