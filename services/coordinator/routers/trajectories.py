"""``POST /v1/trajectories``: submit one trajectory group (binary ``deltarl-traj-v1``)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from deltarl.services.coordinator.deps import CoordinatorDep, WorkerAuth
from deltarl.services.coordinator.errors import ApiError
from deltarl.services.coordinator.routers.common import ERRORS, MSGPACK
from deltarl.services.coordinator.schemas import SubmitResult

router = APIRouter(prefix="/v1", tags=["trajectories"], responses={**ERRORS, 415: ERRORS[422]})


@router.post(
    "/trajectories",
    response_model=SubmitResult,
    dependencies=[WorkerAuth],
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {MSGPACK: {"schema": {"type": "string", "format": "binary"}}},
            "description": "A TrajectoryGroup encoded by deltarl.services.coordinator.schemas.encode_group.",
        }
    },
)
async def submit(request: Request, coordinator: CoordinatorDep) -> Response:
    """Queue a group. 200 with ``duplicate=true`` for a retry of an accepted idempotency key;
    409 ``stale_version`` / ``future_version`` when the group's versions are out of bounds."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != MSGPACK:
        raise ApiError(
            415,
            "unsupported_media_type",
            f"send the group as {MSGPACK} (encode_group), not {ctype!r}",
        )
    payload = await request.body()
    # like heartbeats: on the loop with SQLite (decode ~20 KB + one INSERT: well under 1 ms)
    holder = getattr(request.state, "worker_id", None)  # set by a per-worker token
    sid, duplicate, depth, latest = await coordinator.run(coordinator.submit, payload, holder)
    result = SubmitResult(
        submission_id=sid, duplicate=duplicate, queue_depth=depth, current_version=latest
    )
    return Response(result.model_dump_json(), media_type="application/json")
