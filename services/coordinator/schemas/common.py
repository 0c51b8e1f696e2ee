"""Schemas used by every route: the error body and the health answer."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deltarl.services.common.client_headers import TOKEN_HEADER as TOKEN_HEADER  # re-exported
from deltarl.weightsync.manifest import INT64_MAX, MAX_VERSION

# Identifiers chosen by clients (worker ids, group ids, idempotency keys): printable, no spaces,
# short enough to be used as Redis keys and Prometheus label values, and path-safe (no '/': a
# worker id is a path segment of /v1/workers/{worker_id}/...).
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$"

# Every integer on the wire is bounded, so that bad input is a 422 and never reaches a store it
# would overflow (SQLite and Redis hold signed 64-bit integers). A version has at most 12 digits
# (the bucket's key format, MAX_VERSION); counts fit 64 bits (INT64_MAX).
MAX_IN_FLIGHT = 100_000  # groups one worker may report in flight (WorkerHeartbeat.in_flight)
Version = Annotated[int, Field(ge=0, le=MAX_VERSION)]
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]


class WireModel(BaseModel):
    """Base of all wire models: unknown fields are an error (a typo must not pass silently)."""

    model_config = ConfigDict(extra="forbid", frozen=False)


class ErrorBody(WireModel):
    code: str = Field(
        description="Stable machine-readable code, e.g. 'stale_version', 'unknown_worker', "
        "'version_conflict', 'validation_error', 'body_too_large', 'unauthorized'."
    )
    message: str = Field(description="What went wrong and what to do about it, for a person.")
    detail: Any = Field(
        default=None,
        description="Structured context (validation errors, current version, ...); None if none.",
    )


class ErrorResponse(WireModel):
    """Body of every 4xx/5xx answer of the coordinator."""

    error: ErrorBody = Field(description="What was refused and why.")


class Health(WireModel):
    """``GET /health``: the process is up and its store answers."""

    status: Literal["healthy", "degraded"] = Field(
        description="'healthy': the store answered; 'degraded': it did not (see detail)."
    )
    store: str = Field(description="Store backend in use: 'sqlite' or 'redis'.")
    detail: str | None = Field(default=None, description="Why degraded; None when healthy.")
