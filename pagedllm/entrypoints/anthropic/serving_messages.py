"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` over the chat pipeline: the
request becomes a chat request (``protocol``) that ``OpenAIServingChat`` renders and whose
``ChatTools`` constrain and read the tool calls; the answer is content blocks (``text``,
``tool_use``; ``thinking`` with ``--reasoning-parser``), a ``stop_reason`` and ``usage``, whole or as Anthropic's server-sent events
(``message_start``, ``ping``, ``content_block_start`` / ``_delta`` / ``_stop``,
``message_delta``, ``message_stop``; ``error`` when the stream fails). Usage counts as
Anthropic's does: ``input_tokens`` are the prompt tokens not read from the prefix cache,
``cache_read_input_tokens`` those read from it."""
from __future__ import annotations

import json

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.anthropic.errors import stream_error_body
from pagedllm.entrypoints.anthropic.protocol import CountTokensRequest, MessagesChatRequest, MessagesRequest
from pagedllm.entrypoints.openai.admission import AdmissionControl
from pagedllm.entrypoints.openai.chat_reasoning import ChatReasoning
from pagedllm.entrypoints.openai.chat_tools import ChatTools
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.errors import InvalidParameterError
from pagedllm.outputs import CompletionOutput, RequestOutput


def event(name: str, obj: dict) -> str:
    """One server-sent event named ``name`` carrying ``obj`` as JSON."""
    return f"event: {name}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage(out: RequestOutput, output_tokens: int) -> dict:
    """Anthropic's ``usage`` of ``out`` (no cache writes: prefix caching is automatic)."""
    cached = out.num_cached_tokens
    return {"input_tokens": len(out.prompt_token_ids) - cached, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def stop_reason(finish: str | None, stop: int | str | None) -> tuple[str | None, str | None]:
    """(``stop_reason``, ``stop_sequence``) of a chat finish reason and the engine's stop reason."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return ("end_turn" if finish == "stop" else None), None


def tool_use_id(call_id: str) -> str:
    """A ``toolu_`` id for a chat call id (``call_`` + random letters and digits)."""
    return "toolu_" + call_id.removeprefix("call_")


def message_blocks(tools: ChatTools, think: ChatReasoning, c: CompletionOutput) -> tuple[list[dict], str | None]:
    """(content blocks, chat finish reason) of a finished completion: its reasoning as a
    ``thinking`` block (with ``--reasoning-parser``), then the answer's text (none when empty),
    then the tool calls read from the answer."""
    reasoning, answer = think.split(c)
    message, finish = tools.message(answer)
    blocks = [{"type": "thinking", "thinking": reasoning, "signature": ""}] if reasoning else []
    blocks += [{"type": "text", "text": message["content"]}] if message["content"] else []
    blocks += [{"type": "tool_use", "id": tool_use_id(tc["id"]), "name": tc["function"]["name"],
                "input": json.loads(tc["function"]["arguments"])} for tc in message.get("tool_calls") or ()]
    return blocks, finish


class BlockEvents:
    """The content-block events of one streamed completion, from its chat deltas
    (``ChatTools.stream``): text into a ``text`` block (``text_delta``), each call a
    ``tool_use`` block (its id and name, then its arguments as ``input_json_delta``). The
    text of one list of deltas goes before its calls, as in the whole message (calls are only
    sent once the completion has ended)."""

    def __init__(self):
        self.index = -1
        self.open: str | None = None

    def _start(self, block: dict) -> list[str]:
        events = self.close()
        self.index += 1
        self.open = block["type"]
        return events + [event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                       "content_block": block})]

    def _delta(self, delta: dict) -> str:
        return event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def close(self) -> list[str]:
        """The stop event of the open block, if any."""
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def feed(self, deltas: list[dict]) -> list[str]:
        """The events of one list of chat deltas (reasoning first: a ``thinking`` block)."""
        out = []
        thinking = "".join(d.get("reasoning_content") or "" for d in deltas)
        if thinking:
            if self.open != "thinking":
                out += self._start({"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": thinking}))
        text = "".join(d.get("content") or "" for d in deltas)
        if text:
            if self.open != "text":
                out += self._start({"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": text}))
        for d in deltas:
            for tc in d.get("tool_calls") or ():
                if "id" in tc:
                    out += self._start({"type": "tool_use", "id": tool_use_id(tc["id"]),
                                        "name": tc["function"]["name"], "input": {}})
                elif tc["function"].get("arguments"):
                    out.append(self._delta({"type": "input_json_delta", "partial_json": tc["function"]["arguments"]}))
        return out


class AnthropicServingMessages(OpenAIServing):
    """The Messages API over the engine.

    Args:
        engine, models, admission: as ``OpenAIServing``'s.
        chat: the server's chat serving object (its tool-call flags and its rendering).
    """

    def __init__(self, engine: AsyncLLM, models: OpenAIServingModels, admission: AdmissionControl | None,
                 chat: OpenAIServingChat):
        super().__init__(engine, models, admission)
        self.chat = chat

    def _chat_request(self, body: CountTokensRequest, generating: bool = True) -> MessagesChatRequest:
        """The chat request of ``body``, checked against this server's flags."""
        if body.thinking_enabled and self.chat.reasoning_parser is None:
            raise InvalidParameterError("thinking", f"thinking of type {body.thinking.type!r} needs a reasoning "
                                                    "parser, and this server runs without --reasoning-parser")
        chat_body = body.to_chat_request()
        if (generating and chat_body.tools and chat_body.tool_choice in (None, "auto")
                and not self.chat.enable_auto_tool_choice):
            raise InvalidParameterError("tool_choice", 'tool_choice "auto" (the default with tools) needs the server '
                                                       "to run with --enable-auto-tool-choice and --tool-call-parser; "
                                                       'send tool_choice {"type": "any"}, {"type": "tool", "name": '
                                                       '...} or {"type": "none"}')
        return chat_body

    async def count_tokens(self, body: CountTokensRequest):
        """``{"input_tokens": N}``: the length of the prompt ``create_message`` would render
        for ``body``, or a 404 for another model.

        Raises:
            InvalidParameterError: a bad field (HTTP 400 naming it).
        """
        if (r := self.models.check_model(body.model)) is not None:
            return r
        chat_body = self._chat_request(body, generating=False)
        if chat_body.tools and chat_body.tool_choice in (None, "auto") and not self.chat.enable_auto_tool_choice:
            # the prompt is the same under any tool_choice; counting does not need a call parser
            chat_body = chat_body.model_copy(update={"tool_choice": "none"})
        try:
            return {"input_tokens": len(await self.chat.render(chat_body, self.chat.chat_tools(chat_body)))}
        except InvalidParameterError as e:
            raise chat_body.to_api_error(e) from e

    async def create_message(self, body: MessagesRequest, raw: Request):
        """The response to ``body``: a JSON message, an SSE stream, or an error response.

        Raises:
            InvalidParameterError: a bad field (HTTP 400 naming it); nothing is queued.
            EngineDeadError: the engine has died (HTTP 503).
        """
        if (r := self.models.check_model(body.model)) is not None:
            return r
        if (r := self.admit(raw, 1)) is not None:
            return r
        _, engine_rid = self.request_ids(raw, "msg")
        rid = f"msg_{raw.state.request_id}"
        chat_body = self._chat_request(body)
        self.log_user(chat_body, rid)
        tools, params, stream = await self.chat.start(chat_body, engine_rid)
        think = ChatReasoning(self.chat.reasoning_parser, chat_body.chat_template_kwargs,
                              params.structured_outputs is not None)
        headers = {"X-PagedLLM-Warning": tools.note} if tools.note else None
        if body.stream:
            return StreamingResponse(self._stream(stream, rid, tools, think, raw.state),
                                     media_type="text/event-stream", headers=headers)
        result = await self.with_disconnect(raw, self._full(stream, rid, tools, think, raw.state), [stream])
        return JSONResponse(result, headers=headers) if isinstance(result, dict) else result

    def _message(self, rid: str, content: list[dict], reason: str | None, sequence: str | None, use: dict) -> dict:
        return {"id": rid, "type": "message", "role": "assistant", "model": self.engine.model_name,
                "content": content, "stop_reason": reason, "stop_sequence": sequence, "usage": use}

    async def _full(self, stream, rid: str, tools: ChatTools, think: ChatReasoning, raw_state) -> dict:
        out = await self.drain(stream)
        self.note_usage(raw_state, [out])
        c = out.outputs[0]
        blocks, finish = message_blocks(tools, think, c)
        return self._message(rid, blocks, *stop_reason(finish, c.stop_reason), usage(out, len(c.token_ids)))

    async def _stream(self, stream, rid: str, tools: ChatTools, think: ChatReasoning, raw_state):
        blocks = BlockEvents()
        started = False
        try:
            try:
                async for out in stream:
                    c = out.outputs[0]
                    if not started:   # the first output knows how much of the prompt was cached
                        started = True
                        yield event("message_start", {"type": "message_start",
                                                      "message": self._message(rid, [], None, None, usage(out, 0))})
                        yield event("ping", {"type": "ping"})
                    done = c.finish_reason is not None
                    for e in blocks.feed(think.stream(c.index, out.delta_text, done, tools.stream)):
                        yield e
                    self.note_usage(raw_state, [out])
                    if done:
                        for e in blocks.close():
                            yield e
                        reason, sequence = stop_reason(tools.finish_reason(c), c.stop_reason)
                        yield event("message_delta", {"type": "message_delta",
                                                      "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                                      "usage": usage(out, len(c.token_ids))})
                        yield event("message_stop", {"type": "message_stop"})
            except Exception as e:  # noqa: BLE001
                yield event("error", stream_error_body(e))
        finally:
            await stream.aclose()
