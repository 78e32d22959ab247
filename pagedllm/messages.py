"""The typed messages that cross pagedllm's two seams, as plain msgspec structs.

Front end ↔ engine core (vLLM V1's ``EngineCoreRequest`` / ``EngineCoreOutputs``): the
front end (``LLMEngine``, ``AsyncLLM``) validates and tokenizes a request into an
``EngineCoreRequest`` and receives ``EngineCoreOutputs`` once per step, with new token ids
per request, finish reasons, the ids of requests a failed step took down, and the
scheduler's statistics.

Engine core ↔ worker: the scheduler's ``SchedulerOutput`` (new requests sent once, then
only deltas: new block ids and computed-token counts) and the runner's
``ModelRunnerOutput`` (0..k+1 sampled tokens per request).

Every struct here can be encoded with ``msgspec.msgpack`` and decoded back (tested), so
either seam can move to another process without changing its two sides. This module
imports nothing of pagedllm's but ``SamplingParams`` (a dataclass msgspec encodes).
"""
from __future__ import annotations

import msgspec

from pagedllm.sampling_params import SamplingParams

# finish reasons, as the OpenAI API names them
FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Log probabilities at one position (raw: ``log_softmax`` of the model's logits).

    Attributes:
        token_ids: the chosen token (sampled, or the prompt's next token), then the most
            likely tokens in order (as many as the request's ``logprobs`` asks).
        logprobs: natural-log probabilities, same order.
        rank: the chosen token's rank (1 = most likely).
    """

    token_ids: list[int]
    logprobs: list[float]
    rank: int


# ---------------------------------------------------------------------------------------
# front end ↔ engine core
# ---------------------------------------------------------------------------------------
class EngineCoreRequest(msgspec.Struct, omit_defaults=True):
    """A validated, tokenized request.

    Attributes:
        request_id: unique among the requests alive in the engine.
        prompt_token_ids: the prompt, token ids (non-empty, inside the vocabulary).
        sampling_params: with ``max_tokens`` resolved (never None).
        eos_token_ids: ids that end generation unless ``ignore_eos``.
        arrival_time: wall-clock seconds (``time.time()``) when the request arrived.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float


class EngineCoreOutput(msgspec.Struct, omit_defaults=True):
    """One request's news from one step (or from an abort).

    Attributes:
        new_token_ids: tokens generated this step (several with speculative decoding).
        finish_reason: ``"stop"``, ``"length"``, ``"abort"``, or None while running.
        stop_reason: the stop token id that ended it, else None.
        num_cached_tokens: prompt tokens served from the prefix cache at admission.
        scheduled_time / first_token_time / finished_time: wall-clock seconds, None
            until the event happened.
        num_preemptions: times the request was preempted so far.
        new_logprobs: with ``logprobs`` set, one entry per new token; else None.
        new_prompt_logprobs: with ``prompt_logprobs`` set, entries for the prompt tokens
            whose logprobs this step computed (in order, from the second prompt token on).
    """

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
    """The scheduler's state after a step, and what that step scheduled.

    Attributes:
        num_running / num_waiting: requests.
        kv_cache_usage: share of KV blocks in use, [0, 1].
        num_blocks_used / num_blocks_total: KV blocks.
        num_preemptions_total, prefix_cache_queries, prefix_cache_hits: cumulative
            (queries and hits in tokens).
        step_num_reqs / step_num_prefill_tokens / step_num_decode_tokens: requests and
            tokens the step computed (0 in stats not taken from a step).
        spec_decode_num_drafts / spec_decode_num_draft_tokens /
            spec_decode_num_accepted_tokens: cumulative speculative-decoding counters
            (requests-steps that verified drafts, draft tokens verified, accepted);
        spec_decode_num_accepted_tokens_per_pos: cumulative accepted drafts by position
            (index j = the (j+1)-th draft token of a step), as vLLM's.
    """

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


class EngineCoreOutputs(msgspec.Struct):
    """What the core returns from a step or an abort.

    Attributes:
        outputs: per-request news, in schedule order.
        scheduler_stats: state after the step.
        failed_request_ids: requests that the step failed (the executor raised while
            running them); the core has already freed them.
        error: the failure's message when ``failed_request_ids`` is set.
    """

    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    failed_request_ids: list[str] = []
    error: str | None = None


class EngineCoreInfo(msgspec.Struct):
    """What the front end learns from the core once it has started.

    Attributes:
        max_model_len: tokens per request, final after KV-cache sizing.
        num_kv_blocks / block_size: the KV cache, in blocks of ``block_size`` tokens.
        compute_path: the start-up log's description of the kernels in use.
    """

    max_model_len: int
    num_kv_blocks: int
    block_size: int
    compute_path: str


class UtilityCall(msgspec.Struct, array_like=True):
    """A call of one of the core's query methods, across the process seam
    (``core/engine_proc.py``): ``reset_prefix_cache`` or ``get_scheduler_stats``, no
    arguments.

    Attributes:
        call_id: chosen by the caller, echoed in the ``UtilityResult``.
        method: the EngineCore method's name.
    """

    call_id: int
    method: str


class UtilityResult(msgspec.Struct, array_like=True):
    """The answer to a ``UtilityCall``.

    Attributes:
        call_id: the call's id.
        result: the method's return value, msgpack-encoded (decoded by the caller, which
            knows the method's return type); msgpack nil when it raised.
        error: ``"TypeName: message"`` when the method raised, else None.
    """

    call_id: int
    result: msgspec.Raw
    error: str | None = None


class EngineCoreFailure(msgspec.Struct):
    """The core process could not start, or its loop failed outside a step; it exits after
    sending this.

    Attributes:
        error_type: the exception's class name (``ValueError``, ``InvalidParameterError``...).
        message: its message.
        param: the ``InvalidParameterError.param`` it named, else None.
    """

    error_type: str
    message: str
    param: str | None = None


# ---------------------------------------------------------------------------------------
# engine core ↔ worker
# ---------------------------------------------------------------------------------------
class NewRequestData(msgspec.Struct):
    """A request the runner has not seen, sent once.

    Attributes:
        prompt_token_ids: the prompt's token ids.
        sampling_params: the request's parameters.
        eos_token_ids: banned with ``stop_token_ids`` until ``min_tokens`` are out.
        block_ids: its whole block table so far, one list per KV-cache group
            (``kv_cache_interface``; one group for most models), all of one length.
        num_computed_tokens: tokens already in the KV cache (a prefix-cache hit).
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    block_ids: list[list[int]]
    num_computed_tokens: int


class CachedRequestData(msgspec.Struct):
    """Deltas for requests the runner already holds (parallel lists, one entry each).

    Attributes:
        resumed_from_preemption: the request was preempted (its blocks freed) and runs
            again: ``new_block_ids`` is then its whole new block table.
        new_block_ids: blocks appended to its tables since the last step it ran, one
            list per KV-cache group (all of one length).
        num_computed_tokens: tokens in the KV cache before this step.
        num_freed_blocks: blocks dropped from the end of its table since the last step it
            ran (slots of rejected draft tokens), before ``new_block_ids`` are appended;
            0 without speculative decoding.
    """

    req_ids: list[str] = []
    resumed_from_preemption: list[bool] = []
    new_block_ids: list[list[list[int]]] = []
    num_computed_tokens: list[int] = []
    num_freed_blocks: list[int] = []


class GrammarBitmask(msgspec.Struct):
    """Structured outputs: the tokens each constrained request may sample this step.

    Attributes:
        req_first_row: req_id → its first row; a request with k draft tokens owns k + 1
            consecutive rows (its sampling positions in order), else one.
        num_rows / num_words: the shape, words = ceil(vocab_size / 32).
        data: int32 little-endian [num_rows, num_words], row-major; bit j of word i set =
            token 32 i + j allowed (xgrammar's layout; ``structured_output/bitmask.py``
            packs and unpacks it).
    """

    req_first_row: dict[str, int]
    num_rows: int
    num_words: int
    data: bytes


class SchedulerOutput(msgspec.Struct):
    """One step's batch.

    Attributes:
        scheduled_new_reqs: requests sent whole, once.
        scheduled_cached_reqs: deltas of requests the runner holds.
        num_scheduled_tokens: req_id → tokens to compute this step (in schedule order).
        total_num_scheduled_tokens: their sum (<= max_num_batched_tokens).
        scheduled_spec_decode_tokens: req_id → proposed draft tokens to verify (empty
            without speculative decoding).
        grammar_bitmask: for structured outputs, the allowed-token bitmask rows of the
            constrained requests that sample this step; None when there are none.
        finished_req_ids: requests that ended since the last step; the runner forgets them.
        num_prefill_tokens / num_decode_tokens / num_preempted: for statistics.
    """

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
    """The runner's result for one step.

    Attributes:
        req_ids: the scheduled requests, in the runner's batch order.
        sampled_token_ids: per request (same order), the tokens it produced this step:
            [] for a prompt chunk that does not reach the end of the prompt, one token
            otherwise (up to k+1 with speculative decoding: the accepted draft prefix and
            one token of the target's).
        spec_token_ids: with speculative decoding, per request (same order) the draft
            tokens proposed for its next step ([] for none); empty list without it.
        logprobs: req_id -> one entry per sampled token, for requests with ``logprobs``.
        prompt_logprobs: req_id -> entries for the prompt tokens this step computed, for
            requests with ``prompt_logprobs`` (positions not sent before only).
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    spec_token_ids: list[list[int]] = []
    logprobs: dict[str, list[TokenLogprobs]] = {}
    prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
