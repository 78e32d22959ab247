"""Default logging for ``LLM`` and ``AsyncLLM`` (as vLLM's ``VLLM_CONFIGURE_LOGGING``):
without any logging configuration the engine's INFO lines still reach stderr. The handler
writes only while the application's own logging would not, so configured applications
see each line once, in their format. ``PAGEDLLM_CONFIGURE_LOGGING=0`` leaves logging
alone; ``PAGEDLLM_LOG_LEVEL`` sets the level. Details: docs/notes/config.md.
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
    """Without application logging, add ``DefaultHandler`` to ``pagedllm`` and set its
    unset level to ``PAGEDLLM_LOG_LEVEL``; a value of it that is not a level is a
    ValueError naming it (``envs.log_level``)."""
    if not envs.configure_logging():
        return
    log = logging.getLogger(LOGGER_NAME)
    if logging.getLogger().handlers or log.handlers:
        return
    level = getattr(logging, envs.log_level())   # raises before anything is changed
    log.addHandler(DefaultHandler())
    if log.level == logging.NOTSET:
        log.setLevel(level)
