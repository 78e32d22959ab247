"""``POST /v1/completions``: one or several prompts (text or token ids), ``n`` choices
each, whole or streamed (OpenAI's ``text_completion`` chunks, then ``data: [DONE]``)."""
from __future__ import annotations

import asyncio
import dataclasses
import time

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.entrypoints.openai.responses import CompletionFormat, usage
from pagedllm.entrypoints.openai.serving_engine import SSE_DONE, OpenAIServing, sse_error, sse_event
from pagedllm.errors import InvalidParameterError


class OpenAIServingCompletion(OpenAIServing):
    """The completions API over the engine (``OpenAIServing``'s arguments)."""

    async def create_completion(self, body: CompletionRequest, raw: Request):
        """The response to ``body``: a JSON body, an SSE stream, or an error response.

        Raises:
            InvalidParameterError: a bad field (HTTP 400 naming it); nothing is queued.
            EngineDeadError: the engine has died (HTTP 503).
        """
        if (r := self.models.check_model(body.model)) is not None:
            return r
        # echo with max_tokens 0: the prompt (and its logprobs) alone, as OpenAI's legacy API
        # and vLLM answer it (lm-evaluation-harness scores loglikelihoods this way). The
        # engine generates one token, which the response leaves out.
        prompt_only = body.echo and body.max_tokens == 0 and not body.min_tokens
        if prompt_only:
            body = body.model_copy(update={"max_tokens": 1})
        try:
            params = body.to_sampling_params(default_max_tokens=16)
        except InvalidParameterError as e:
            raise body.to_api_error(e) from e
        if body.echo and params.logprobs is not None and params.prompt_logprobs is None:
            params = dataclasses.replace(params, prompt_logprobs=params.logprobs)  # echoed tokens' logprobs
        p = body.prompt
        if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
            prompts = [p]
        else:
            prompts = list(p)
            if not prompts:
                raise InvalidParameterError("prompt", "prompt must not be empty")
        if (r := self.admit(raw, len(prompts) * params.n)) is not None:
            return r
        base, engine_base = self.request_ids(raw, "cmpl")
        self.log_user(body, base)
        created = int(time.time())
        # all prompts are validated before any is queued (a bad one queues nothing)
        try:
            streams = await self.engine.add_requests([(f"{engine_base}-{i}", pr, params)
                                                      for i, pr in enumerate(prompts)])
        except InvalidParameterError as e:
            raise body.to_api_error(e) from e
        fmt = CompletionFormat(body, params, self.engine, prompt_only)
        if body.stream:
            return StreamingResponse(self._stream(streams, base, created, body, fmt, raw.state),
                                     media_type="text/event-stream")
        return await self.with_disconnect(raw, self._full(streams, base, created, fmt, raw.state), streams)

    async def _full(self, streams, base: str, created: int, fmt: CompletionFormat, raw_state) -> dict:
        finals = [fmt.visible(f) for f in await asyncio.gather(*[self.drain(st) for st in streams])]
        self.note_usage(raw_state, finals)
        choices, pt, ct, cached = [], 0, 0, 0
        for i, f in enumerate(finals):
            for c in f.outputs:
                choices.append(await fmt.choice(i * fmt.n + c.index, f, c))
                ct += len(c.token_ids)
            pt += len(f.prompt_token_ids)
            cached += f.num_cached_tokens
        return {"id": base, "object": "text_completion", "created": created,
                "model": self.engine.model_name, "choices": choices, "usage": usage(pt, ct, cached)}

    async def _stream(self, streams, base: str, created: int, body: CompletionRequest, fmt: CompletionFormat,
                      raw_state):
        opts = body.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        model = self.engine.model_name
        pt = ct = cached = 0
        sent_lp: dict[tuple[int, int], int] = {}
        sent_chars: dict[tuple[int, int], int] = {}
        echoed: set[tuple[int, int]] = set()
        latest = [None] * len(streams)
        try:
            async for i, out in self.merged(streams):
                if isinstance(out, BaseException):
                    yield sse_error(out)
                    continue
                out = fmt.visible(out)
                c = next(x for x in out.outputs if x.index == out.delta_index)
                key = (i, c.index)
                text = out.delta_text
                lp = None
                first = key not in echoed
                echoed.add(key)
                if first and body.echo:
                    text = await fmt.prompt_text(out) + text
                if fmt.k is not None:
                    n0 = sent_lp.get(key, 0)
                    part = dataclasses.replace(c, token_ids=c.token_ids[n0:], logprobs=(c.logprobs or [])[n0:])
                    lp = await fmt.logprobs(out, part, first and body.echo, sent_chars.get(key, 0))
                    sent_lp[key] = len(c.token_ids)
                sent_chars[key] = sent_chars.get(key, 0) + len(text)
                done = c.finish_reason is not None
                if text or done or (lp and lp["tokens"]):
                    chunk = {"id": base, "object": "text_completion", "created": created, "model": model,
                             "choices": [{"index": i * fmt.n + c.index, "text": text, "logprobs": lp,
                                          "finish_reason": c.finish_reason if done else None,
                                          "stop_reason": c.stop_reason if done else None}]}
                    if continuous:
                        chunk["usage"] = usage(len(out.prompt_token_ids), len(c.token_ids), out.num_cached_tokens)
                    yield sse_event(chunk)
                latest[i] = out
                self.note_usage(raw_state, latest)
                if out.finished:
                    pt += len(out.prompt_token_ids)
                    ct += sum(len(x.token_ids) for x in out.outputs)
                    cached += out.num_cached_tokens
            if include_usage:
                yield sse_event({"id": base, "object": "text_completion", "created": created, "model": model,
                                 "choices": [], "usage": usage(pt, ct, cached)})
            yield SSE_DONE
        finally:
            for st in streams:
                await st.aclose()
