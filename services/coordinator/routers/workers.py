"""``/v1/workers``: register (rejoin), heartbeat, weight proof, list, get, remove, and clearing a
worker's rejected groups."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Response

from deltarl.services.coordinator.deps import CoordinatorDep, ReaderAuth, TrainerAuth, WorkerAuth
from deltarl.services.coordinator.routers.common import ERRORS
from deltarl.services.coordinator.schemas import (
    HeartbeatAck,
    ProofAnswer,
    ProofResult,
    WorkerHeartbeat,
    WorkerInfo,
    WorkerRegistration,
)
from deltarl.services.coordinator.schemas.common import ID_PATTERN

router = APIRouter(prefix="/v1/workers", tags=["workers"], responses=ERRORS)
WorkerId = Annotated[str, Path(pattern=ID_PATTERN)]


@router.post("", response_model=HeartbeatAck, dependencies=[WorkerAuth])
async def register(body: WorkerRegistration, coordinator: CoordinatorDep) -> HeartbeatAck:
    """Register, or re-register after a restart or a loss (a clean rejoin)."""
    return await coordinator.run(coordinator.register, body)


@router.post("/{worker_id}/heartbeat", response_model=HeartbeatAck, dependencies=[WorkerAuth])
async def heartbeat(
    worker_id: WorkerId, body: WorkerHeartbeat, coordinator: CoordinatorDep
) -> Response:
    """The hottest route (every worker, every second); the answer is serialized once (returning
    a Response skips FastAPI's re-validation of the response model)."""
    ack = await coordinator.run(coordinator.heartbeat, worker_id, body)
    return Response(ack.model_dump_json(), media_type="application/json")


@router.post("/{worker_id}/proof", response_model=ProofResult, dependencies=[WorkerAuth])
async def prove(worker_id: WorkerId, body: ProofAnswer, coordinator: CoordinatorDep) -> ProofResult:
    """Answer the weight challenge of a heartbeat: ``verified`` when the answer is right and in
    time (then ``weights_verified`` is true at that version); each challenge is answered once.
    409 ``unknown_challenge`` when no such challenge is outstanding."""
    return await coordinator.run(coordinator.prove, worker_id, body)


@router.get("", response_model=list[WorkerInfo], dependencies=[ReaderAuth])
async def list_workers(coordinator: CoordinatorDep) -> list[WorkerInfo]:
    return await coordinator.run(coordinator.workers)


@router.get("/{worker_id}", response_model=WorkerInfo, dependencies=[ReaderAuth])
async def get_worker(worker_id: WorkerId, coordinator: CoordinatorDep) -> WorkerInfo:
    return await coordinator.run(coordinator.worker, worker_id)


@router.delete("/{worker_id}", status_code=204, response_class=Response, dependencies=[WorkerAuth])
async def remove_worker(worker_id: WorkerId, coordinator: CoordinatorDep) -> Response:
    """Leave the pool (elastic scale-down). The worker's queued groups stay queued."""
    await coordinator.run(coordinator.remove_worker, worker_id)
    return Response(status_code=204)


@router.delete(
    "/{worker_id}/rejections",
    status_code=204,
    response_class=Response,
    dependencies=[TrainerAuth],
)
async def clear_rejections(worker_id: WorkerId, coordinator: CoordinatorDep) -> Response:
    """Forget the groups the trainer refused from this worker (it is no longer suspect); 404
    ``no_rejections`` when it has none. Trainer role: an operator vouches for the worker."""
    await coordinator.run(coordinator.clear_rejections, worker_id)
    return Response(status_code=204)
