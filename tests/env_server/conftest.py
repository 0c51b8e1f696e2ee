"""Fixtures of the environment-server tests: an in-process app and a live uvicorn server."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from env_helpers import settings
from fastapi.testclient import TestClient
from support import LiveServer

from deltarl.env_server.core.app import create_app


@pytest.fixture
def make_client() -> Iterator[Callable[..., TestClient]]:
    clients: list[TestClient] = []

    def make(**overrides: Any) -> TestClient:
        client = TestClient(create_app(settings(**overrides)))
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
def live_server() -> Iterator[Callable[..., LiveServer]]:
    servers: list[LiveServer] = []

    def start(**overrides: Any) -> LiveServer:
        s = settings(**overrides)
        server = LiveServer(create_app(s), ws_max_size=s.max_body_bytes).__enter__()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.__exit__(None, None, None)
