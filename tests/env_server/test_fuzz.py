"""Schemathesis against the env server's own OpenAPI: every HTTP operation, requests
generated from the schema (valid and invalid), sent over HTTP to one live server (uvicorn on
loopback) with the right token, a wrong one and none; no answer may be a 5xx. Bounded: a fixed
number of examples per operation. WS /ws is not in the OpenAPI; test_env_ws.py attacks it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from env_helpers import settings
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings
from support import LiveServer

from deltarl.env_server.core.app import create_app
from deltarl.env_server.core.models import TOKEN_HEADER

TOKEN = "env-fuzz-token-0123456789"
EXAMPLES = 25  # per operation: x 3 roles

schema = schemathesis.openapi.from_dict(create_app(settings(token=TOKEN)).openapi())
ROLES = {"token": {TOKEN_HEADER: TOKEN}, "wrong": {TOKEN_HEADER: "y" * 24}, "none": {}}


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    with LiveServer(create_app(settings(token=TOKEN))) as server:
        yield server


@pytest.mark.slow
@schema.parametrize()
@hypothesis_settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_no_request_gets_a_server_error(case: Any, live: LiveServer) -> None:
    for role, headers in ROLES.items():
        response = case.call(base_url=live.url, headers=headers, timeout=10)
        assert response.status_code < 500, (
            f"{role}: {case.method} {case.formatted_path} -> {response.status_code}\n"
            f"{case.as_curl_command()}\n{response.text[:500]}"
        )
