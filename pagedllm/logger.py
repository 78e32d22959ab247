"""Default logging for the library front ends (``LLM``, ``AsyncLLM``), as vLLM's
``VLLM_CONFIGURE_LOGGING``: a program that uses pagedllm without configuring logging itself
still sees the engine's INFO lines on stderr (the dtype chosen, what each layer runs, the
KV cache's size), which Python's default (WARNING and above only) would drop.

The handler added to the ``pagedllm`` logger writes a record only while nothing else
would: the root logger has no handler (``logging.basicConfig``, the CLI, pytest's caplog)
and the ``pagedllm`` logger has no other. So an application that configures logging, before
or after the engine starts, gets each line once, through its own handlers and format.
A program that has configured logging when the engine starts keeps its own levels (e.g.
``basicConfig()``'s WARNING: no INFO lines). This covers the front end's process: an engine
core in its own process (``core/engine_proc.py``) logs to its stderr in its own format, at
the level the front end's ``pagedllm`` logger has when it starts. ``PAGEDLLM_CONFIGURE_LOGGING=0`` leaves logging
alone; ``PAGEDLLM_LOG_LEVEL`` (default INFO) sets the ``pagedllm`` logger's level when the
handler is added and the logger has no level of its own.
"""
from __future__ import annotations

import logging
import sys

from pagedllm import envs

LOGGER_NAME = "pagedllm"


class DefaultHandler(logging.StreamHandler):
    """A stderr handler that stays silent while the application's own logging would
    write the record (a handler on the root logger, or another on ``pagedllm``)."""

    def __init__(self):
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"))

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        if any(h is not self for h in logging.getLogger(LOGGER_NAME).handlers):
            return
        super().emit(record)


def configure_default_logging() -> None:
    """Where the application has configured no logging (no handler on the root logger or
    on ``pagedllm``), add ``DefaultHandler`` to the ``pagedllm`` logger and, if that logger
    has no level of its own, set it to ``PAGEDLLM_LOG_LEVEL`` (an unknown name: INFO).
    Otherwise, or when ``PAGEDLLM_CONFIGURE_LOGGING`` is 0, nothing: the application's
    levels and handlers decide. Never raises."""
    if not envs.configure_logging():
        return
    log = logging.getLogger(LOGGER_NAME)
    if logging.getLogger().handlers or log.handlers:
        return
    log.addHandler(DefaultHandler())
    if log.level == logging.NOTSET:
        level = logging.getLevelName(envs.log_level().upper())
        log.setLevel(level if isinstance(level, int) else logging.INFO)
