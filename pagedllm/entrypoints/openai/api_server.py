"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over AsyncLLM.

Endpoints: POST /v1/completions, POST /v1/chat/completions (``stream`` true or false;
SSE chunks as OpenAI's, closing with ``data: [DONE]``), GET /v1/models and
GET /v1/models/{id} (404 for another id), GET /health, GET /version,
POST /tokenize and POST /detokenize (vLLM's), GET /metrics (Prometheus, vLLM names),
POST /reset_prefix_cache, and GET /openapi.json describing them.
A client that disconnects mid-request aborts it; its KV blocks are freed at once.

Production behaviour (``middleware.py``, ``run_server``):
- ``--api-key`` (or ``PAGEDLLM_API_KEY``): Bearer auth on every route but /health (and
  /metrics with ``--metrics-without-auth``); 401 in OpenAI's error shape.
- ``--max-waiting-requests N``: a completion or chat request that finds N requests
  already waiting for the engine gets 503 with ``Retry-After``, instead of queueing.
- ``X-Request-Id``: honoured (the response ids are built from it) and echoed; the
  engine's id for the request always adds a fresh suffix, so a reused id (in flight
  twice, or retried right after a disconnect) never crosses streams. One
  access-log line per request (``pagedllm.access``).
- The engine core's death (its process killed, say): open requests fail at once (503,
  or an error event then ``[DONE]`` on a stream) and /health answers 503.
- An error no handler expected: 500 in OpenAI's error shape, logged with its traceback;
  the connection stays open for the client's next request.
- SIGTERM / Ctrl-C: stop accepting, let in-flight requests finish for up to
  ``--shutdown-timeout`` seconds, abort the rest, stop the engine process, exit 0.

Chat templates are rendered and prompts tokenized in AsyncLLM's tokenizer thread, never on
the event loop. A request's own ``chat_template`` is honoured only when the server was
started with ``--trust-request-chat-template`` (as vLLM): a template is a program, and a
slow one would hold the tokenizer thread.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
import uuid

import uvicorn

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.engine.async_llm import AsyncLLM, EngineDeadError
from pagedllm.entrypoints.openai.middleware import ApiKeyMiddleware, InternalErrorMiddleware, RequestIdMiddleware
from pagedllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                  TokenizeRequest, describe_validation_error, error_body)
from pagedllm.entrypoints.openai.chat_tools import ChatTools, render_chat_tools
from pagedllm.entrypoints.openai.responses import CompletionFormat, chat_logprobs, prompt_logprobs, usage
from pagedllm.entrypoints.openai.tool_calls import get_tool_parser, validate_tool_request
import pagedllm
from pagedllm.errors import InvalidParameterError, ServerShuttingDownError, check_unicode

logger = logging.getLogger("pagedllm")


class _AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII characters escaped: an error message may quote what the client
    sent, and a lone surrogate (valid in JSON's escapes) has no UTF-8 encoding."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _err(message: str, param: str | None, code: int = 400, type_: str = "invalid_request_error"):
    return _AsciiJSONResponse(error_body(message, param, code, type_), status_code=code)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _sse_error(e: BaseException) -> str:
    """The error event of a stream that failed: 503 when the engine has died, else 500."""
    if isinstance(e, EngineDeadError):
        return _sse(error_body(str(e), None, 503, "service_unavailable"))
    return _sse(error_body(str(e), getattr(e, "param", None), 500, "internal_error"))


def build_app(engine: AsyncLLM, prometheus=None, trust_request_chat_template: bool = False,
              enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
              api_key: str | None = None, metrics_without_auth: bool = False,
              max_waiting_requests: int | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``; ``prometheus`` is a PrometheusStatLogger (or None);
    ``trust_request_chat_template``: honour a chat request's ``chat_template`` field;
    ``enable_auto_tool_choice`` / ``tool_call_parser``: ``tool_choice: "auto"`` reads calls
    from the output with that parser (vLLM's flags); ``api_key``: require it as a Bearer
    token (``metrics_without_auth``: but not on /metrics); ``max_waiting_requests``: refuse
    new generation requests with 503 while that many wait for the engine (None: never).

    Raises:
        ValueError: ``enable_auto_tool_choice`` without a known ``tool_call_parser``;
            ``max_waiting_requests`` < 1."""
    if enable_auto_tool_choice:
        if tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        get_tool_parser(tool_call_parser)
    if max_waiting_requests is not None and max_waiting_requests < 1:
        raise ValueError(f"--max-waiting-requests must be >= 1, got {max_waiting_requests}")
    app = FastAPI(title="pagedllm", version=pagedllm.__version__)
    app.state.engine = engine
    app.add_middleware(InternalErrorMiddleware)   # innermost: inside the access log and auth
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, metrics_without_auth=metrics_without_auth)
    app.add_middleware(RequestIdMiddleware)   # outermost: a refused request has an id and a log line too
    def request_ids(raw: Request, prefix: str) -> tuple[str, str]:
        """(the response's id, ``prefix-<X-Request-Id or uuid>``; the engine's id, that plus
        a fresh suffix). The engine's id is never a client's: a client that reuses an id
        (twice in flight, or a retry right after a disconnect, before the engine has
        dropped the first request) can never receive the other request's tokens."""
        public = f"{prefix}-{raw.state.request_id}"
        return public, f"{public}-{uuid.uuid4().hex[:12]}"

    def check_capacity():
        """503 with Retry-After when ``max_waiting_requests`` requests wait already."""
        if max_waiting_requests is not None and engine.num_waiting() >= max_waiting_requests:
            r = _err(f"the server is at capacity ({engine.num_waiting()} requests waiting, "
                     f"--max-waiting-requests {max_waiting_requests}); retry later", None, 503,
                     "service_unavailable")
            r.headers["Retry-After"] = "1"
            return r
        return None

    def note_usage(raw_state, outs) -> None:
        """What the access log reports: tokens and TTFT of the request's latest outputs
        (a stream notes each one, so a stream cut short logs what it had sent)."""
        outs = [o for o in outs if o is not None]
        if not outs:
            return
        firsts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs
                  if o.metrics.first_token_time is not None]
        raw_state.usage = {"prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
                           "output_tokens": sum(len(c.token_ids) for o in outs for c in o.outputs),
                           "ttft": min(firsts) if firsts else None}

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

    @app.get("/version")
    async def version():
        return {"version": pagedllm.__version__}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        if (r := check_model(body.model)) is not None:
            return r
        if (body.prompt is None) == (body.messages is None):
            raise InvalidParameterError("prompt", "give exactly one of prompt and messages")
        if body.messages is not None:
            tools = validate_tool_request(body.tools).tools
            messages, tools_kw, _, _ = render_chat_tools([m.model_dump() for m in body.messages], tools,
                                                         getattr(engine.tokenizer, "chat_template", None))
            try:
                ids = await engine.apply_chat_template(messages, body.add_generation_prompt, None,
                                                       body.chat_template_kwargs, tools_kw)
            except (InvalidParameterError, EngineDeadError):
                raise
            except ValueError as e:
                raise InvalidParameterError("chat_template_kwargs" if body.chat_template_kwargs else "messages",
                                            str(e)) from e
        else:
            # the chat fields shape a rendered conversation; with a bare prompt they
            # would be silently ignored
            for field in ("tools", "chat_template_kwargs", "add_generation_prompt"):
                if field in body.model_fields_set:
                    raise InvalidParameterError(field, f"{field} applies only with messages, not with prompt")
            check_unicode("prompt", body.prompt)
            ids = await engine.tokenize(body.prompt, body.add_special_tokens)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        if (r := check_model(body.model)) is not None:
            return r
        vocab = engine.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidParameterError("tokens", f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return {"prompt": await engine.detokenize(body.tokens)}

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

    async def _drain(stream):
        last = None
        async for out in stream:
            last = out
        return last

    async def _merged(streams):
        """(stream index, RequestOutput) from several streams as they come; an exception
        from one is yielded in place of an output."""
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

    def _log_user(body, rid: str) -> None:
        if body.user:
            logger.info("request %s from user %r", rid, body.user)

    # -- /v1/completions ---------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        if (r := check_model(body.model)) is not None:
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
        if (r := check_capacity()) is not None:
            return r
        base, engine_base = request_ids(raw, "cmpl")
        _log_user(body, base)
        created = int(time.time())
        # all prompts are validated before any is queued (a bad one queues nothing)
        try:
            streams = await engine.add_requests([(f"{engine_base}-{i}", pr, params)
                                                 for i, pr in enumerate(prompts)])
        except InvalidParameterError as e:
            raise body.to_api_error(e) from e
        fmt = CompletionFormat(body, params, engine.engine, prompt_only)
        if body.stream:
            return StreamingResponse(_stream_completion(streams, base, created, body, fmt, raw.state),
                                     media_type="text/event-stream")
        return await _with_disconnect(raw, _full_completion(streams, base, created, fmt, raw.state), streams)

    async def _full_completion(streams, base, created, fmt, raw_state):
        finals = [fmt.visible(f) for f in await asyncio.gather(*[_drain(st) for st in streams])]
        note_usage(raw_state, finals)
        choices, pt, ct, cached = [], 0, 0, 0
        for i, f in enumerate(finals):
            for c in f.outputs:
                choices.append(fmt.choice(i * fmt.n + c.index, f, c))
                ct += len(c.token_ids)
            pt += len(f.prompt_token_ids)
            cached += f.num_cached_tokens
        return {"id": base, "object": "text_completion", "created": created,
                "model": engine.model_name, "choices": choices, "usage": usage(pt, ct, cached)}

    async def _stream_completion(streams, base, created, body, fmt, raw_state):
        opts = body.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        pt = ct = cached = 0
        sent_lp: dict[tuple[int, int], int] = {}
        sent_chars: dict[tuple[int, int], int] = {}
        echoed: set[tuple[int, int]] = set()
        latest = [None] * len(streams)
        try:
            async for i, out in _merged(streams):
                if isinstance(out, BaseException):
                    yield _sse_error(out)
                    continue
                out = fmt.visible(out)
                c = next(x for x in out.outputs if x.index == out.delta_index)
                key = (i, c.index)
                text = out.delta_text
                lp = None
                first = key not in echoed
                echoed.add(key)
                if first and body.echo:
                    text = fmt.prompt_text(out) + text
                if fmt.k is not None:
                    n0 = sent_lp.get(key, 0)
                    part = dataclasses.replace(c, token_ids=c.token_ids[n0:], logprobs=(c.logprobs or [])[n0:])
                    lp = fmt.logprobs(out, part, first and body.echo, sent_chars.get(key, 0))
                    sent_lp[key] = len(c.token_ids)
                sent_chars[key] = sent_chars.get(key, 0) + len(text)
                done = c.finish_reason is not None
                if text or done or (lp and lp["tokens"]):
                    chunk = {"id": base, "object": "text_completion", "created": created,
                             "model": engine.model_name,
                             "choices": [{"index": i * fmt.n + c.index, "text": text, "logprobs": lp,
                                          "finish_reason": c.finish_reason if done else None,
                                          "stop_reason": c.stop_reason if done else None}]}
                    if continuous:
                        chunk["usage"] = usage(len(out.prompt_token_ids), len(c.token_ids), out.num_cached_tokens)
                    yield _sse(chunk)
                latest[i] = out
                note_usage(raw_state, latest)
                if out.finished:
                    pt += len(out.prompt_token_ids)
                    ct += sum(len(x.token_ids) for x in out.outputs)
                    cached += out.num_cached_tokens
            if include_usage:
                yield _sse({"id": base, "object": "text_completion", "created": created,
                            "model": engine.model_name, "choices": [], "usage": usage(pt, ct, cached)})
            yield "data: [DONE]\n\n"
        finally:
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
        if (r := check_capacity()) is not None:
            return r
        rid, engine_rid = request_ids(raw, "chatcmpl")
        _log_user(body, rid)
        created = int(time.time())
        tools = ChatTools(body, engine, enable_auto_tool_choice, tool_call_parser)
        try:
            # Checked and reduced to string content by the engine (normalize_chat_messages).
            messages = [m.model_dump() for m in body.messages]   # extra keys (name, ...) reach the template
            messages, tools_kw = tools.render(messages)
            try:
                ids = await engine.apply_chat_template(messages, body.add_generation_prompt, body.chat_template,
                                                       body.chat_template_kwargs, tools_kw)
            except (InvalidParameterError, EngineDeadError):
                raise
            except Exception as e:  # the engine's ValueErrors already say what failed
                raise InvalidParameterError(
                    "chat_template" if body.chat_template is not None
                    else "chat_template_kwargs" if body.chat_template_kwargs else "messages",
                    str(e) if isinstance(e, ValueError) else f"cannot apply the chat template: {e}") from e
            params = body.to_sampling_params(default_max_tokens=None, constraint=tools.constraint())
            stream = await engine.add_request(engine_rid, ids, params)
        except InvalidParameterError as e:
            raise body.to_api_error(e) from e
        headers = {"X-PagedLLM-Warning": tools.note} if tools.note else None
        if body.stream:
            return StreamingResponse(_stream_chat(stream, rid, created, body, params, tools, raw.state),
                                     media_type="text/event-stream", headers=headers)
        result = await _with_disconnect(raw, _full_chat(stream, rid, created, params, tools, raw.state), [stream])
        if isinstance(result, dict) and headers:
            return JSONResponse(result, headers=headers)
        return result

    async def _full_chat(stream, rid, created, params, tools, raw_state):
        out = await _drain(stream)
        note_usage(raw_state, [out])
        choices = []
        for c in out.outputs:
            message, finish = tools.message(c)
            choices.append({"index": c.index, "message": message,
                            "logprobs": None if c.logprobs is None else chat_logprobs(c.token_ids, c.logprobs,
                                                                                      params.logprobs),
                            "finish_reason": finish, "stop_reason": c.stop_reason})
        resp = {"id": rid, "object": "chat.completion", "created": created, "model": engine.model_name,
                "choices": choices,
                "usage": usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs),
                               out.num_cached_tokens)}
        if out.prompt_logprobs is not None:
            resp["prompt_logprobs"] = prompt_logprobs(out.prompt_logprobs)
        return resp

    async def _stream_chat(stream, rid, created, body, params, tools, raw_state):
        opts = body.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        n_prompt = cached = 0
        n_out: dict[int, int] = {}

        def chunk(index: int, delta: dict, finish=None, stop_reason=None, lp=None):
            obj = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": engine.model_name,
                   "choices": [{"index": index, "delta": delta, "logprobs": lp,
                                "finish_reason": finish, "stop_reason": stop_reason}]}
            if continuous:
                obj["usage"] = usage(n_prompt, sum(n_out.values()), cached)
            return _sse(obj)
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
                    deltas = tools.stream(c.index, out.delta_text, done)
                    for j, d in enumerate(deltas):
                        yield chunk(c.index, d, lp=lp if j == len(deltas) - 1 else None)
                    if not deltas and lp is not None:
                        yield chunk(c.index, {}, lp=lp)
                    if done:
                        yield chunk(c.index, {}, tools.finish_reason(c), c.stop_reason)
                    note_usage(raw_state, [out])
                    if out.finished and include_usage:
                        yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                                    "model": engine.model_name, "choices": [],
                                    "usage": usage(n_prompt, sum(len(x.token_ids) for x in out.outputs), cached)})
            except Exception as e:  # noqa: BLE001
                yield _sse_error(e)
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


class DrainingServer(uvicorn.Server):
    """uvicorn's server, except that:

    - the SIGTERM / SIGINT that began its graceful shutdown is not raised again once the
      shutdown is done: uvicorn re-raises it, which kills the process (SIGTERM) or raises
      KeyboardInterrupt (SIGINT) before the engine process is stopped. A second Ctrl-C
      still forces the exit;
    - shortly before the drain time (``timeout_graceful_shutdown`` seconds) runs out, the
      requests still running are ended with ``ServerShuttingDownError`` (``engine.fail_all``):
      a 503 body, or a stream's error event and ``[DONE]``, where uvicorn would cancel their
      tasks (a plain-text 500, streams cut mid-response, and tracebacks in the log). The
      margin is a second, or half the drain time if that is under two seconds.
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM | None = None):
        super().__init__(config)
        self._engine = engine
        self._drain_timer: threading.Timer | None = None

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()
        timeout = self.config.timeout_graceful_shutdown
        if self._engine is not None and self._drain_timer is None and timeout is not None:
            self._drain_timer = threading.Timer(max(0.0, timeout - min(1.0, timeout / 2)), self._end_requests)
            self._drain_timer.daemon = True
            self._drain_timer.start()

    def _end_requests(self) -> None:
        n = self._engine.fail_all(ServerShuttingDownError(
            "the server is shutting down and its drain time (--shutdown-timeout) has run out; retry elsewhere"))
        if n:
            logger.warning("shutdown: ended %d request(s) still running after the drain time", n)


def run_server(args) -> None:
    """Load the engine from parsed CLI args, then serve until SIGTERM or Ctrl-C.

    Shutdown (``DrainingServer``): uvicorn stops accepting connections and gives in-flight requests up to
    ``--shutdown-timeout`` seconds; those still running then are cancelled (their streams
    close and the engine aborts them), the engine process is stopped, and the function
    returns (the command exits 0)."""
    from pagedllm import envs
    from pagedllm.config import EngineArgs
    from pagedllm.engine.metrics import PrometheusStatLogger

    engine_args = EngineArgs.from_cli_args(args)
    _check_can_listen(args.host, args.port)  # before the model load, not after it
    engine = AsyncLLM(engine_args)
    try:
        # The Prometheus logger is labelled with the served model name, known only once the
        # engine has loaded; the engine thread picks it up at its next step.
        prom = PrometheusStatLogger(engine.model_name)
        engine.add_stat_logger(prom)
        api_key = getattr(args, "api_key", None) or envs.api_key()
        app = build_app(engine, prom, trust_request_chat_template=args.trust_request_chat_template,
                        enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
                        api_key=api_key, metrics_without_auth=getattr(args, "metrics_without_auth", False),
                        max_waiting_requests=getattr(args, "max_waiting_requests", None))
        logger.info("serving %s on http://%s:%d%s", engine.model_name, args.host, args.port,
                    " (API key required)" if api_key else "")
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                timeout_graceful_shutdown=getattr(args, "shutdown_timeout", 30.0))
        DrainingServer(config, engine).run()
    finally:
        engine.shutdown()
    logger.info("server stopped")
