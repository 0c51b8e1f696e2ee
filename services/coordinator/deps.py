"""Typed FastAPI dependencies: the coordinator instance and role checks.

They are ``async`` on purpose: they do no I/O, and FastAPI would run plain ``def`` dependencies
in the thread pool (one thread hop each, per request).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from deltarl.services.coordinator.auth import check_role, check_worker
from deltarl.services.coordinator.service import Coordinator


async def get_coordinator(request: Request) -> Coordinator:
    coordinator: Coordinator = request.app.state.coordinator
    return coordinator


async def _trainer(request: Request) -> None:
    check_role(request.app.state.coordinator.settings, "trainer", request)


async def _worker(request: Request) -> None:
    await check_worker(request.app.state.coordinator.settings, request)


async def _reader(request: Request) -> None:
    check_role(request.app.state.coordinator.settings, "reader", request)


CoordinatorDep = Annotated[Coordinator, Depends(get_coordinator)]
TrainerAuth = Depends(_trainer)
WorkerAuth = Depends(_worker)
ReaderAuth = Depends(_reader)
