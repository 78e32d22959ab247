"""LLMEngine: the synchronous front end (after vLLM V1's). It owns the tokenizer, the
Processor, parallel sampling and the OutputProcessor, and reaches the engine core only
through an ``EngineCoreClient``."""
from __future__ import annotations

import copy

from pagedllm.config import EngineArgs, EngineConfig, load_chat_template
from pagedllm.engine import chat
from pagedllm.engine.chat import CHAT_ROLES, normalize_chat_messages  # noqa: F401  (re-exported)
from pagedllm.engine.core_client import EngineCoreClient
from pagedllm.engine.metrics import IterationStats, LoggingStatLogger
from pagedllm.engine.output_processor import OutputProcessor, RequestState
from pagedllm.engine.parallel_sampling import ParentRequest
from pagedllm.engine.processor import Processor
from pagedllm.messages import EngineCoreRequest, SchedulerStats
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import eos_token_ids, get_tokenizer


class EngineStepError(RuntimeError):
    """A step failed for ``request_ids`` (gone, blocks freed); ``outputs`` are the same
    step's RequestOutputs for other requests, to deliver first; ``engine_dead``: their
    (data-parallel) engine died, the others serve on."""

    def __init__(self, message: str, request_ids: list[str], outputs: list[RequestOutput],
                 engine_dead: bool = False):
        super().__init__(message)
        self.request_ids = request_ids
        self.outputs = outputs
        self.engine_dead = engine_dead


class LLMEngine:
    """Engine over ``EngineArgs``; ``stat_loggers`` have ``record(SchedulerStats,
    IterationStats)``; a logging one is added when ``log_stats``."""

    def __init__(self, args: EngineArgs, stat_loggers: list | None = None, log_stats: bool = True):
        self.config = EngineConfig.from_args(args)
        self.tokenizer = get_tokenizer(self.config.model_path)
        if self.config.args.chat_template is not None:   # every copy (tokenizer_copy) inherits it
            self.tokenizer.chat_template = load_chat_template(self.config.args.chat_template)
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.config.arch.eos_token_ids,
                                           self.config.model_path)
        self.engine_core = EngineCoreClient.make_client(self.config)
        self.processor = Processor(self.tokenizer, self.config.arch.vocab_size, self.max_model_len,
                                   self.eos_token_ids, args.max_num_batched_tokens,
                                   args.enable_chunked_prefill)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stat_loggers = list(stat_loggers or [])
        self._unrecorded_aborts = 0   # aborts not yet handed to the stat loggers (_record_stats)
        if log_stats:
            self.stat_loggers.append(LoggingStatLogger())
        self._counter = 0

    @property
    def max_model_len(self) -> int:
        return self.engine_core.info.max_model_len

    @property
    def model_name(self) -> str:
        return self.config.served_model_name

    @property
    def states(self) -> dict[str, RequestState]:
        """The sequences not finished yet, by the core's request id."""
        return self.output_processor.request_states

    @property
    def parents(self) -> dict[str, ParentRequest]:
        """The requests with n > 1 not finished yet, by the caller's id."""
        return self.output_processor.parent_requests

    def next_request_id(self) -> str:
        self._counter += 1
        return str(self._counter)

    # ------------------------------------------------------------------------------
    def process(self, request_id: str, prompt, params: SamplingParams | None,
                arrival_time: float | None = None,
                processor: Processor | None = None) -> tuple[EngineCoreRequest, str | None]:
        """Validate and tokenize (thread-safe with a ``processor`` from ``tokenizer_copy``).

        Raises:
            ValueError: bad prompt or parameters (the message names which).
        """
        return (processor or self.processor).process(request_id, prompt, params, arrival_time)

    def tokenizer_copy(self) -> tuple[object, Processor]:
        """A (tokenizer, Processor) copy for another thread (fast tokenizers are not
        thread-safe)."""
        tok = copy.deepcopy(self.tokenizer)
        proc = copy.copy(self.processor)
        proc.tokenizer = tok
        return tok, proc

    def add_processed(self, req: EngineCoreRequest, prompt_text: str | None) -> None:
        """Send a processed request to the core (with n > 1, as its child requests).

        Raises:
            ValueError: ``request_id`` belongs to a request that is still alive.
        """
        rid = req.request_id
        ops = self.output_processor
        if ops.is_request_id_in_use(rid):
            raise ValueError(f"request_id {rid!r} is already in use")
        sp = req.sampling_params
        if sp.n == 1:
            self.engine_core.add_request(req)
            ops.add_request(req, prompt_text)
            return
        wait = self.config.args.enable_prefix_caching and sp.prompt_logprobs is None
        parent, children = ParentRequest.fan_out(req, wait_for_prefix=wait)
        if any(c in ops.request_states for c in parent.child_ids):
            raise ValueError(f"request_id {rid!r} is already in use")
        for i, (child, send) in enumerate(children):
            if send:
                self.engine_core.add_request(child)
            ops.add_request(child, prompt_text, parent, i)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a prompt (string, token-id list, or {"prompt"/"prompt_token_ids": ...}).

        Raises:
            ValueError: bad input; nothing is queued then.
        """
        req, text = self.process(request_id, prompt, params, arrival_time)
        self.add_processed(req, text)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Abort requests (unknown ids ignored); blocks freed and stat loggers told before
        this returns."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        it = IterationStats()
        core_ids = self.output_processor.abort_requests(request_ids, it)
        outs = self.engine_core.abort_requests(core_ids)
        self._record_stats(it, outs.scheduler_stats)

    def unfinished_request_ids(self) -> list[str]:
        """The callers' ids of the requests not finished yet."""
        return self.output_processor.unfinished_request_ids()

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.request_states)

    # ------------------------------------------------------------------------------
    def step(self, timeout: float | None = None) -> list[RequestOutput]:
        """Run (or, out of process, wait up to ``timeout`` s for) one core step; a
        RequestOutput for every request with new tokens (cumulative, plus the delta).

        Raises:
            EngineStepError: the step failed for some requests (they are gone); it
                carries the step's outputs for the others.
            EngineDeadError: the engine core has died.
        """
        outs = self.engine_core.get_output(timeout)
        it = IterationStats()
        processed = self.output_processor.process_outputs(outs.outputs, it)
        for req in processed.reqs_to_add:
            self.engine_core.add_request(req)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        failed, siblings = self.output_processor.fail_requests(outs.failed_request_ids, it)
        self._record_stats(it, outs.scheduler_stats)
        if siblings:   # a parent request fails whole
            self.abort_request(siblings)
        if outs.failed_request_ids:
            raise EngineStepError(outs.error if outs.engine_dead else f"engine step failed: {outs.error}", failed,
                                  processed.request_outputs, outs.engine_dead)
        return processed.request_outputs

    def _record_stats(self, it: IterationStats, stats: SchedulerStats | None) -> None:
        """Hand ``it`` and ``stats`` to the stat loggers; without stats, aborts wait for the
        next record."""
        if stats is None:
            self._unrecorded_aborts += it.num_aborted
            return
        it.num_aborted += self._unrecorded_aborts
        self._unrecorded_aborts = 0
        for sl in self.stat_loggers:
            sl.record(stats, it)

    def token_text(self, token_id: int) -> str:
        """One token's text on its own (cached), as logprobs show it."""
        return self.output_processor.token_text(token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None,
                            chat_template_kwargs: dict | None = None,
                            tools: list[dict] | None = None, tokenizer=None) -> list[int]:
        """``chat.apply_chat_template`` with ``tokenizer`` or the engine's own."""
        return chat.apply_chat_template(tokenizer or self.tokenizer, messages, add_generation_prompt,
                                        chat_template, chat_template_kwargs, tools)

    def reset_prefix_cache(self) -> int:
        """Drop every cached KV block no request holds; returns how many."""
        n = self.engine_core.reset_prefix_cache()
        if self.stat_loggers:  # KV use as it is now: an idle engine takes no step to say it
            self._record_stats(IterationStats(), self.engine_core.get_scheduler_stats())
        return n

    def get_scheduler_stats(self) -> SchedulerStats:
        """Running/waiting requests, KV use, prefix-cache queries and hits, now."""
        return self.engine_core.get_scheduler_stats()

    def check_health(self) -> None:
        """Raises EngineDeadError when the engine core has died (every one, with data parallelism)."""
        self.engine_core.check_health()

    def engine_status(self) -> list[tuple[int, str | None]]:
        """With data parallelism, (engine index, why it died or None) for each engine; else []."""
        return self.engine_core.engine_status()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
