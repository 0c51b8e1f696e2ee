"""HTTP plumbing of the environment server: request parsing, the session header, and the error
handlers that answer every failure as ``{"code", "detail"}`` with the status of
:data:`~.models.HTTP_STATUS`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from deltarl.env_server.core.models import (
    HTTP_STATUS,
    SESSION_HEADER,
    EnvError,
    ErrorCode,
    ErrorResponse,
)

logger = logging.getLogger(__name__)

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


def validation_text(errors: list[Any], limit: int = 5) -> str:
    """``loc: msg`` of the first errors, never the (possibly huge) input itself."""
    parts = []
    for err in errors[:limit]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    more = f" (+{len(errors) - limit} more)" if len(errors) > limit else ""
    return "; ".join(parts) + more


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

    @app.exception_handler(EnvError)
    async def _env_error(_: Request, exc: EnvError) -> Response:
        return answer(exc.code, exc.message)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> Response:
        errors = list(exc.errors())
        if any(e.get("type") == "json_invalid" for e in errors):
            return answer(ErrorCode.INVALID_JSON, "the body is not valid JSON")
        return answer(ErrorCode.VALIDATION_ERROR, validation_text(errors))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        code = _HTTP_CODES.get(exc.status_code, ErrorCode.INTERNAL_ERROR)
        return answer(code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error", exc_info=exc)
        return answer(ErrorCode.INTERNAL_ERROR, f"internal error: {type(exc).__name__}")
