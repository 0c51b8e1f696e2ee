"""Shared route metadata: the error responses every route may give (for OpenAPI)."""

from __future__ import annotations

from typing import Any

from deltarl.services.coordinator.schemas import ErrorResponse

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (401, 403, 404, 409, 413, 422)
}
MSGPACK = "application/msgpack"
