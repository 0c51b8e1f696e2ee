"""HTTP plumbing of the environment server: request parsing, the session header, and the error
handlers that answer every failure as ``{"code", "detail"}`` with the status of
:data:`~.models.HTTP_STATUS`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from deltarl.env_server.core.models import (
    HTTP_STATUS,
    SESSION_HEADER,
    EnvError,
    ErrorCode,
    ErrorResponse,
)
from deltarl.services.common.errors import install_error_handlers as install_service_errors
from deltarl.services.common.errors import validation_text

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 409, 413, 422, 503)
}
_HTTP_CODES = {
    400: ErrorCode.INVALID_JSON,  # FastAPI: "There was an error parsing the body"
    404: ErrorCode.NOT_FOUND,
    405: ErrorCode.METHOD_NOT_ALLOWED,
    413: ErrorCode.PAYLOAD_TOO_LARGE,
}
_SESSION_KEY = SESSION_HEADER.lower()
M = TypeVar("M", bound=BaseModel)


def body_doc(model: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI request body of a route that parses its body itself (see :func:`parse`)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"content": {"application/json": {"schema": ref}}}}


def parse(model: type[M], body: bytes, default: bool = False) -> M:
    """Validate a JSON body straight from bytes (pydantic-core's parser, no FastAPI body
    machinery: about half the cost of a step). Empty body: the model's defaults if ``default``."""
    if not body and default:
        return model()
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_input=False)
        if any(e["type"] == "json_invalid" for e in errors):
            raise EnvError(ErrorCode.INVALID_JSON, "the body is not valid JSON (UTF-8)") from None
        raise EnvError(ErrorCode.VALIDATION_ERROR, validation_text(errors)) from None


async def read_body(request: Request) -> bytes:
    try:
        return await request.body()
    except ClientDisconnect:  # the client left, or the guard cut an oversized body and answered
        raise EnvError(ErrorCode.INVALID_JSON, "the body was not received completely") from None


def session_header(request: Request) -> str | None:
    value = request.headers.get(_SESSION_KEY)
    return value[:64] if value else None


def error_response(code: ErrorCode, detail: str) -> Response:
    body = ErrorResponse(code=code, detail=detail).model_dump_json().encode("utf-8")
    return Response(body, status_code=HTTP_STATUS[code], media_type="application/json")


def install_error_handlers(app: FastAPI, count: Callable[[str], None]) -> None:
    """Answer every failure of ``app`` with its :class:`~.models.ErrorCode` (``count`` is
    called with each code's value, for the metrics); a bug is logged with its traceback and
    answered ``INTERNAL_ERROR``."""

    def answer(code: ErrorCode, detail: str) -> Response:
        count(code.value)
        return error_response(code, detail)

    install_service_errors(
        app,
        answer,
        error=EnvError,
        code_of=lambda exc: (exc.code, exc.message),
        http_codes=_HTTP_CODES,
        internal=ErrorCode.INTERNAL_ERROR,
        invalid=(ErrorCode.INVALID_JSON, ErrorCode.VALIDATION_ERROR),
    )
