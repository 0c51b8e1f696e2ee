"""Schemathesis against the teacher's own OpenAPI: every operation, requests generated from the
schema (valid and invalid, binary bodies as random bytes, JSON bodies from the request model),
sent over HTTP to one live server with the right token, a wrong one and none; no answer may be a
5xx."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings
from support import LiveServer
from teacher_helpers import TOKEN, settings, tiny_engine

from deltarl.teacher.app import create_app
from deltarl.teacher.wire import BINARY_MEDIA_TYPE

EXAMPLES = 25  # per operation: x 3 roles


@schemathesis.serializer(BINARY_MEDIA_TYPE)
def _binary(ctx: Any, value: Any) -> bytes:
    """Generated binary bodies as they are (random bytes); anything else as its UTF-8 text."""
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    return str(value).encode("utf-8", "surrogatepass")


ENGINE = tiny_engine()

schema = schemathesis.openapi.from_dict(create_app(settings(), engine=ENGINE).openapi())
ROLES = {"token": {"X-Deltarl-Token": TOKEN}, "wrong": {"X-Deltarl-Token": "y" * 24}, "none": {}}


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    with LiveServer(create_app(settings(max_seq_len=256), engine=ENGINE)) as server:
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
        response = case.call(base_url=live.url, headers=headers, timeout=30)
        assert response.status_code < 500, (
            f"{role}: {case.method} {case.formatted_path} -> {response.status_code}\n"
            f"{case.as_curl_command()}\n{response.text[:500]}"
        )
