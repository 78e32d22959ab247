"""LLMEngine: the synchronous front end. It talks to the engine core only through an
``EngineCoreClient`` (typed messages: ``EngineCoreRequest`` in, ``EngineCoreOutputs`` out).

It owns the tokenizer, the Processor (validation), the per-request detokenizers and
stop-string matching, and the stat loggers; ``step()`` runs one core step and returns
RequestOutputs.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import time

import msgspec

from pagedllm.config import EngineArgs, EngineConfig
from pagedllm.engine.core_client import EngineCoreClient
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.metrics import FinishedRequestStats, IterationStats, LoggingStatLogger
from pagedllm.engine.processor import Processor
from pagedllm.errors import InvalidParameterError, check_unicode
from pagedllm.messages import (FINISH_ABORT, FINISH_STOP, EngineCoreOutput, EngineCoreRequest, SchedulerStats,
                               TokenLogprobs)
from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import eos_token_ids, get_tokenizer

logger = logging.getLogger("pagedllm")


class _ReqState:
    """A sequence the front end follows: a request, or one of the n of a parent request.

    ``request_id`` is the core's id; ``public_id`` the caller's (the parent's for a child);
    ``index`` the sequence's place among its parent's n (0 otherwise)."""

    __slots__ = ("request_id", "prompt", "prompt_token_ids", "detok", "token_ids", "finish_reason",
                 "stop_reason", "metrics", "last_token_time", "num_cached_tokens", "public_id", "index",
                 "logprobs", "prompt_logprobs", "cumulative_logprob", "want_logprobs", "want_prompt_logprobs")

    def __init__(self, req: EngineCoreRequest, prompt: str | None, detok: IncrementalDetokenizer,
                 public_id: str | None = None, index: int = 0):
        self.request_id = req.request_id
        self.public_id = req.request_id if public_id is None else public_id
        self.index = index
        sp = req.sampling_params
        self.want_logprobs = sp.logprobs is not None
        self.want_prompt_logprobs = sp.prompt_logprobs is not None
        self.logprobs: list[dict[int, Logprob]] | None = [] if self.want_logprobs else None
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = [None] if self.want_prompt_logprobs else None
        self.cumulative_logprob: float | None = 0.0 if self.want_logprobs else None
        self.prompt = prompt
        self.prompt_token_ids = req.prompt_token_ids
        self.detok = detok
        self.token_ids: list[int] = []
        self.finish_reason = None
        self.stop_reason = None
        self.metrics = RequestMetrics(arrival_time=req.arrival_time)
        self.last_token_time: float | None = None
        self.num_cached_tokens = 0


class _ParentState:
    """A request with ``n`` > 1: its n sequences run as child requests ``"{i}_{id}"``.

    Sequence 0 goes to the core first; the others wait in ``pending`` until its prompt is
    computed (its first token arrives), so that they find the prompt's full blocks in the
    prefix cache: the prompt is prefilled once, its blocks shared."""

    __slots__ = ("request_id", "children", "pending", "finished")

    def __init__(self, request_id: str, children: list[str]):
        self.request_id = request_id
        self.children = children
        self.pending: list[tuple[EngineCoreRequest, str | None]] = []
        self.finished: dict[int, CompletionOutput] = {}


# Message roles of OpenAI's chat API.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def normalize_chat_messages(messages) -> list[dict]:
    """Check a conversation and give each message string ``content``, as chat templates
    expect: an array of text parts is joined, and an assistant message without content
    (as after a tool call in OpenAI's API) gets ``""``. Other keys (``name``,
    ``tool_calls``, ...) are kept for the template.

    Raises:
        InvalidParameterError(param="messages"): not a non-empty list of objects; a role
            outside CHAT_ROLES; content missing or null on a non-assistant message; content
            neither a string nor an array of text parts; a lone UTF-16 surrogate in it.
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidParameterError("messages", "messages must be a non-empty list")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise InvalidParameterError("messages", f"messages[{i}] must be an object")
        role = msg.get("role")
        if role not in CHAT_ROLES:
            raise InvalidParameterError("messages", f"messages[{i}].role must be one of "
                                                    f"{', '.join(CHAT_ROLES)}; got {role!r}")
        content = msg.get("content")
        if content is None:
            if role != "assistant":
                raise InvalidParameterError("messages", f"messages[{i}].content is required for a "
                                                        f"message with role '{role}'")
            content = ""
        elif isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise InvalidParameterError("messages", f"messages[{i}].content: only text content parts "
                                                        '({"type": "text", "text": ...}) are supported')
            content = "".join(p["text"] for p in content)
        elif not isinstance(content, str):
            raise InvalidParameterError("messages", f"messages[{i}].content must be a string or an array "
                                                    f"of text parts, got {type(content).__name__}")
        check_unicode("messages", content)
        out.append({**msg, "content": content})
    return out


class EngineStepError(RuntimeError):
    """A step failed in the engine core; its requests are gone (their KV blocks freed).

    Attributes:
        request_ids: the failed requests; outputs: RequestOutputs the same step produced
            for other requests (to deliver before handling the failure).
    """

    def __init__(self, message: str, request_ids: list[str], outputs: list[RequestOutput]):
        super().__init__(message)
        self.request_ids = request_ids
        self.outputs = outputs


class LLMEngine:
    """Args:
        args: EngineArgs. ``stat_loggers``: extra objects with ``record(SchedulerStats,
        IterationStats)`` (e.g. the Prometheus logger); a logging one is always added.
    """

    def __init__(self, args: EngineArgs, stat_loggers: list | None = None, log_stats: bool = True):
        self.config = EngineConfig.from_args(args)
        self.tokenizer = get_tokenizer(self.config.model_path)
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.config.arch.eos_token_ids,
                                           self.config.model_path)
        self.engine_core = EngineCoreClient.make_client(self.config)
        self.processor = Processor(self.tokenizer, self.config.arch.vocab_size, self.max_model_len,
                                   self.eos_token_ids, args.max_num_batched_tokens,
                                   args.enable_chunked_prefill)
        self.states: dict[str, _ReqState] = {}
        self.parents: dict[str, _ParentState] = {}
        self._token_text: dict[int, str] = {}
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

    def next_request_id(self) -> str:
        self._counter += 1
        return str(self._counter)

    # ------------------------------------------------------------------------------
    def process(self, request_id: str, prompt, params: SamplingParams | None,
                arrival_time: float | None = None,
                processor: Processor | None = None) -> tuple[EngineCoreRequest, str | None]:
        """Validate and tokenize (safe to call from another thread than ``step``; threads
        that tokenize concurrently each pass their own ``processor``, from
        ``tokenizer_copy``).

        Raises:
            ValueError: bad prompt or parameters (the message names which).
        """
        return (processor or self.processor).process(request_id, prompt, params, arrival_time)

    def tokenizer_copy(self) -> tuple[object, Processor]:
        """A copy of the tokenizer and a Processor over it, for a thread that tokenizes
        beside others (a fast tokenizer must not be used by two threads at once)."""
        tok = copy.deepcopy(self.tokenizer)
        proc = copy.copy(self.processor)
        proc.tokenizer = tok
        return tok, proc

    def add_processed(self, req: EngineCoreRequest, prompt_text: str | None) -> None:
        """Send a processed request to the core.

        Raises:
            ValueError: ``request_id`` belongs to a request that is still alive.
        """
        rid = req.request_id
        if rid in self.states or rid in self.parents:
            raise ValueError(f"request_id {rid!r} is already in use")
        sp = req.sampling_params
        if sp.n == 1:
            self._add_sequence(req, prompt_text)
            return
        children = [f"{i}_{rid}" for i in range(sp.n)]
        if any(c in self.states for c in children):
            raise ValueError(f"request_id {rid!r} is already in use")
        parent = self.parents[rid] = _ParentState(rid, children)
        wait = self.config.args.enable_prefix_caching and sp.prompt_logprobs is None
        for i, cid in enumerate(children):
            seed = None if sp.seed is None else (sp.seed + i + 2**63) % 2**64 - 2**63
            child = msgspec.structs.replace(req, request_id=cid,
                                            sampling_params=dataclasses.replace(sp, n=1, best_of=None, seed=seed))
            if i == 0 or not wait:
                self._add_sequence(child, prompt_text, rid, i)
            else:
                self._add_sequence(child, prompt_text, rid, i, send=False)
                parent.pending.append(child)

    def _add_sequence(self, req: EngineCoreRequest, prompt_text: str | None, public_id: str | None = None,
                      index: int = 0, send: bool = True) -> None:
        sp = req.sampling_params
        detok = IncrementalDetokenizer(self.tokenizer, sp.stop_strings, sp.include_stop_str_in_output,
                                       sp.skip_special_tokens, sp.min_tokens)
        if send:
            self.engine_core.add_request(req)
        self.states[req.request_id] = _ReqState(req, prompt_text, detok, public_id, index)

    def _release_pending(self, public_id: str) -> None:
        """Send a parent's waiting sequences to the core (its first sequence's prompt is
        computed, or it ended before that)."""
        parent = self.parents.get(public_id)
        if parent is not None and parent.pending:
            for child in parent.pending:
                if child.request_id in self.states:
                    self.engine_core.add_request(child)
            parent.pending = []

    def _core_ids(self, request_ids) -> list[str]:
        """The core's ids of the callers' ``request_ids`` (a parent's: its children's)."""
        out = []
        for rid in request_ids:
            parent = self.parents.get(rid)
            out.extend(parent.children if parent is not None else [rid])
        return out

    def unfinished_request_ids(self) -> list[str]:
        """The callers' ids of the requests not finished yet."""
        return list(dict.fromkeys(st.public_id for st in self.states.values()))

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a prompt (string, token-id list, or {"prompt"/"prompt_token_ids": ...}).

        Raises:
            ValueError: bad input; nothing is queued then.
        """
        req, text = self.process(request_id, prompt, params, arrival_time)
        self.add_processed(req, text)

    def abort_request(self, request_ids) -> None:
        """Abort requests; their KV blocks are freed before this returns. The stat loggers
        see the aborts (``finished_reason="abort"``) and the freed state at once: an idle
        engine takes no further step that would refresh them."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        core_ids = self._core_ids(request_ids)   # a parent's children, so before it is dropped
        for rid in request_ids:
            if rid in self.parents:
                self.parents.pop(rid).pending = []
        outs = self.engine_core.abort_requests(core_ids)
        it = IterationStats()
        for rid in core_ids:
            if self.states.pop(rid, None) is not None:
                it.num_aborted += 1
        self._record_stats(it, outs.scheduler_stats)

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    # ------------------------------------------------------------------------------
    def step(self, timeout: float | None = None) -> list[RequestOutput]:
        """Run one engine step (or, with the core in its own process, take its next
        step's outputs, waiting up to ``timeout`` seconds; None = until they come); returns
        a RequestOutput for every request that got new tokens (cumulative text/tokens, plus
        the delta since its previous output).

        Raises:
            EngineStepError: the step failed for some requests (they are gone); it
                carries the step's outputs for the others.
            EngineDeadError: the engine core has died.
        """
        outs = self.engine_core.get_output(timeout)
        it = IterationStats()
        results = self._process_outputs(outs.outputs, it)
        failed = []
        for rid in outs.failed_request_ids:
            st = self.states.pop(rid, None)
            if st is not None:
                it.num_aborted += 1
                if st.public_id not in failed:
                    failed.append(st.public_id)
        siblings = [c for pid in failed if pid in self.parents for c in self.parents[pid].children
                    if c in self.states]
        self._record_stats(it, outs.scheduler_stats)
        if siblings:   # a parent request fails whole
            self.abort_request(siblings)
        for pid in failed:
            self.parents.pop(pid, None)
        if outs.failed_request_ids:
            raise EngineStepError(f"engine step failed: {outs.error}", failed, results)
        return results

    def _record_stats(self, it: IterationStats, stats: SchedulerStats | None) -> None:
        """Hand ``it`` to the stat loggers with the scheduler's ``stats``. Without stats
        (an abort sent to a core in its own process, whose news comes later) the aborts are
        kept and counted with the next step's record, so none is lost."""
        if stats is None:
            self._unrecorded_aborts += it.num_aborted
            return
        it.num_aborted += self._unrecorded_aborts
        self._unrecorded_aborts = 0
        if not self.stat_loggers:
            return
        for sl in self.stat_loggers:
            sl.record(stats, it)

    def _process_outputs(self, core_outs: list[EngineCoreOutput], it: IterationStats) -> list[RequestOutput]:
        now = time.time()
        results = []
        stop_aborts = []
        for co in core_outs:
            st = self.states.get(co.request_id)
            if st is None:
                continue
            new_ids = co.new_token_ids
            n_before = st.detok.num_tokens
            # the core finishes a request with "stop" only on an EOS or stop token id, the
            # last of its new tokens (stop strings are matched here)
            matched = st.detok.update(new_ids, stop_terminated=co.finish_reason == FINISH_STOP)
            if matched is not None:
                # a stop string inside a chunk of several tokens (speculative decoding):
                # the tokens after it are dropped, never returned
                new_ids = new_ids[: st.detok.num_tokens - n_before]
            st.token_ids.extend(new_ids)
            if st.want_logprobs and co.new_logprobs:
                for e in co.new_logprobs[: len(new_ids)]:
                    st.logprobs.append(self._logprob_dict(e))
                    st.cumulative_logprob += e.logprobs[0]
            if st.want_prompt_logprobs and co.new_prompt_logprobs:
                st.prompt_logprobs.extend(self._logprob_dict(e) for e in co.new_prompt_logprobs)
            if st.index == 0 and (new_ids or co.finish_reason is not None):
                self._release_pending(st.public_id)
            it.num_generation_tokens += len(new_ids)
            m = st.metrics
            m.first_scheduled_time = co.scheduled_time
            m.num_preemptions = co.num_preemptions
            st.num_cached_tokens = co.num_cached_tokens
            if new_ids:
                if m.first_token_time is None:
                    m.first_token_time = co.first_token_time or now
                    it.ttfts.append(m.first_token_time - m.arrival_time)
                    # the whole prompt, prefix-cached tokens included (as vLLM, and as the
                    # request's usage.prompt_tokens), counted once per request
                    it.num_prompt_tokens += len(st.prompt_token_ids)
                elif st.last_token_time is not None:
                    it.itls.append(now - st.last_token_time)
                st.last_token_time = now
            finish, stop_reason = co.finish_reason, co.stop_reason
            if matched is not None and finish is None:
                finish, stop_reason = FINISH_STOP, matched
                stop_aborts.append(co.request_id)
            elif matched is not None:
                finish, stop_reason = FINISH_STOP, matched
            finished = finish is not None
            if finished:
                m.finished_time = co.finished_time or now
                st.finish_reason, st.stop_reason = finish, stop_reason
                self.states.pop(co.request_id, None)
                if finish != FINISH_ABORT:
                    self._record_finished(st, co, it)
                else:
                    it.num_aborted += 1
            delta = st.detok.delta(finished)
            results.append(self._make_output(st, finished, delta, new_ids))
        if stop_aborts:
            self.engine_core.abort_requests(stop_aborts)
        return results

    def _record_finished(self, st: _ReqState, co: EngineCoreOutput, it: IterationStats) -> None:
        m = st.metrics
        sched = m.first_scheduled_time or m.arrival_time
        first = m.first_token_time or m.finished_time
        it.finished.append(FinishedRequestStats(
            finish_reason=st.finish_reason, e2e=m.finished_time - m.arrival_time,
            queue=sched - m.arrival_time, prefill=first - sched, decode=m.finished_time - first,
            ttft=first - m.arrival_time, num_prompt_tokens=len(st.prompt_token_ids),
            num_generation_tokens=len(st.token_ids), num_preemptions=m.num_preemptions))

    def _logprob_dict(self, e: TokenLogprobs) -> dict[int, Logprob]:
        """vLLM's per-position shape: token id -> Logprob, the chosen token first."""
        d: dict[int, Logprob] = {}
        for j, (t, lp) in enumerate(zip(e.token_ids, e.logprobs)):
            if t not in d:
                d[t] = Logprob(lp, e.rank if j == 0 else j, self.token_text(t))
        return d

    def token_text(self, token_id: int) -> str:
        """One token's text on its own (cached), as logprobs show it."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def _completion(self, st: _ReqState, finished: bool) -> CompletionOutput:
        return CompletionOutput(st.index, st.detok.text if finished else st.detok.text[: st.detok.sent],
                                list(st.token_ids), st.finish_reason, st.stop_reason,
                                None if st.logprobs is None else list(st.logprobs), st.cumulative_logprob)

    def _make_output(self, st: _ReqState, finished: bool, delta: str, delta_ids: list[int]) -> RequestOutput:
        """The caller's view after news of sequence ``st``. For a parent request, the
        output carries that sequence's completion (its ``index`` says which) and is
        ``finished`` once all n are; the finished output lists all n, by index."""
        comp = self._completion(st, finished)
        outputs = [comp]
        parent = self.parents.get(st.public_id)
        if parent is not None:
            if finished:
                parent.finished[st.index] = comp
            finished = len(parent.finished) == len(parent.children)
            if finished:
                outputs = [parent.finished[i] for i in range(len(parent.children))]
                self.parents.pop(st.public_id, None)
        return RequestOutput(st.public_id, st.prompt, st.prompt_token_ids, outputs, finished,
                             st.metrics, st.num_cached_tokens, delta, list(delta_ids),
                             prompt_logprobs=None if st.prompt_logprobs is None else list(st.prompt_logprobs),
                             delta_index=st.index)

    # ------------------------------------------------------------------------------
    # Names of transformers' apply_chat_template itself, or variables it sets for the
    # template: a chat_template_kwargs key may not override them.
    _RESERVED_TEMPLATE_KWARGS = frozenset({
        "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "padding", "truncation", "max_length",
        "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None,
                            chat_template_kwargs: dict | None = None,
                            tools: list[dict] | None = None, tokenizer=None) -> list[int]:
        """Render a conversation with the model's chat template and tokenize it (with
        ``tokenizer``, a ``tokenizer_copy`` of this thread's, else the engine's own).

        ``tools``: OpenAI tool definitions, passed to the template as its ``tools``
        variable (for a template that can show them; see ``tool_calls.rendering``).

        Args:
            chat_template_kwargs: extra variables for the template (as vLLM's field of the
                same name), e.g. ``{"enable_thinking": False}`` for Qwen3's template; a
                template that does not use a variable ignores it.

        Raises:
            ValueError: the model has no chat template, or it fails to render.
            InvalidParameterError: malformed ``messages`` (see normalize_chat_messages);
                ``chat_template_kwargs`` is not an object with string
                keys, or sets a name the renderer owns (``messages``, ``tokenize``, ...).
        """
        messages = normalize_chat_messages(messages)
        if not isinstance(chat_template_kwargs, (dict, type(None))) or not all(
                isinstance(k, str) for k in chat_template_kwargs or {}):
            raise InvalidParameterError("chat_template_kwargs", "chat_template_kwargs must be an object "
                                                                "with string keys")
        extra = dict(chat_template_kwargs or {})
        reserved = sorted(self._RESERVED_TEMPLATE_KWARGS & extra.keys())
        if reserved:
            raise InvalidParameterError("chat_template_kwargs",
                                        f"chat_template_kwargs may not set {', '.join(reserved)}")
        tok = tokenizer or self.tokenizer
        if chat_template is None and not getattr(tok, "chat_template", None):
            raise ValueError("this model has no chat template; use the completions endpoint")
        try:
            if tools:
                extra["tools"] = tools
            text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False, chat_template=chat_template, **extra)
        except TypeError as e:   # e.g. a chat_template_kwargs key the renderer takes itself
            if extra:
                raise InvalidParameterError("chat_template_kwargs",
                                            f"cannot apply the chat template with chat_template_kwargs: {e}") from e
            raise ValueError(f"cannot apply the chat template: {e}") from e
        except Exception as e:   # jinja2 syntax/undefined errors, a template's raise_exception
            raise ValueError(f"cannot apply the chat template: {e}") from e
        return tok.encode(text, add_special_tokens=False)

    def reset_prefix_cache(self) -> int:
        n = self.engine_core.reset_prefix_cache()
        if self.stat_loggers:  # KV use as it is now: an idle engine takes no step to say it
            self._record_stats(IterationStats(), self.engine_core.get_scheduler_stats())
        return n

    def get_scheduler_stats(self) -> SchedulerStats:
        """Running/waiting requests, KV use, prefix-cache queries and hits, now."""
        return self.engine_core.get_scheduler_stats()

    def check_health(self) -> None:
        """Raises EngineDeadError when the engine core has died."""
        self.engine_core.check_health()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
