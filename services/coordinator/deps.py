"""Typed FastAPI dependencies: the coordinator instance and role checks."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from .auth import check_role
from .service import Coordinator


def get_coordinator(request: Request) -> Coordinator:
    coordinator: Coordinator = request.app.state.coordinator
    return coordinator


def _trainer(request: Request) -> None:
    check_role(request.app.state.coordinator.settings, "trainer", request)


def _worker(request: Request) -> None:
    check_role(request.app.state.coordinator.settings, "worker", request)


def _reader(request: Request) -> None:
    check_role(request.app.state.coordinator.settings, "reader", request)


CoordinatorDep = Annotated[Coordinator, Depends(get_coordinator)]
TrainerAuth = Depends(_trainer)
WorkerAuth = Depends(_worker)
ReaderAuth = Depends(_reader)
