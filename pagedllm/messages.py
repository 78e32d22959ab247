"""The msgspec structs that cross pagedllm's two seams (after vLLM V1's).

Front end ↔ engine core: ``EngineCoreRequest`` in, ``EngineCoreOutputs`` out per step.
Engine core ↔ worker: ``SchedulerOutput`` (new requests once, then deltas) in,
``ModelRunnerOutput`` out. Every struct round-trips through ``msgspec.msgpack``; this
module imports nothing of pagedllm's but ``SamplingParams``.
"""
from __future__ import annotations

import msgspec

from pagedllm.sampling_params import SamplingParams

# finish reasons, as the OpenAI API names them
FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Raw log-softmax logprobs at one position: ``token_ids`` = the chosen token, then
    the top ``logprobs`` tokens; ``logprobs`` natural-log, same order; ``rank`` of the
    chosen token (1 = most likely)."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


# ---------------------------------------------------------------------------------------
# front end ↔ engine core
# ---------------------------------------------------------------------------------------
class EngineCoreRequest(msgspec.Struct, omit_defaults=True):
    """A validated, tokenized request: ``request_id`` unique among live requests,
    ``prompt_token_ids`` non-empty and in-vocabulary, ``sampling_params.max_tokens``
    resolved, ``arrival_time`` in ``time.time()`` seconds."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float


class EngineCoreOutput(msgspec.Struct, omit_defaults=True):
    """One request's news from one step or abort. ``finish_reason``: ``"stop"``,
    ``"length"``, ``"abort"`` or None while running; ``stop_reason``: the stop token id;
    times are wall-clock seconds (None until they happen); ``new_logprobs`` one entry per
    new token, ``new_prompt_logprobs`` the prompt positions this step computed."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs] | None = None


class SchedulerStats(msgspec.Struct):
    """The scheduler's state after a step. ``kv_cache_usage`` in [0, 1]; preemption,
    prefix-cache (in tokens) and ``spec_decode_*`` counters are cumulative (vLLM's; per-pos
    index j = the (j+1)-th draft); ``step_*`` count the last step only (0 outside one)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_blocks_used: int = 0
    num_blocks_total: int = 0
    num_preemptions_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    step_num_reqs: int = 0
    step_num_prefill_tokens: int = 0
    step_num_decode_tokens: int = 0
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []
    # with data parallelism, each engine's (running, waiting, kv_cache_usage, alive), engine order
    engines: list[tuple[int, int, float, bool]] = []


class EngineCoreOutputs(msgspec.Struct):
    """A step's or abort's result: ``outputs`` in schedule order; ``failed_request_ids``
    the requests a raising step took down (already freed), with ``error`` its message."""

    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    failed_request_ids: list[str] = []
    error: str | None = None
    engine_dead: bool = False   # the failed requests' engine died (data parallelism: the others go on)


class EngineCoreInfo(msgspec.Struct):
    """The started core's final ``max_model_len`` (after KV sizing), KV cache size in
    blocks of ``block_size`` tokens, and the kernel description for the start-up log."""

    max_model_len: int
    num_kv_blocks: int
    block_size: int
    compute_path: str


class UtilityCall(msgspec.Struct, array_like=True):
    """A no-argument EngineCore method call across the process seam; ``call_id`` is
    echoed in the ``UtilityResult``."""

    call_id: int
    method: str


class UtilityResult(msgspec.Struct, array_like=True):
    """A ``UtilityCall``'s answer: ``result`` msgpack-encoded (nil if it raised),
    ``error`` = ``"TypeName: message"`` if it raised."""

    call_id: int
    result: msgspec.Raw
    error: str | None = None


class EngineCoreFailure(msgspec.Struct):
    """Sent before the core process exits on a start-up or loop failure: the exception's
    class name, message and ``InvalidParameterError.param`` if any."""

    error_type: str
    message: str
    param: str | None = None


# ---------------------------------------------------------------------------------------
# engine core ↔ worker
# ---------------------------------------------------------------------------------------
class NewRequestData(msgspec.Struct):
    """A request the runner has not seen, sent once. ``block_ids``: its whole block table,
    one equal-length list per KV-cache group; ``num_computed_tokens``: prefix-cache hit."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    block_ids: list[list[int]]
    num_computed_tokens: int


class CachedRequestData(msgspec.Struct):
    """Deltas for held requests (parallel lists). ``new_block_ids``: blocks appended per
    KV-cache group (the whole table if ``resumed_from_preemption``), after first dropping
    ``num_freed_blocks`` from the table's end (rejected drafts' slots)."""

    req_ids: list[str] = []
    resumed_from_preemption: list[bool] = []
    new_block_ids: list[list[list[int]]] = []
    num_computed_tokens: list[int] = []
    num_freed_blocks: list[int] = []


class GrammarBitmask(msgspec.Struct):
    """Allowed-token rows for constrained requests: ``req_first_row`` maps a request to
    its first of k+1 rows (k drafts). ``data``: int32 LE [num_rows, ceil(vocab/32)],
    bit j of word i = token 32i+j allowed (xgrammar's layout)."""

    req_first_row: dict[str, int]
    num_rows: int
    num_words: int
    data: bytes


class SchedulerOutput(msgspec.Struct):
    """One step's batch. ``num_scheduled_tokens``: req_id → tokens this step, in
    schedule order, summing to ``total_num_scheduled_tokens`` (<= max_num_batched_tokens);
    ``finished_req_ids``: requests the runner forgets."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}
    grammar_bitmask: GrammarBitmask | None = None
    finished_req_ids: set[str] = set()
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_preempted: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


class ModelRunnerOutput(msgspec.Struct):
    """One step's result, in batch order: ``sampled_token_ids`` per request is [] for a
    mid-prompt chunk, else 1 token (up to k+1 with drafts); ``spec_token_ids`` the next
    step's drafts ([] without speculative decoding)."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    spec_token_ids: list[list[int]] = []
    logprobs: dict[str, list[TokenLogprobs]] = {}
    prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
