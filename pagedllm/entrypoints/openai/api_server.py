"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over AsyncLLM.

Endpoints: POST /v1/completions, POST /v1/chat/completions (``stream`` true or false;
SSE chunks as OpenAI's, closing with ``data: [DONE]``), GET /v1/models and
GET /v1/models/{id} (404 for another id), GET /health,
GET /metrics (Prometheus, vLLM names), POST /reset_prefix_cache.
A client that disconnects mid-request aborts it; its KV blocks are freed at once.

Chat templates are rendered and prompts tokenized in AsyncLLM's tokenizer thread, never on
the event loop. A request's own ``chat_template`` is honoured only when the server was
started with ``--trust-request-chat-template`` (as vLLM): a template is a program, and a
slow one would hold the tokenizer thread.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.engine.async_llm import AsyncLLM, EngineDeadError
from pagedllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                  describe_validation_error, error_body)
from pagedllm.errors import InvalidParameterError

logger = logging.getLogger("pagedllm")


class _AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII characters escaped: an error message may quote what the client
    sent, and a lone surrogate (valid in JSON's escapes) has no UTF-8 encoding."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _err(message: str, param: str | None, code: int = 400, type_: str = "invalid_request_error"):
    return _AsciiJSONResponse(error_body(message, param, code, type_), status_code=code)


def _usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def build_app(engine: AsyncLLM, prometheus=None, trust_request_chat_template: bool = False) -> FastAPI:
    """The FastAPI app serving ``engine``; ``prometheus`` is a PrometheusStatLogger (or None);
    ``trust_request_chat_template``: honour a chat request's ``chat_template`` field."""
    app = FastAPI(title="pagedllm", version="0.1.0")
    app.state.engine = engine

    @app.exception_handler(RequestValidationError)
    async def _validation(_req, exc: RequestValidationError):
        message, param = describe_validation_error(exc.errors())
        return _err(message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req, exc: StarletteHTTPException):
        # unknown path (404), wrong method (405)...: OpenAI's error shape, not FastAPI's
        types = {404: "NotFoundError", 405: "MethodNotAllowedError"}
        return _err(str(exc.detail), None, exc.status_code, types.get(exc.status_code, "invalid_request_error"))

    @app.exception_handler(InvalidParameterError)
    async def _invalid(_req, exc: InvalidParameterError):
        return _err(str(exc), exc.param)

    @app.exception_handler(Exception)
    async def _internal(_req, exc: Exception):
        logger.exception("request failed")
        return _err(f"internal error: {exc}", None, 500, "internal_error")

    @app.exception_handler(EngineDeadError)
    async def _dead(_req, exc):
        return _err(str(exc), None, 503, "service_unavailable")

    def model_not_found(name: str):
        return _err(f"The model `{name}` does not exist.", "model", 404, "NotFoundError")

    def check_model(name: str | None):
        if name not in (None, "", engine.model_name, engine.model_path):
            return model_not_found(name)
        return None

    # The model card: ``created`` is when this server started (fixed, as vLLM's), and
    # ``root`` the served name, never the model's path on this machine.
    started = int(time.time())

    def model_card() -> dict:
        return {"id": engine.model_name, "object": "model", "created": started, "owned_by": "pagedllm",
                "root": engine.model_name, "parent": None, "max_model_len": engine.max_model_len}

    @app.get("/health")
    async def health():
        await engine.check_health()
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str):
        # a served name may contain "/" (e.g. "org/model"), hence the path converter
        if model_id != engine.model_name:
            return model_not_found(model_id)
        return model_card()

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        if prometheus is None:
            return Response(status_code=404)
        return Response(generate_latest(prometheus.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        n = await engine.reset_prefix_cache()
        return {"status": "ok", "num_blocks_dropped": n}

    async def _with_disconnect(raw: Request, coro, streams):
        """Run ``coro``; if the client goes away first, abort its requests (freeing their
        blocks) and answer 499."""
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

    # -- /v1/completions ---------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        if (r := check_model(body.model)) is not None:
            return r
        try:
            params = body.to_sampling_params(default_max_tokens=16)
        except InvalidParameterError as e:
            raise body.to_api_error(e) from e
        p = body.prompt
        if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
            prompts = [p]
        else:
            prompts = list(p)
            if not prompts:
                raise InvalidParameterError("prompt", "prompt must not be empty")
        base = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        # all prompts are validated before any is queued (a bad one queues nothing)
        streams = await engine.add_requests([(f"{base}-{i}", pr, params) for i, pr in enumerate(prompts)])
        if body.stream:
            return StreamingResponse(_stream_completion(streams, base, created, body),
                                     media_type="text/event-stream")
        return await _with_disconnect(raw, _full_completion(streams, base, created), streams)

    async def _drain(stream):
        last = None
        async for out in stream:
            last = out
        return last

    async def _full_completion(streams, base, created):
        finals = await asyncio.gather(*[_drain(st) for st in streams])
        choices, pt, ct, cached = [], 0, 0, 0
        for i, f in enumerate(finals):
            c = f.outputs[0]
            choices.append({"index": i, "text": c.text, "logprobs": None,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
            pt += len(f.prompt_token_ids)
            ct += len(c.token_ids)
            cached += f.num_cached_tokens
        return {"id": base, "object": "text_completion", "created": created,
                "model": engine.model_name, "choices": choices, "usage": _usage(pt, ct, cached)}

    async def _stream_completion(streams, base, created, body):
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
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
        pt = ct = cached = 0
        try:
            while pending:
                i, out = await queue.get()
                if out is None:
                    pending -= 1
                    continue
                if isinstance(out, BaseException):
                    yield _sse(error_body(str(out), getattr(out, "param", None), 500, "internal_error"))
                    continue
                c = out.outputs[0]
                if out.delta_text or out.finished:
                    yield _sse({"id": base, "object": "text_completion", "created": created,
                                "model": engine.model_name,
                                "choices": [{"index": i, "text": out.delta_text, "logprobs": None,
                                             "finish_reason": c.finish_reason if out.finished else None,
                                             "stop_reason": c.stop_reason if out.finished else None}]})
                if out.finished:
                    pt += len(out.prompt_token_ids)
                    ct += len(c.token_ids)
                    cached += out.num_cached_tokens
            if include_usage:
                yield _sse({"id": base, "object": "text_completion", "created": created,
                            "model": engine.model_name, "choices": [], "usage": _usage(pt, ct, cached)})
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
            for st in streams:
                await st.aclose()

    # -- /v1/chat/completions ------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request):
        if (r := check_model(body.model)) is not None:
            return r
        if body.chat_template is not None and not trust_request_chat_template:
            raise InvalidParameterError(
                "chat_template", "chat_template in a request is refused: start the server with "
                                 "--trust-request-chat-template to allow it")
        body.check_supported()
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        try:
            # Checked and reduced to string content by the engine (normalize_chat_messages).
            messages = [m.model_dump() for m in body.messages]   # extra keys (name, ...) reach the template
            try:
                ids = await engine.apply_chat_template(messages, body.add_generation_prompt, body.chat_template,
                                                       body.chat_template_kwargs)
            except (InvalidParameterError, EngineDeadError):
                raise
            except Exception as e:  # the engine's ValueErrors already say what failed
                raise InvalidParameterError(
                    "chat_template" if body.chat_template is not None
                    else "chat_template_kwargs" if body.chat_template_kwargs else "messages",
                    str(e) if isinstance(e, ValueError) else f"cannot apply the chat template: {e}") from e
            params = body.to_sampling_params(default_max_tokens=None)
            stream = await engine.add_request(rid, ids, params)
        except InvalidParameterError as e:
            raise body.to_api_error(e) from e
        if body.stream:
            return StreamingResponse(_stream_chat(stream, rid, created, body),
                                     media_type="text/event-stream")
        return await _with_disconnect(raw, _full_chat(stream, rid, created), [stream])

    async def _full_chat(stream, rid, created):
        out = await _drain(stream)
        c = out.outputs[0]
        return {"id": rid, "object": "chat.completion", "created": created, "model": engine.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": c.text},
                             "logprobs": None, "finish_reason": c.finish_reason,
                             "stop_reason": c.stop_reason}],
                "usage": _usage(len(out.prompt_token_ids), len(c.token_ids), out.num_cached_tokens)}

    async def _stream_chat(stream, rid, created, body):
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(delta: dict, finish=None, stop_reason=None):
            return _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                         "model": engine.model_name,
                         "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                      "finish_reason": finish, "stop_reason": stop_reason}]})
        try:
            yield chunk({"role": "assistant", "content": ""})
            try:
                async for out in stream:
                    c = out.outputs[0]
                    if out.delta_text:
                        yield chunk({"content": out.delta_text})
                    if out.finished:
                        yield chunk({}, c.finish_reason, c.stop_reason)
                        if include_usage:
                            yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                                        "model": engine.model_name, "choices": [],
                                        "usage": _usage(len(out.prompt_token_ids), len(c.token_ids),
                                                        out.num_cached_tokens)})
            except Exception as e:  # noqa: BLE001
                yield _sse(error_body(str(e), getattr(e, "param", None), 500, "internal_error"))
            yield "data: [DONE]\n\n"
        finally:
            await stream.aclose()

    return app


def _check_can_listen(host: str, port: int) -> None:
    """Raises InvalidParameterError naming ``port`` when ``host:port`` cannot be bound
    (in use, or not an address of this machine)."""
    import socket

    try:
        socket.create_server((host, port)).close()
    except OSError as e:
        raise InvalidParameterError("port", f"cannot listen on {host}:{port}: {e.strerror or e}; "
                                            "choose another --port (or --host)") from e


def run_server(args) -> None:
    """Load the engine from parsed CLI args, then serve until interrupted."""
    import uvicorn

    from pagedllm.config import EngineArgs
    from pagedllm.engine.metrics import PrometheusStatLogger

    engine_args = EngineArgs.from_cli_args(args)
    _check_can_listen(args.host, args.port)  # before the model load, not after it
    engine = AsyncLLM(engine_args)
    # The Prometheus logger is labelled with the served model name, known only once the
    # engine has loaded; the engine thread picks it up at its next step.
    prom = PrometheusStatLogger(engine.model_name)
    engine.add_stat_logger(prom)
    app = build_app(engine, prom, trust_request_chat_template=args.trust_request_chat_template)
    logger.info("serving %s on http://%s:%d", engine.model_name, args.host, args.port)
    try:
        # Ctrl-C: open streams get 5 s to finish, then the server exits anyway
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                    timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()
