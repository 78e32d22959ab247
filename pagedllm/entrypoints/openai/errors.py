"""Errors in OpenAI's shape (https://platform.openai.com/docs/guides/error-codes): the
body ``{"error": {"message", "type", "param", "code"}}`` (``code`` = HTTP status), the
JSON response, a stream's error event, and the app's exception handlers: pydantic
failures and ``InvalidParameterError`` -> 400 naming the parameter, unknown path / method
-> 404 / 405, ``EngineDeadError`` and ``ServerShuttingDownError`` -> 503. A started stream
sends ``stream_error_body`` as one event instead (503 or 500), then ``[DONE]``."""
from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.entrypoints.openai.protocol import describe_validation_error
from pagedllm.errors import EngineDeadError, InvalidParameterError

# OpenAI's ``type`` of a few statuses that no handler names otherwise.
_HTTP_ERROR_TYPES = {404: "NotFoundError", 405: "MethodNotAllowedError"}


def error_body(message: str, param: str | None, code: int = 400,
               type_: str = "invalid_request_error") -> dict:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped (a message may quote a lone surrogate, which has no UTF-8)."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(message: str, param: str | None = None, code: int = 400,
                   type_: str = "invalid_request_error", headers: dict | None = None) -> JSONResponse:
    """An error response: status ``code``, ``error_body`` as its body."""
    return AsciiJSONResponse(error_body(message, param, code, type_), status_code=code, headers=headers)


def stream_error_body(e: BaseException) -> dict:
    """The body of a failed stream's error event: 503 when the engine has died, else 500."""
    if isinstance(e, EngineDeadError):
        return error_body(str(e), None, 503, "service_unavailable")
    return error_body(str(e), getattr(e, "param", None), 500, "internal_error")


async def _validation(_req: Request, exc: RequestValidationError):
    message, param = describe_validation_error(exc.errors())
    return error_response(message, param)


async def _http(_req: Request, exc: StarletteHTTPException):
    return error_response(str(exc.detail), None, exc.status_code,
                          _HTTP_ERROR_TYPES.get(exc.status_code, "invalid_request_error"))


async def _invalid(_req: Request, exc: InvalidParameterError):
    return error_response(str(exc), exc.param)


async def _dead(_req: Request, exc: EngineDeadError):
    return error_response(str(exc), None, 503, "service_unavailable")


def register_error_handlers(app: FastAPI) -> None:
    """Install the handlers of the module doc on ``app``."""
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(InvalidParameterError, _invalid)
    app.add_exception_handler(EngineDeadError, _dead)
