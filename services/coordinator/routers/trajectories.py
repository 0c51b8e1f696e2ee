"""``POST /v1/trajectories``: submit one trajectory group (binary ``deltarl-traj-v1``)."""

from __future__ import annotations

from anyio import CapacityLimiter, to_thread
from fastapi import APIRouter, Request, Response

from deltarl.services.coordinator.deps import CoordinatorDep, WorkerAuth
from deltarl.services.coordinator.errors import ApiError
from deltarl.services.coordinator.routers.common import ERRORS, MSGPACK
from deltarl.services.coordinator.schemas import SubmitResult

router = APIRouter(
    prefix="/v1", tags=["trajectories"], responses={**ERRORS, 413: ERRORS[422], 415: ERRORS[422]}
)
INLINE_DECODE_BYTES = 256 << 10  # groups above this are decoded in a worker thread
DECODE_LIMITER = CapacityLimiter(2)  # large groups decoded at once (memory: ~15x each)


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
    holder = getattr(request.state, "worker_id", None)  # set by a per-worker token
    group = None
    if len(payload) > INLINE_DECODE_BYTES:
        # decoding builds Python lists (~15x the payload): in a thread, a few at a time, so a
        # large group stalls neither the event loop nor the coordinator's memory
        group = await to_thread.run_sync(coordinator.decode, payload, limiter=DECODE_LIMITER)
    # small groups (~20 KB: well under 1 ms) on the loop with SQLite, like heartbeats
    sid, duplicate, depth, latest = await coordinator.run(
        coordinator.submit, payload, holder, group
    )
    result = SubmitResult(
        submission_id=sid, duplicate=duplicate, queue_depth=depth, current_version=latest
    )
    return Response(result.model_dump_json(), media_type="application/json")
