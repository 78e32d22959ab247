"""What every API's serving class shares (vLLM's ``OpenAIServing``): the engine, the
model check, request ids, admission, disconnects, merged streams, the access log's usage,
and server-sent events."""
from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedllm.engine.async_llm import AsyncLLM, RequestStream
from pagedllm.entrypoints.openai.admission import AdmissionControl
from pagedllm.entrypoints.openai.errors import error_response, stream_error_body
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.errors import EngineDeadError, InvalidParameterError
from pagedllm.outputs import RequestOutput

logger = logging.getLogger("pagedllm")

SSE_DONE = "data: [DONE]\n\n"


def sse_event(obj) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def sse_error(e: BaseException) -> str:
    """The error event of a stream that failed (``errors.stream_error_body``)."""
    return sse_event(stream_error_body(e))


class OpenAIServing:
    """Base of the serving classes.

    Args:
        engine: the AsyncLLM; models: the served model's card and name check;
        admission: the backpressure of ``--max-waiting-requests`` (None: admit all).
    """

    def __init__(self, engine: AsyncLLM, models: OpenAIServingModels, admission: AdmissionControl | None = None):
        self.engine = engine
        self.models = models
        self.admission = admission

    @staticmethod
    def check_request_chat_template(chat_template: str | None, trusted: bool) -> None:
        """Raises InvalidParameterError(param="chat_template") for a request's own template
        when the server was not started with ``--trust-request-chat-template``."""
        if chat_template is not None and not trusted:
            raise InvalidParameterError(
                "chat_template", "chat_template in a request is refused: start the server with "
                                 "--trust-request-chat-template to allow it")

    async def render_chat(self, messages: list[dict], add_generation_prompt: bool, chat_template: str | None,
                          chat_template_kwargs: dict | None, tools: list[dict] | None) -> list[int]:
        """``AsyncLLM.apply_chat_template`` (checked messages, prompt token ids).

        Raises:
            InvalidParameterError: its own, and any other failure to render, naming
                ``chat_template`` when the request gave one, else ``chat_template_kwargs``
                when it gave those, else ``messages``.
            EngineDeadError: the engine has died.
        """
        try:
            return await self.engine.apply_chat_template(messages, add_generation_prompt, chat_template,
                                                         chat_template_kwargs, tools)
        except (InvalidParameterError, EngineDeadError):
            raise
        except Exception as e:  # the engine's ValueErrors already say what failed
            raise InvalidParameterError(
                "chat_template" if chat_template is not None
                else "chat_template_kwargs" if chat_template_kwargs else "messages",
                str(e) if isinstance(e, ValueError) else f"cannot apply the chat template: {e}") from e

    @staticmethod
    def request_ids(raw: Request, prefix: str) -> tuple[str, str]:
        """(the response's id ``prefix-<X-Request-Id or uuid>``, the engine's id: that plus a
        fresh suffix, so a reused client id never receives another request's tokens)."""
        public = f"{prefix}-{raw.state.request_id}"
        return public, f"{public}-{uuid.uuid4().hex[:12]}"

    def admit(self, raw: Request, num_seqs: int) -> JSONResponse | None:
        """None when the request may go on (its ``num_seqs`` count as in flight until the
        response ends); else the 503 with ``Retry-After`` to answer, nothing counted."""
        if self.admission is None:
            return None
        admitted = self.admission.try_admit(num_seqs)
        if admitted is None:
            a = self.admission
            return error_response(f"the server is at capacity ({a.num_waiting()} requests waiting, "
                                  f"--max-waiting-requests {a.max_waiting_requests}); retry later", None, 503,
                                  "service_unavailable", headers={"Retry-After": "1"})
        raw.scope.setdefault("state", {}).setdefault("on_end", []).append(admitted.release)
        return None

    @staticmethod
    def log_user(body, rid: str) -> None:
        if body.user:
            logger.info("request %s from user %r", rid, body.user)

    @staticmethod
    def note_usage(raw_state, outs: list[RequestOutput | None]) -> None:
        """Record tokens and TTFT of the latest outputs for the access log (a stream notes each)."""
        outs = [o for o in outs if o is not None]
        if not outs:
            return
        firsts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs
                  if o.metrics.first_token_time is not None]
        raw_state.usage = {"prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
                           "output_tokens": sum(len(c.token_ids) for o in outs for c in o.outputs),
                           "ttft": min(firsts) if firsts else None}

    @staticmethod
    async def with_disconnect(raw: Request, coro: Awaitable, streams: list[RequestStream]):
        """Run ``coro``; if the client goes away first, abort its requests and answer 499."""
        task = asyncio.ensure_future(coro)
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await raw.is_disconnected():
                task.cancel()
                for st in streams:
                    await st.aclose()
                return Response(status_code=499)

    @staticmethod
    async def drain(stream: RequestStream) -> RequestOutput | None:
        """The last output of ``stream`` (its whole result)."""
        last = None
        async for out in stream:
            last = out
        return last

    @staticmethod
    async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput | Exception]]:
        """(stream index, RequestOutput) from several streams as they come; an exception from
        one is yielded in place of an output."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, st):
            try:
                async for out in st:
                    await queue.put((i, out))
            except Exception as e:  # noqa: BLE001
                await queue.put((i, e))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.ensure_future(pump(i, st)) for i, st in enumerate(streams)]
        pending = len(tasks)
        try:
            while pending:
                i, out = await queue.get()
                if out is None:
                    pending -= 1
                    continue
                yield i, out
        finally:
            for t in tasks:
                t.cancel()
