"""``/v1/versions``: record (trainer), list, get, the live event stream, and the trainer's weight
challenges for each version."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Header, Path, Query, Request, Response
from sse_starlette.sse import EventSourceResponse

from deltarl.services.coordinator.deps import CoordinatorDep, ReaderAuth, TrainerAuth
from deltarl.services.coordinator.errors import invalid, not_found
from deltarl.services.coordinator.routers.common import ERRORS
from deltarl.services.coordinator.schemas import (
    ChallengePool,
    ChallengePoolResult,
    ChallengePoolStatus,
    VersionPublish,
    VersionRecord,
)
from deltarl.services.coordinator.schemas.common import MAX_VERSION

router = APIRouter(prefix="/v1/versions", tags=["versions"], responses=ERRORS)
After = Annotated[
    int | None,
    Query(ge=-1, le=MAX_VERSION, description="Only versions newer than this (-1: all)."),
]


@router.post("", response_model=VersionRecord, status_code=201, dependencies=[TrainerAuth])
async def publish(
    body: VersionPublish, coordinator: CoordinatorDep, response: Response
) -> VersionRecord:
    """Record a version after its objects and manifest are in the bucket. 201 when new, 200 for
    an identical retry; 409 when out of order or conflicting."""
    record, created = await coordinator.run(coordinator.publish, body.manifest, body.limits)
    if not created:
        response.status_code = 200
    return record


@router.get("", response_model=list[VersionRecord], dependencies=[ReaderAuth])
async def list_versions(
    coordinator: CoordinatorDep,
    after: After = None,
    limit: Annotated[int, Query(ge=1, le=1000, description="Most versions listed.")] = 100,
) -> list[VersionRecord]:
    return coordinator.versions.after(after, limit)


@router.get("/latest", response_model=VersionRecord, dependencies=[ReaderAuth])
async def latest(coordinator: CoordinatorDep) -> VersionRecord:
    record = coordinator.versions.latest()
    if record is None:
        raise not_found("no_version", "no version has been recorded yet")
    return record


def _event_id(value: str) -> int:
    """The version a ``Last-Event-ID`` header names (-1: before the first version)."""
    if re.fullmatch(r"-1|[0-9]{1,20}", value) is None or int(value) > MAX_VERSION:
        raise invalid(
            "bad_event_id", f"Last-Event-ID must be a version number (-1 to {MAX_VERSION})"
        )
    return int(value)


@router.get(
    "/events",
    dependencies=[ReaderAuth],
    response_class=EventSourceResponse,
    responses={200: {"content": {"text/event-stream": {}}, "description": "SSE of VersionRecord"}},
)
async def events(
    request: Request,
    after: After = None,
    last_event_id: Annotated[str | None, Header()] = None,
) -> EventSourceResponse:
    """Server-sent events: ``event: version``, ``id: <version>``, ``data: <VersionRecord JSON>``.
    Without ``after``/``Last-Event-ID`` the stream starts with the latest version; with them it
    replays every version newer than that first (reconnects lose nothing)."""
    if last_event_id is not None:
        after = _event_id(last_event_id)
    stream = request.app.state.events

    async def generate() -> AsyncIterator[dict[str, str]]:
        async for record in stream.subscribe(after):
            yield {"event": "version", "id": str(record.version), "data": record.model_dump_json()}

    return EventSourceResponse(generate(), ping=15, send_timeout=30)


@router.get("/{version}", response_model=VersionRecord, dependencies=[ReaderAuth])
async def get_version(
    version: Annotated[int, Path(ge=0, le=MAX_VERSION, description="Policy version.")],
    coordinator: CoordinatorDep,
) -> VersionRecord:
    return await coordinator.run(coordinator.version, version)


@router.post(
    "/{version}/challenges",
    response_model=ChallengePoolResult,
    dependencies=[TrainerAuth],
)
async def add_challenges(
    version: Annotated[int, Path(ge=0, le=MAX_VERSION, description="Policy version.")],
    body: ChallengePool,
    coordinator: CoordinatorDep,
) -> ChallengePoolResult:
    """Weight challenges for a recorded version: (nonce, answer) pairs the trainer computed on
    its own state; each nonce is issued once to a worker serving that version, and the answers
    are never shown on any route (docs/security.md). ``wanted``: how many more the fleet needs
    now (post them too)."""
    return await coordinator.run(coordinator.add_challenges, version, body)


@router.get(
    "/{version}/challenges",
    response_model=ChallengePoolStatus,
    dependencies=[ReaderAuth],
)
async def challenge_pool(
    version: Annotated[int, Path(ge=0, le=MAX_VERSION, description="Policy version.")],
    coordinator: CoordinatorDep,
) -> ChallengePoolStatus:
    """Where a version's weight challenges stand: pairs left, how many more the trainer should
    post (``wanted``), workers challenged and waiting for one (never an answer)."""
    return await coordinator.run(coordinator.challenge_pool, version)
