"""Errors that name the offending parameter (the server turns them into HTTP 400 with an
OpenAI-style body; offline they are plain ValueErrors)."""
from __future__ import annotations


class InvalidParameterError(ValueError):
    """A bad request parameter; ``param`` is its API name (e.g. ``"temperature"``)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param

    def __reduce__(self):   # pickles (a worker process's start-up error reaches the executor)
        return type(self), (self.param, str(self))


def check_unicode(param: str, text: str, where: str | None = None) -> None:
    """Raises InvalidParameterError(``param``), naming ``where`` (else ``param``), if
    ``text`` holds a lone UTF-16 surrogate (cannot be encoded as UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidParameterError(
            param, f"{where or param} is not valid Unicode: a lone surrogate {text[e.start]!a} "
                   f"at character {e.start}") from None


def check_unicode_json(param: str, value, where: str | None = None) -> None:
    """``check_unicode`` for every string and key in a JSON value, naming the place, e.g.
    ``tools[0].function.description``. Raises InvalidParameterError(param)."""
    def walk(v, where: str) -> None:
        if isinstance(v, str):
            check_unicode(param, v, where)
        elif isinstance(v, dict):
            for k, item in v.items():
                walk(k, f"{where} (a key)")
                walk(item, f"{where}.{k}" if isinstance(k, str) and k.isidentifier() else f"{where}[{k!a}]")
        elif isinstance(v, list):
            for i, item in enumerate(v):
                walk(item, f"{where}[{i}]")

    walk(value, where or param)


class EngineDeadError(RuntimeError):
    """The engine core has died; no request can be served (the server answers 503)."""


class ExecutorDeadError(EngineDeadError):
    """A worker process of a multi-process executor died, or its ranks fell out of step
    (an error on some ranks only, different sampled tokens): the tensor-parallel group
    cannot run another step."""


class ServerShuttingDownError(EngineDeadError):
    """The server's drain time (``--shutdown-timeout``) ran out; running requests end with
    this (a 503, or a stream's error event and ``[DONE]``)."""
