"""Schemathesis against the coordinator's own OpenAPI: every operation, requests
generated from the schema (valid and invalid), sent over HTTP to one live coordinator (uvicorn on
loopback, SQLite) with the trainer's token, the worker's token, a wrong token and none; no answer
may be a 5xx. Bounded: a fixed number of examples per operation. ``/v1/versions/events`` (a
never-ending SSE stream) is left out; tests/coordinator covers it."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from deltarl.services.coordinator.app import create_app
from deltarl.services.coordinator.settings import CoordinatorSettings

from .conftest import TRAINER_TOKEN, WORKER_TOKEN, LiveServer, coordinator_settings

EXAMPLES = 12  # per operation: x 4 roles, ~800 requests


def _settings() -> CoordinatorSettings:
    s = coordinator_settings(Path(tempfile.mkdtemp(prefix="deltarl-fuzz-")))
    assert isinstance(s, CoordinatorSettings)
    return s


@schemathesis.serializer("application/msgpack")
def _msgpack(ctx: Any, value: Any) -> bytes:
    """Trajectory bodies: generated values packed as msgpack (the decoder sees real msgpack)."""
    return bytes(value) if isinstance(value, bytes | bytearray) else msgpack.packb(value)


# the schema as the app publishes it; requests go to a live server over HTTP
schema = schemathesis.openapi.from_dict(create_app(_settings()).openapi()).exclude(
    path="/v1/versions/events"
)

ROLES = {
    "trainer": {"X-Deltarl-Token": TRAINER_TOKEN},
    "worker": {"X-Deltarl-Token": WORKER_TOKEN},
    "wrong": {"X-Deltarl-Token": "x" * 24},
    "none": {},
}


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    server = LiveServer(_settings())
    yield server
    server.stop()


@pytest.mark.slow
@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_no_request_gets_a_server_error(case: Any, live: LiveServer) -> None:
    body = case.body
    if isinstance(body, dict) and isinstance(body.get("wait_s"), int | float):
        body["wait_s"] = min(body["wait_s"], 0.2)  # a lease long-polls up to wait_s: keep it short
    for role, headers in ROLES.items():
        response = case.call(base_url=live.url, headers=headers, timeout=10)
        assert response.status_code < 500, (
            f"{role}: {case.method} {case.formatted_path} -> {response.status_code}\n"
            f"{case.as_curl_command()}\n{response.text[:500]}"
        )
