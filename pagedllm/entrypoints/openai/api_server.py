"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over AsyncLLM.

Routes, fields, errors, auth, backpressure and shutdown: docs/api.md. ``router.py`` holds
the routes; each hands its request to a serving object on ``app.state`` (vLLM's layout),
built in ``build_app``. Layout, adding an API, and why templates render in tokenizer
threads: docs/notes/entrypoints.md.
"""
from __future__ import annotations

import logging
import threading

import uvicorn
from fastapi import FastAPI

import pagedllm
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.anthropic.errors import AnthropicErrorShape
from pagedllm.entrypoints.anthropic.router import router as anthropic_router
from pagedllm.entrypoints.anthropic.serving_messages import AnthropicServingMessages
from pagedllm.entrypoints.openai.admission import AdmissionControl
from pagedllm.entrypoints.openai.errors import register_error_handlers
from pagedllm.entrypoints.openai.middleware import ApiKeyMiddleware, InternalErrorMiddleware, RequestIdMiddleware
from pagedllm.entrypoints.openai.router import router
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagedllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagedllm.errors import InvalidParameterError, ServerShuttingDownError

logger = logging.getLogger("pagedllm")


def build_app(engine: AsyncLLM, prometheus=None, trust_request_chat_template: bool = False,
              enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
              reasoning_parser: str | None = None, api_key: str | None = None, metrics_without_auth: bool = False,
              max_waiting_requests: int | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` (``prometheus``: a PrometheusStatLogger or None).
    The other arguments are the ``serve`` flags of the same names (docs/configuration.md);
    ``max_waiting_requests`` None never refuses.

    Raises:
        ValueError: ``enable_auto_tool_choice`` without a known ``tool_call_parser``; an
            unknown ``reasoning_parser``; ``max_waiting_requests`` < 1."""
    models = OpenAIServingModels(engine)
    admission = None
    if max_waiting_requests is not None:
        admission = AdmissionControl(max_waiting_requests, engine.engine.config.args.max_num_seqs)
    chat = OpenAIServingChat(engine, models, admission, trust_request_chat_template=trust_request_chat_template,
                             enable_auto_tool_choice=enable_auto_tool_choice, tool_call_parser=tool_call_parser,
                             reasoning_parser=reasoning_parser)

    app = FastAPI(title="pagedllm", version=pagedllm.__version__)
    app.add_middleware(InternalErrorMiddleware)   # innermost: inside the access log and auth
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, metrics_without_auth=metrics_without_auth)
    app.add_middleware(AnthropicErrorShape)   # outside auth: its 401 has Anthropic's shape on /v1/messages
    app.add_middleware(RequestIdMiddleware)   # outermost: a refused request has an id and a log line too
    register_error_handlers(app)

    state = app.state
    state.engine = engine
    state.prometheus = prometheus
    state.openai_serving_models = models
    state.openai_serving_completion = OpenAIServingCompletion(engine, models, admission)
    state.openai_serving_chat = chat
    state.openai_serving_responses = OpenAIServingResponses(engine, models, chat, admission)
    state.openai_serving_tokenization = OpenAIServingTokenization(engine, models, chat.trust_request_chat_template)
    state.anthropic_serving_messages = AnthropicServingMessages(engine, models, admission, chat)
    # each on the app itself: app.routes lists them (include_router nests them)
    for route in [*router.routes, *anthropic_router.routes]:
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
    """uvicorn's server, except that the signal that began the graceful shutdown is not
    re-raised once it is done (so the engine process is stopped first), and shortly before
    ``timeout_graceful_shutdown`` runs out (a second, or half of it under two seconds) the
    requests still running end with ``ServerShuttingDownError`` (a 503, or a stream's error
    event and ``[DONE]``) instead of being cancelled. Why: docs/notes/entrypoints.md.
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


def _keep_off_the_engine_cores() -> None:
    """The API server's own process runs no model step when the engine core has a process of
    its own: no thread pools sized to the cores (torch's intra-op pool, the tokenizers'
    rayon pool) whose spinning would take a core from the engine's step."""
    import os

    import torch

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)


def run_server(args) -> None:
    """Load the engine from parsed CLI args, then serve until SIGTERM or Ctrl-C; returns after
    the drain (``--shutdown-timeout``, see ``DrainingServer``) and the engine's shutdown."""
    from pagedllm import envs
    from pagedllm.config import EngineArgs
    from pagedllm.engine.metrics import PrometheusStatLogger

    engine_args = EngineArgs.from_cli_args(args)
    _check_can_listen(args.host, args.port)  # before the model load, not after it
    if engine_args.engine_process:
        _keep_off_the_engine_cores()
    engine = AsyncLLM(engine_args)
    try:
        # The Prometheus logger is labelled with the served model name, known only once the
        # engine has loaded; the engine thread picks it up at its next step.
        prom = PrometheusStatLogger(engine.model_name)
        engine.add_stat_logger(prom)
        api_key = getattr(args, "api_key", None) or envs.api_key()
        app = build_app(engine, prom, trust_request_chat_template=args.trust_request_chat_template,
                        enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
                        reasoning_parser=getattr(args, "reasoning_parser", None),
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
