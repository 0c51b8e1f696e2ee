"""``/v1/batches``: lease (trainer pulls), extend, ack, nack; ``/v1/admission`` (worker asks)."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request, Response
from pydantic import Field

from deltarl.services.coordinator.deps import CoordinatorDep, TrainerAuth, WorkerAuth
from deltarl.services.coordinator.routers.common import ERRORS, MSGPACK
from deltarl.services.coordinator.schemas import (
    AckRequest,
    AckResult,
    AdmissionRequest,
    AdmissionResponse,
    LeaseExtension,
    encode_leased_batch,
)
from deltarl.services.coordinator.schemas.common import WireModel

router = APIRouter(prefix="/v1", tags=["batches"], responses=ERRORS)


class LeaseRequest(WireModel):
    max_groups: int = Field(
        ge=1, le=1_000_000, description="Most groups to lease (at most max_batch_groups)."
    )
    lease_s: float | None = Field(
        default=None, gt=0, description="Lease duration (s); None: the server default."
    )
    wait_s: float = Field(
        default=0.0, ge=0, le=60, description="Long poll: wait up to this for a non-empty batch."
    )


@router.post(
    "/batches/lease",
    dependencies=[TrainerAuth],
    response_class=Response,
    responses={200: {"content": {MSGPACK: {}}, "description": "encode_leased_batch bytes"}},
)
async def lease(body: LeaseRequest, request: Request, coordinator: CoordinatorDep) -> Response:
    """Lease the oldest groups (see ``deltarl.services.coordinator.schemas.batches`` for the protocol).
    The answer is msgpack: decode with ``decode_leased_batch``. Empty batch: ``batch_id == ""``."""
    metrics = request.app.state.metrics
    start = time.monotonic()
    deadline = start + body.wait_s
    while True:
        leased, payloads = await coordinator.run(coordinator.lease, body.max_groups, body.lease_s)
        if leased.items or time.monotonic() >= deadline or await request.is_disconnected():
            break
        await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
    if leased.items:
        now = time.time()
        metrics.lease_wait_seconds.observe(time.monotonic() - start)
        for item in leased.items:
            metrics.queue_wait_seconds.observe(max(0.0, now - item.submitted_at))
    return Response(encode_leased_batch(leased, payloads), media_type=MSGPACK)


@router.post("/batches/{batch_id}/ack", response_model=AckResult, dependencies=[TrainerAuth])
async def ack(
    batch_id: str, coordinator: CoordinatorDep, body: AckRequest | None = None
) -> AckResult:
    """Remove the batch's groups for good (409 ``lease_expired`` if too late); the groups named
    in ``rejected`` become dead letters (422 ``bad_rejection`` if one is not the batch's)."""
    rejected = [] if body is None else body.rejected
    return await coordinator.run(coordinator.ack, batch_id, False, rejected)


@router.post("/batches/{batch_id}/nack", response_model=AckResult, dependencies=[TrainerAuth])
async def nack(batch_id: str, coordinator: CoordinatorDep) -> AckResult:
    """Return the batch's groups to the head of the queue now."""
    return await coordinator.run(coordinator.ack, batch_id, True)


class ExtendRequest(WireModel):
    lease_s: float | None = Field(
        default=None, gt=0, description="New lease from now (s); None: the server default."
    )


@router.post(
    "/batches/{batch_id}/extend", response_model=LeaseExtension, dependencies=[TrainerAuth]
)
async def extend(batch_id: str, body: ExtendRequest, coordinator: CoordinatorDep) -> LeaseExtension:
    """Keep a lease alive: its expiry becomes now + ``lease_s`` (409 ``lease_expired`` if it
    already expired, was acked or nacked)."""
    return await coordinator.run(coordinator.extend, batch_id, body.lease_s)


@router.post("/admission", response_model=AdmissionResponse, dependencies=[WorkerAuth])
async def admission(body: AdmissionRequest, coordinator: CoordinatorDep) -> AdmissionResponse:
    """How many more groups are worth starting now (see AdmissionResponse)."""
    return await coordinator.run(coordinator.admission, body)
