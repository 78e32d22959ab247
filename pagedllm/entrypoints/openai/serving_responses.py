"""OpenAI's Responses API: ``POST /v1/responses`` (whole, or streamed as the API's typed
events), ``GET`` and ``DELETE /v1/responses/{id}``. A request is read as a chat request
(``responses_protocol``) and started by ``OpenAIServingChat.start``: the same template,
tool calls, structured outputs and stop rules. Finished responses with ``store`` go to a
``ResponseStore``, from which ``previous_response_id`` continues a conversation."""
from __future__ import annotations

import copy
import json
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.admission import AdmissionControl
from pagedllm.entrypoints.openai.chat_reasoning import ChatReasoning
from pagedllm.entrypoints.openai.chat_tools import ChatTools
from pagedllm.entrypoints.openai.errors import error_response, stream_error_body
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest, chat_error_as_responses
from pagedllm.entrypoints.openai.responses_store import ResponseStore, StoredResponse
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.errors import InvalidParameterError
from pagedllm.outputs import CompletionOutput, RequestOutput


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}


class ResponseOutput:
    """The output items of one response, made from its generated text: whole (``items``) or
    streamed (``stream``, as the API's events without ``sequence_number``); both give the
    same items. With ``--reasoning-parser`` (``think``) the think part becomes a ``reasoning``
    item first and only the answer goes on to ``ChatTools`` (sequence 0), so calls are read
    from the answer alone."""

    def __init__(self, tools: ChatTools, think: ChatReasoning):
        self.tools, self.think = tools, think
        self.output: list[dict] = []          # streamed: the items so far (closed or open)
        self._reasoning: dict | None = None   # the open reasoning item
        self._message: dict | None = None     # the open message item
        self._call: dict | None = None        # the open function_call item

    def items(self, c: CompletionOutput) -> list[dict]:
        """The output items of the whole completion ``c``: its reasoning (with a parser), a
        message when it has text (status ``incomplete`` when cut by the length limit and no
        call follows), then its calls."""
        reasoning, answer = self.think.split(c)
        message, _ = self.tools.message(answer)
        calls = message.get("tool_calls") or []
        cut = c.finish_reason == "length"
        out = []
        if reasoning:
            done = not cut or bool(message.get("content") or calls)
            out.append(_reasoning_item(_new_id("rs"), reasoning, "completed" if done else "incomplete"))
        if message.get("content"):
            out.append(_message_item(_new_id("msg"), message["content"],
                                     "incomplete" if cut and not calls else "completed"))
        for tc in calls:
            out.append(_call_item(_new_id("fc"), tc["id"], tc["function"]["name"], tc["function"]["arguments"],
                                  "completed"))
        return out

    def stream(self, delta_text: str, finish_reason: str | None) -> list[dict]:
        """The events of the completion's next text (``finish_reason`` set: its last)."""
        done = finish_reason is not None
        deltas = self.think.stream(0, delta_text, done, self.tools.stream)
        # Calls come only in a completion's last deltas, with any text after them in that
        # same batch (ChatTools holds text from a call's start to the end): that text goes to
        # the message first, which is where a whole completion's content puts it.
        events = []
        for d in deltas:
            if d.get("reasoning_content"):
                events += self._reasoning_text(d["reasoning_content"])
        if any(d.get("content") or d.get("tool_calls") for d in deltas):
            events += self._close_reasoning("completed")
        for d in deltas:
            if d.get("content"):
                events += self._text(d["content"])
        for d in deltas:
            for tc in d.get("tool_calls") or []:
                events += self._tool_call(tc)
        if done:
            events += self._close_reasoning("incomplete" if finish_reason == "length" else "completed")
            events += self._close_message("incomplete" if finish_reason == "length" else "completed")
            events += self._close_call()
        return events

    def _reasoning_text(self, text: str) -> list[dict]:
        events = []
        r = self._reasoning
        if r is None:
            r = self._reasoning = _reasoning_item(_new_id("rs"), "", "in_progress")
            r["content"] = []
            events.append({"type": "response.output_item.added", "output_index": len(self.output),
                           "item": copy.deepcopy(r)})
            self.output.append(r)
            r["content"].append({"type": "reasoning_text", "text": ""})
            events.append({"type": "response.content_part.added", "item_id": r["id"],
                           "output_index": len(self.output) - 1, "content_index": 0,
                           "part": copy.deepcopy(r["content"][0])})
        r["content"][0]["text"] += text
        events.append({"type": "response.reasoning_text.delta", "item_id": r["id"],
                       "output_index": self.output.index(r), "content_index": 0, "delta": text})
        return events

    def _close_reasoning(self, status: str) -> list[dict]:
        r, self._reasoning = self._reasoning, None
        if r is None:
            return []
        i, part = self.output.index(r), r["content"][0]
        r["status"] = status
        return [{"type": "response.reasoning_text.done", "item_id": r["id"], "output_index": i, "content_index": 0,
                 "text": part["text"]},
                {"type": "response.content_part.done", "item_id": r["id"], "output_index": i, "content_index": 0,
                 "part": copy.deepcopy(part)},
                {"type": "response.output_item.done", "output_index": i, "item": copy.deepcopy(r)}]

    def _text(self, text: str) -> list[dict]:
        events = []
        m = self._message
        if m is None:
            m = self._message = _message_item(_new_id("msg"), "", "in_progress")
            m["content"] = []
            events.append({"type": "response.output_item.added", "output_index": len(self.output),
                           "item": copy.deepcopy(m)})
            self.output.append(m)
            m["content"].append({"type": "output_text", "text": "", "annotations": []})
            events.append({"type": "response.content_part.added", "item_id": m["id"],
                           "output_index": len(self.output) - 1, "content_index": 0,
                           "part": copy.deepcopy(m["content"][0])})
        m["content"][0]["text"] += text
        events.append({"type": "response.output_text.delta", "item_id": m["id"],
                       "output_index": self.output.index(m), "content_index": 0, "delta": text, "logprobs": []})
        return events

    def _close_message(self, status: str) -> list[dict]:
        m, self._message = self._message, None
        if m is None:
            return []
        i, part = self.output.index(m), m["content"][0]
        m["status"] = status
        return [{"type": "response.output_text.done", "item_id": m["id"], "output_index": i, "content_index": 0,
                 "text": part["text"], "logprobs": []},
                {"type": "response.content_part.done", "item_id": m["id"], "output_index": i, "content_index": 0,
                 "part": copy.deepcopy(part)},
                {"type": "response.output_item.done", "output_index": i, "item": copy.deepcopy(m)}]

    def _tool_call(self, tc: dict) -> list[dict]:
        """One chat tool-call delta: a call's id and name (a new item), or arguments text."""
        if "id" in tc:
            events = self._close_message("completed") + self._close_call()
            call = self._call = _call_item(_new_id("fc"), tc["id"], tc["function"]["name"], "", "in_progress")
            self.output.append(call)
            return events + [{"type": "response.output_item.added", "output_index": len(self.output) - 1,
                              "item": copy.deepcopy(call)}]
        delta = tc["function"].get("arguments", "")
        self._call["arguments"] += delta
        return [{"type": "response.function_call_arguments.delta", "item_id": self._call["id"],
                 "output_index": self.output.index(self._call), "delta": delta}] if delta else []

    def _close_call(self) -> list[dict]:
        call, self._call = self._call, None
        if call is None:
            return []
        i = self.output.index(call)
        call["status"] = "completed"
        return [{"type": "response.function_call_arguments.done", "item_id": call["id"], "output_index": i,
                 "arguments": call["arguments"]},
                {"type": "response.output_item.done", "output_index": i, "item": copy.deepcopy(call)}]


class OpenAIServingResponses(OpenAIServing):
    """The Responses API over the engine.

    Args:
        engine, models, admission: as ``OpenAIServing``'s.
        chat: the chat serving object that starts requests (its tool-calling flags apply).
        store: where ``store: true`` responses go (a default ``ResponseStore`` if None).
    """

    def __init__(self, engine: AsyncLLM, models: OpenAIServingModels, chat: OpenAIServingChat,
                 admission: AdmissionControl | None = None, store: ResponseStore | None = None):
        super().__init__(engine, models, admission)
        self.chat = chat
        self.store = store if store is not None else ResponseStore()

    @staticmethod
    def _not_found(response_id: str, param: str) -> JSONResponse:
        return error_response(f"Response with id {response_id!r} not found (never stored, stored with "
                              "store: false, deleted, or evicted from the server's store).", param, 404)

    async def create_response(self, body: ResponsesRequest, raw: Request):
        """The response to ``body``: a JSON response object, an SSE stream of events, or an
        error response (404 naming ``previous_response_id`` when it is not stored).

        Raises:
            InvalidParameterError: a bad or unsupported field (HTTP 400 naming it); nothing is queued.
            EngineDeadError: the engine has died (HTTP 503).
        """
        if (r := self.models.check_model(body.model)) is not None:
            return r
        body.check_supported()
        previous = None
        if body.previous_response_id is not None:
            previous = self.store.get(body.previous_response_id)
            if previous is None:
                return self._not_found(body.previous_response_id, "previous_response_id")
        history = previous.conversation() if previous is not None else []
        items = body.input_items()
        try:
            chat_body = body.to_chat_request(history + items, len(history))
        except InvalidParameterError as e:
            raise chat_error_as_responses(e) from e
        if (r := self.admit(raw, 1)) is not None:
            return r
        rid, engine_rid = _new_id("resp"), self.request_ids(raw, "resp")[1]
        self.log_user(body, rid)
        try:
            tools, params, stream = await self.chat.start(chat_body, engine_rid)
        except InvalidParameterError as e:
            raise chat_error_as_responses(e) from e
        turn = _Turn(body, rid, items, previous, self.engine.model_name)
        think = ChatReasoning(self.chat.reasoning_parser, chat_body.chat_template_kwargs,
                              params.structured_outputs is not None)
        output = ResponseOutput(tools, think)
        headers = {"X-PagedLLM-Warning": tools.note} if tools.note else None
        if body.stream:
            return StreamingResponse(self._stream(stream, turn, output, raw.state),
                                     media_type="text/event-stream", headers=headers)
        result = await self.with_disconnect(raw, self._full(stream, turn, output, raw.state), [stream])
        if isinstance(result, dict) and headers:
            return JSONResponse(result, headers=headers)
        return result

    async def _full(self, stream, turn: _Turn, output: ResponseOutput, raw_state) -> dict:
        out = await self.drain(stream)
        self.note_usage(raw_state, [out])
        items = output.items(out.outputs[0])
        return self._finish(turn, out, items, await output.think.reasoning_tokens(self.engine))

    def _finish(self, turn: _Turn, out: RequestOutput, items: list[dict], reasoning_tokens: int | None) -> dict:
        """The finished response object (stored when asked to)."""
        resp = turn.response(out, items, reasoning_tokens or 0)
        if turn.body.store:
            self.store.put(resp, turn.items + items, turn.previous)
        return resp

    async def _stream(self, stream, turn: _Turn, output: ResponseOutput, raw_state):
        seq = 0

        def event(obj: dict) -> str:
            nonlocal seq
            obj = {"type": obj["type"], "sequence_number": seq, **obj}
            seq += 1
            return f"event: {obj['type']}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"

        try:
            pending = turn.response(None, [])
            yield event({"type": "response.created", "response": pending})
            yield event({"type": "response.in_progress", "response": pending})
            try:
                async for out in stream:
                    self.note_usage(raw_state, [out])
                    c = out.outputs[0]
                    for e in output.stream(out.delta_text, c.finish_reason):
                        yield event(e)
                    if out.finished:
                        resp = self._finish(turn, out, output.output,
                                            await output.think.reasoning_tokens(self.engine))
                        kind = "response.completed" if resp["status"] == "completed" else "response.incomplete"
                        yield event({"type": kind, "response": resp})
            except Exception as e:  # noqa: BLE001
                err = stream_error_body(e)["error"]
                yield event({"type": "error", "code": err["type"], "message": err["message"], "param": err["param"]})
        finally:
            await stream.aclose()

    def retrieve_response(self, response_id: str, raw: Request):
        """The stored response ``response_id``, or a 404 naming ``response_id``.

        Raises:
            InvalidParameterError: a query parameter (``stream``, ``include``...: not supported).
        """
        for name in raw.query_params:
            raise InvalidParameterError(name, f"query parameter {name} is not supported by GET /v1/responses/{{id}}")
        entry = self.store.get(response_id)
        if entry is None:
            return self._not_found(response_id, "response_id")
        return entry.response

    def delete_response(self, response_id: str):
        """``{"id", "object": "response.deleted", "deleted": true}``, or a 404 naming ``response_id``."""
        if not self.store.delete(response_id):
            return self._not_found(response_id, "response_id")
        return {"id": response_id, "object": "response.deleted", "deleted": True}


class _Turn:
    """One request's response under construction: its id, request, input items, the stored
    response it continues, and the response object of an output (``response``)."""

    def __init__(self, body: ResponsesRequest, rid: str, items: list[dict], previous: StoredResponse | None,
                 model: str):
        self.body, self.rid, self.items, self.previous, self.model = body, rid, items, previous, model
        self.created = int(time.time())

    def response(self, out: RequestOutput | None, items: list[dict], reasoning_tokens: int = 0) -> dict:
        """The response object: ``in_progress`` without ``out``; else finished with ``items``,
        ``incomplete`` when the length limit cut the output."""
        status, details, usage, completed_at = "in_progress", None, None, None
        if out is not None:
            c = out.outputs[0]
            cut = c.finish_reason == "length"
            status = "incomplete" if cut else "completed"
            details = {"reason": "max_output_tokens"} if cut else None
            n_in, n_out = len(out.prompt_token_ids), len(c.token_ids)
            # cache_write_tokens (a field the client requires): the engine counts reads only
            usage = {"input_tokens": n_in,
                     "input_tokens_details": {"cached_tokens": out.num_cached_tokens, "cache_write_tokens": 0},
                     "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                     "total_tokens": n_in + n_out}
            completed_at = int(time.time()) if not cut else None
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
                "completed_at": completed_at, "error": None, "incomplete_details": details, "model": self.model,
                "output": copy.deepcopy(items), "usage": usage, **self.body.echo()}
