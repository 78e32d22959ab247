"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over AsyncLLM.

Endpoints: POST /v1/completions, POST /v1/chat/completions (``stream`` true or false;
SSE chunks as OpenAI's, closing with ``data: [DONE]``), GET /v1/models and
GET /v1/models/{id} (404 for another id), GET /health, GET /version,
POST /tokenize and POST /detokenize (vLLM's), GET /metrics (Prometheus, vLLM names),
POST /reset_prefix_cache, and GET /openapi.json describing them.
A client that disconnects mid-request aborts it; its KV blocks are freed at once.

Production behaviour (``middleware.py``, ``admission.py``, ``run_server``):
- ``--api-key`` (or ``PAGEDLLM_API_KEY``): Bearer auth on every route but /health (and
  /metrics with ``--metrics-without-auth``); 401 in OpenAI's error shape.
- ``--max-waiting-requests N``: a completion or chat request that finds N requests
  already waiting for the engine gets 503 with ``Retry-After``, instead of queueing
  (requests count from their arrival, so those within one engine step see each other).
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

Chat templates are rendered, prompts tokenized and token ids decoded in AsyncLLM's
tokenizer threads (each with its own copy of the tokenizer), never on the event loop nor
with the engine's own tokenizer, which its output thread uses. A request's own
``chat_template`` is honoured only when the server was started with
``--trust-request-chat-template`` (as vLLM): a template is a program, and a slow one
would hold a tokenizer thread.

Layout (vLLM's): ``router.py`` holds the routes; each hands its request to a serving
object on ``app.state``: ``serving_completion.OpenAIServingCompletion``,
``serving_chat.OpenAIServingChat``, ``serving_tokenization.OpenAIServingTokenization``,
``serving_models.OpenAIServingModels`` (the model card and the ``model`` check). What
they share (request ids, admission, disconnects, merged streams, the access log's
usage, SSE) is ``serving_engine.OpenAIServing``; OpenAI's error shape and the exception
handlers are ``errors.py``.

A new API is one serving class and its routes:
1. ``serving_<api>.py``: a subclass of ``OpenAIServing`` with the API's request checks
   and its whole and streamed paths (``self.admit``, ``self.request_ids``,
   ``self.engine.add_request``, ``self.with_disconnect``, ``sse_event``...); its request
   bodies beside the others in ``protocol.py``;
2. its routes in ``router.py``, each taking the object from ``app.state``;
3. the line in ``build_app`` below that puts it on ``app.state``.
"""
from __future__ import annotations

import logging
import threading

import uvicorn
from fastapi import FastAPI

import pagedllm
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.admission import AdmissionControl
from pagedllm.entrypoints.openai.errors import register_error_handlers
from pagedllm.entrypoints.openai.middleware import ApiKeyMiddleware, InternalErrorMiddleware, RequestIdMiddleware
from pagedllm.entrypoints.openai.router import router
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagedllm.errors import InvalidParameterError, ServerShuttingDownError

logger = logging.getLogger("pagedllm")


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
    models = OpenAIServingModels(engine)
    admission = None
    if max_waiting_requests is not None:
        admission = AdmissionControl(max_waiting_requests, engine.engine.config.args.max_num_seqs)
    chat = OpenAIServingChat(engine, models, admission, trust_request_chat_template=trust_request_chat_template,
                             enable_auto_tool_choice=enable_auto_tool_choice, tool_call_parser=tool_call_parser)

    app = FastAPI(title="pagedllm", version=pagedllm.__version__)
    app.add_middleware(InternalErrorMiddleware)   # innermost: inside the access log and auth
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, metrics_without_auth=metrics_without_auth)
    app.add_middleware(RequestIdMiddleware)   # outermost: a refused request has an id and a log line too
    register_error_handlers(app)

    state = app.state
    state.engine = engine
    state.prometheus = prometheus
    state.openai_serving_models = models
    state.openai_serving_completion = OpenAIServingCompletion(engine, models, admission)
    state.openai_serving_chat = chat
    state.openai_serving_tokenization = OpenAIServingTokenization(engine, models)
    for route in router.routes:   # each on the app itself: app.routes lists them (include_router nests them)
        app.add_api_route(route.path, route.endpoint, methods=list(route.methods), name=route.name)
    if admission is not None:
        engine.add_stat_logger(admission)   # the scheduler's counts after each step
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
