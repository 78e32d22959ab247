"""``POST /v1/chat/completions``: a conversation rendered with the chat template (in
AsyncLLM's tokenizer threads), ``n`` choices, tool calls (``chat_tools``), whole or
streamed (OpenAI's ``chat.completion.chunk`` deltas, then ``data: [DONE]``)."""
from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagedllm.engine.async_llm import AsyncLLM, RequestStream
from pagedllm.entrypoints.openai.admission import AdmissionControl
from pagedllm.entrypoints.openai.chat_reasoning import ChatReasoning
from pagedllm.entrypoints.openai.chat_tools import ChatTools
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.reasoning import get_reasoning_parser
from pagedllm.entrypoints.openai.responses import chat_logprobs, prompt_logprobs, usage
from pagedllm.entrypoints.openai.serving_engine import SSE_DONE, OpenAIServing, sse_error, sse_event
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.entrypoints.openai.tool_calls import get_tool_parser
from pagedllm.errors import InvalidParameterError
from pagedllm.sampling_params import MAX_N, SamplingParams


class OpenAIServingChat(OpenAIServing):
    """The chat completions API over the engine.

    Args:
        engine, models, admission: as ``OpenAIServing``'s.
        trust_request_chat_template, enable_auto_tool_choice, tool_call_parser,
            reasoning_parser: the ``serve`` flags of those names.

    Raises:
        ValueError: ``enable_auto_tool_choice`` without a known ``tool_call_parser``; an
            unknown ``reasoning_parser``.
    """

    def __init__(self, engine: AsyncLLM, models: OpenAIServingModels, admission: AdmissionControl | None = None,
                 trust_request_chat_template: bool = False, enable_auto_tool_choice: bool = False,
                 tool_call_parser: str | None = None, reasoning_parser: str | None = None):
        super().__init__(engine, models, admission)
        if enable_auto_tool_choice:
            if tool_call_parser is None:
                raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
            get_tool_parser(tool_call_parser)
        if reasoning_parser is not None:
            get_reasoning_parser(reasoning_parser)
        self.reasoning_parser = reasoning_parser
        self.trust_request_chat_template = trust_request_chat_template
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tool_call_parser = tool_call_parser

    async def create_chat_completion(self, body: ChatCompletionRequest, raw: Request):
        """The response to ``body``: a JSON body, an SSE stream, or an error response.

        Raises:
            InvalidParameterError: a bad field (HTTP 400 naming it); nothing is queued.
            EngineDeadError: the engine has died (HTTP 503).
        """
        if (r := self.models.check_model(body.model)) is not None:
            return r
        self.check_request_chat_template(body.chat_template, self.trust_request_chat_template)
        body.check_supported()
        if (r := self.admit(raw, min(max(body.n, 1), MAX_N))) is not None:
            return r
        rid, engine_rid = self.request_ids(raw, "chatcmpl")
        self.log_user(body, rid)
        created = int(time.time())
        tools, params, stream = await self.start(body, engine_rid)
        think = ChatReasoning(self.reasoning_parser, body.chat_template_kwargs, params.structured_outputs is not None)
        headers = {"X-PagedLLM-Warning": tools.note} if tools.note else None
        if body.stream:
            return StreamingResponse(self._stream(stream, rid, created, body, params, tools, think, raw.state),
                                     media_type="text/event-stream", headers=headers)
        result = await self.with_disconnect(raw, self._full(stream, rid, created, params, tools, think, raw.state),
                                            [stream])
        if isinstance(result, dict) and headers:
            return JSONResponse(result, headers=headers)
        return result

    async def start(self, body: ChatCompletionRequest, engine_rid: str
                    ) -> tuple[ChatTools, SamplingParams, RequestStream]:
        """Render ``body``'s conversation with the chat template and queue it as ``engine_rid``:
        (its tools, its sampling parameters, the engine's stream). Also the start of the APIs
        that speak in chat turns (``serving_responses``, ``anthropic/serving_messages``).

        Raises:
            InvalidParameterError: a bad field, named as ``body`` spells it; nothing is queued.
            EngineDeadError: the engine has died.
        """
        forced = None
        try:
            tools = self.chat_tools(body)
            ids = await self.render(body, tools)
            forced = tools.constraint()
            params = body.to_sampling_params(default_max_tokens=None, constraint=forced)
            stream = await self.engine.add_request(engine_rid, ids, params)
        except InvalidParameterError as e:
            if forced is not None and e.param == "structured_outputs":   # the forced call's schema: the tools'
                e = InvalidParameterError("tools", str(e).replace("structured_outputs.json", body.TOOL_SCHEMA))
            raise body.to_api_error(e) from e
        return tools, params, stream

    def chat_tools(self, body: ChatCompletionRequest) -> ChatTools:
        """The tool calling of ``body`` under this server's flags (``ChatTools``' errors)."""
        return ChatTools(body, self.engine, self.enable_auto_tool_choice, self.tool_call_parser)

    async def render(self, body: ChatCompletionRequest, tools: ChatTools) -> list[int]:
        """The prompt token ids of ``body``'s conversation and ``tools``, rendered with the chat
        template in a tokenizer thread.

        Raises:
            InvalidParameterError: a bad message, tool turn, template or template variable.
            EngineDeadError: the engine has died.
        """
        # Checked and reduced to string content by the engine (normalize_chat_messages).
        messages = [m.model_dump() for m in body.messages]   # extra keys (name, ...) reach the template
        messages, tools_kw = tools.render(messages)
        return await self.render_chat(messages, body.add_generation_prompt, body.chat_template,
                                      body.chat_template_kwargs, tools_kw)

    async def _full(self, stream, rid: str, created: int, params, tools: ChatTools, think: ChatReasoning,
                    raw_state) -> dict:
        out = await self.drain(stream)
        self.note_usage(raw_state, [out])
        choices = []
        for c in out.outputs:
            reasoning, answer = think.split(c)
            message, finish = tools.message(answer)
            message = think.message(message, reasoning)
            choices.append({"index": c.index, "message": message,
                            "logprobs": None if c.logprobs is None else chat_logprobs(c.token_ids, c.logprobs,
                                                                                      params.logprobs),
                            "finish_reason": finish, "stop_reason": c.stop_reason})
        resp = {"id": rid, "object": "chat.completion", "created": created, "model": self.engine.model_name,
                "choices": choices,
                "usage": usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs),
                               out.num_cached_tokens, await think.reasoning_tokens(self.engine))}
        if out.prompt_logprobs is not None:
            resp["prompt_logprobs"] = prompt_logprobs(out.prompt_logprobs)
        return resp

    async def _stream(self, stream, rid: str, created: int, body: ChatCompletionRequest, params,
                      tools: ChatTools, think: ChatReasoning, raw_state):
        opts = body.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        model = self.engine.model_name
        n_prompt = cached = 0
        n_out: dict[int, int] = {}

        def chunk(index: int, delta: dict, finish=None, stop_reason=None, lp=None):
            obj = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [{"index": index, "delta": delta, "logprobs": lp,
                                "finish_reason": finish, "stop_reason": stop_reason}]}
            if continuous:
                obj["usage"] = usage(n_prompt, sum(n_out.values()), cached)
            return sse_event(obj)
        try:
            for i in range(params.n):
                yield chunk(i, {"role": "assistant", "content": ""})
            sent_lp: dict[int, int] = {}
            try:
                async for out in stream:
                    n_prompt, cached = len(out.prompt_token_ids), out.num_cached_tokens
                    c = next(x for x in out.outputs if x.index == out.delta_index)
                    n_out[c.index] = len(c.token_ids)
                    lp = None
                    if c.logprobs is not None:
                        n0 = sent_lp.get(c.index, 0)
                        if len(c.token_ids) > n0:
                            lp = chat_logprobs(c.token_ids[n0:], c.logprobs[n0:], params.logprobs)
                        sent_lp[c.index] = len(c.token_ids)
                    done = c.finish_reason is not None
                    deltas = think.stream(c.index, out.delta_text, done, tools.stream)
                    for j, d in enumerate(deltas):
                        yield chunk(c.index, d, lp=lp if j == len(deltas) - 1 else None)
                    if not deltas and lp is not None:
                        yield chunk(c.index, {}, lp=lp)
                    if done:
                        yield chunk(c.index, {}, tools.finish_reason(c), c.stop_reason)
                    self.note_usage(raw_state, [out])
                    if out.finished and include_usage:
                        yield sse_event({"id": rid, "object": "chat.completion.chunk", "created": created,
                                         "model": model, "choices": [],
                                         "usage": usage(n_prompt, sum(len(x.token_ids) for x in out.outputs),
                                                        cached, await think.reasoning_tokens(self.engine))})
            except Exception as e:  # noqa: BLE001
                yield sse_error(e)
            yield SSE_DONE
        finally:
            await stream.aclose()
