"""Errors that name the offending parameter (the server turns them into HTTP 400 with an
OpenAI-style body; offline they are plain ValueErrors)."""
from __future__ import annotations


class InvalidParameterError(ValueError):
    """A bad request parameter.

    Attributes:
        param: the parameter's API name (e.g. ``"temperature"``, ``"prompt"``).
    """

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class EngineDeadError(RuntimeError):
    """The engine core has died (its loop raised, or its process exited); no request can
    be served any more. The server answers 503 and ``/health`` turns 503."""
