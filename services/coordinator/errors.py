"""The coordinator's refusals, each mapped to one HTTP status and a stable code."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """Raised by the service layer; the app turns it into an ``ErrorResponse`` JSON body."""

    def __init__(self, status: int, code: str, message: str, detail: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.detail = detail


def not_found(code: str, message: str, detail: Any = None) -> ApiError:
    return ApiError(404, code, message, detail)


def conflict(code: str, message: str, detail: Any = None) -> ApiError:
    return ApiError(409, code, message, detail)


def invalid(code: str, message: str, detail: Any = None) -> ApiError:
    return ApiError(422, code, message, detail)
