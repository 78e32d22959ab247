"""Offline batch generation: ``LLM(...).generate(prompts, sampling_params)``."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.chat_tools import render_chat_tools
from pagedllm.entrypoints.openai.tool_calls import validate_tools
from pagedllm.errors import InvalidParameterError
from pagedllm.logger import configure_default_logging
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams


class LLM:
    """An engine for offline use.

    Args:
        model: a ``.gguf`` file or HF directory; None = the bundled SmolLM2-135M-Instruct.
        log_stats: log throughput, queue, KV use and prefix-cache hit rate every 10 s.
        **kwargs: any EngineArgs field (``dtype``, ``max_model_len``, ``kv_cache_memory``,
            ``kv_cache_dtype``, ...; docs/configuration.md).

    Raises:
        ValueError: an unknown keyword or a bad setting (named in the message).
    """

    def __init__(self, model: str | None = None, log_stats: bool = False, **kwargs):
        names = {f.name for f in dataclasses.fields(EngineArgs)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown LLM argument(s): {', '.join(unknown)}")
        configure_default_logging()   # the start-up lines reach stderr, as vLLM's do
        self.llm_engine = LLMEngine(EngineArgs(model=model, **kwargs), log_stats=log_stats)

    @property
    def tokenizer(self):
        return self.llm_engine.tokenizer

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, cache_salt: str | None = None) -> list[RequestOutput]:
        """Generate for every prompt; returns outputs in the order of ``prompts``.

        Args:
            prompts: a string, a list of strings, a list of token-id lists, or dicts with
                "prompt" or "prompt_token_ids".
            sampling_params: one for all or one per prompt (default SamplingParams()).
            use_tqdm: show a progress bar.
            cache_salt: prefix-cache salt for every prompt that sets none itself.

        Raises:
            ValueError: a bad prompt or parameter (nothing is generated then).
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                 and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise InvalidParameterError(
                "prompts", f"prompts must be a string, a list of token ids, a dict, or a list of "
                           f"those; got {type(prompts).__name__}")
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            # checked here, not only per request: cache_salt below reads each one's fields
            got = type(sampling_params).__name__
            if isinstance(sampling_params, (list, tuple)):
                others = {type(p).__name__ for p in sampling_params if not isinstance(p, SamplingParams)}
                got = f"{got} of {', '.join(sorted(others))}" if others else None
            if got is not None:
                raise InvalidParameterError("sampling_params",
                                            f"sampling_params must be a SamplingParams or a list of them, got {got}")
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        if cache_salt is not None:
            params = [p if p.cache_salt else dataclasses.replace(p, cache_salt=cache_salt) for p in params]
        return self._run(prompts, params, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None, cache_salt: str | None = None,
             chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> list[RequestOutput]:
        """Replies to one conversation (a list of {"role", "content"} dicts) or a list of them,
        rendered with the model's chat template (or ``chat_template``) and
        ``chat_template_kwargs``.

        ``tools`` (OpenAI function tools, as in a chat request) and the conversations' tool
        turns (assistant ``tool_calls``, ``tool`` results) are rendered as the server renders
        them: through the template's ``tools`` variable, or as Hermes text where the template
        has none. Calls are not parsed out of the outputs.

        Raises:
            ValueError: malformed messages, tools (naming ``tools``), tool turns or
                chat_template_kwargs, or no chat template; nothing is queued then.
        """
        checked = validate_tools(tools)
        template = chat_template if chat_template is not None else self.llm_engine.tokenizer.chat_template
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        ids = []
        for k, conv in enumerate(convs):
            try:
                conv, tools_kw, _, _ = render_chat_tools(conv, checked, template)
                ids.append(self.llm_engine.apply_chat_template(conv, add_generation_prompt, chat_template,
                                                               chat_template_kwargs, tools_kw))
            except InvalidParameterError as e:
                if len(convs) == 1:
                    raise
                raise InvalidParameterError(e.param, f"conversation {k}: {e}") from e
        return self.generate([{"prompt_token_ids": i} for i in ids], sampling_params, use_tqdm, cache_salt)

    def _run(self, prompts, params, use_tqdm: bool) -> list[RequestOutput]:
        eng = self.llm_engine
        # Validate everything first so a bad prompt queues nothing.
        processed = [eng.process(eng.next_request_id(), p, sp) for p, sp in zip(prompts, params)]
        order = {req.request_id: i for i, (req, _) in enumerate(processed)}
        for req, text in processed:
            eng.add_processed(req, text)
        results: list[RequestOutput | None] = [None] * len(processed)
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(processed), desc="Processed prompts", dynamic_ncols=True)
        try:
            while eng.has_unfinished_requests():
                for out in eng.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            eng.abort_request(list(order))
            raise
        finally:
            if bar is not None:
                bar.close()
        return results

    def reset_prefix_cache(self) -> int:
        """Drop every cached KV block that no request holds; returns how many."""
        return self.llm_engine.reset_prefix_cache()

    def stats(self):
        """Scheduler statistics (running/waiting, KV use, prefix-cache queries and hits)."""
        return self.llm_engine.get_scheduler_stats()

    def shutdown(self) -> None:
        self.llm_engine.shutdown()
