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

    def __reduce__(self):   # pickles (a worker process's start-up error reaches the executor)
        return type(self), (self.param, str(self))


def check_unicode(param: str, text: str, where: str | None = None) -> None:
    """Raises InvalidParameterError naming ``param`` if ``text`` cannot be encoded as UTF-8:
    JSON's ``\\ud800``-style escapes can carry a lone UTF-16 surrogate, which no tokenizer,
    grammar compiler or hash accepts. The message names ``where`` (e.g. ``stop[1]``), or
    ``param``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidParameterError(
            param, f"{where or param} is not valid Unicode: a lone surrogate {text[e.start]!a} "
                   f"at character {e.start}") from None


def check_unicode_json(param: str, value, where: str | None = None) -> None:
    """``check_unicode`` for every string (keys too) inside a JSON value (dicts, lists,
    scalars; None passes), naming the first bad one's place from ``where`` (default
    ``param``) down, e.g. ``tools[0].function.description``.

    Raises:
        InvalidParameterError(param): a string holds a lone surrogate.
    """
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
    """The engine core has died (its loop raised, or its process exited); no request can
    be served any more. The server answers 503 and ``/health`` turns 503."""


class ExecutorDeadError(EngineDeadError):
    """A worker process of a multi-process executor died, or its ranks fell out of step
    (an error on some ranks only, different sampled tokens): the tensor-parallel group
    cannot run another step."""


class ServerShuttingDownError(EngineDeadError):
    """The server is stopping and its drain time (``--shutdown-timeout``) has run out: the
    requests still running end with this (an OpenAI-style 503, or a stream's error event
    and ``[DONE]``), as for a dead engine, rather than being cut off mid-response."""
