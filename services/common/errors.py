"""One way for a service to answer every failure with its own error codes: ``{"code",
"detail"}`` bodies (the env server's and the teacher's), installed by
:func:`install_error_handlers`.

:func:`validation_text` is light (clients use it too); FastAPI is imported by the installer.

A service names its error class and how to read a code and a text from it, its codes for the
HTTP errors Starlette raises itself (404, 405, ...), its code for a bug and, when FastAPI parses
its bodies, its codes for a body that is not JSON and one that does not validate. A bug is
logged with its traceback and answered with a code and the exception's type, never its text.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # FastAPI loads with a server, not with a client that only reads errors
    from fastapi import FastAPI, Request
    from fastapi.responses import Response

logger = logging.getLogger(__name__)

C = TypeVar("C")
E = TypeVar("E", bound=Exception)


def validation_text(errors: list[Any], limit: int = 5) -> str:
    """``loc: msg`` of the first errors, never the (possibly huge) input itself."""
    parts = []
    for err in errors[:limit]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    more = f" (+{len(errors) - limit} more)" if len(errors) > limit else ""
    return "; ".join(parts) + more


def install_error_handlers(
    app: FastAPI,
    answer: Callable[[C, str], Response],
    *,
    error: type[E],
    code_of: Callable[[E], tuple[C, str]],
    http_codes: Mapping[int, C],
    internal: C,
    invalid: tuple[C, C] | None = None,
) -> None:
    """Answer every failure of ``app`` through ``answer(code, detail)``: ``error`` with
    ``code_of(exc)``, Starlette's HTTP errors with ``http_codes`` (else ``internal``), FastAPI's
    body errors with ``invalid`` = (not JSON, not valid) when given, anything else with
    ``internal``."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(error)
    async def _service_error(_: Request, exc: E) -> Response:
        return answer(*code_of(exc))

    if invalid is not None:
        not_json, not_valid = invalid

        @app.exception_handler(RequestValidationError)
        async def _invalid(_: Request, exc: RequestValidationError) -> Response:
            errors = list(exc.errors())
            if any(e.get("type") == "json_invalid" for e in errors):
                return answer(not_json, "the body is not valid JSON")
            return answer(not_valid, validation_text(errors))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        return answer(http_codes.get(exc.status_code, internal), str(exc.detail))

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error", exc_info=exc)
        return answer(internal, f"internal error: {type(exc).__name__}")
