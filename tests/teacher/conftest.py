"""Fixtures of the teacher tests: the tiny engine, an in-process app, a live server."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from support import LiveServer
from teacher_helpers import settings, tiny_engine

from deltarl.teacher.app import create_app
from deltarl.teacher.engines.transformers_engine import TransformersTeacher


@pytest.fixture(scope="session")
def engine() -> TransformersTeacher:
    return tiny_engine()


@pytest.fixture
def make_client(engine: TransformersTeacher) -> Iterator[Callable[..., TestClient]]:
    clients: list[TestClient] = []

    def make(**overrides: Any) -> TestClient:
        client = TestClient(create_app(settings(**overrides), engine=engine))
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


@pytest.fixture
def client(make_client: Callable[..., TestClient]) -> TestClient:
    return make_client()


@pytest.fixture
def live_server(engine: TransformersTeacher) -> Iterator[Callable[..., LiveServer]]:
    servers: list[LiveServer] = []

    def start(**overrides: Any) -> LiveServer:
        server = LiveServer(create_app(settings(**overrides), engine=engine)).__enter__()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.__exit__(None, None, None)
