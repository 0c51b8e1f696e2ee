"""The client waits out a coordinator restart: a refused connection is retried for every call,
``lease`` included (the request never reached a server), within ``refused_wait_s``."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from support import GENEROUS_S, free_port

from deltarl.services.coordinator.app import create_app
from deltarl.services.coordinator.client import (
    AsyncCoordinatorClient,
    CoordinatorClient,
    _refused,
)

from .conftest import TRAINER_TOKEN, coordinator_settings

pytestmark = pytest.mark.network


class LateServer:
    """A coordinator that starts listening on ``port`` only after ``delay_s``."""

    def __init__(self, tmp_path: Path, port: int, delay_s: float) -> None:
        config = uvicorn.Config(
            create_app(coordinator_settings(tmp_path)),  # type: ignore[arg-type]
            host="127.0.0.1",
            port=port,
            log_level="warning",
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, args=(delay_s,), daemon=True)

    def _run(self, delay_s: float) -> None:
        time.sleep(delay_s)
        self.server.run()

    def __enter__(self) -> LateServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def test_lease_waits_for_a_restarting_coordinator(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with LateServer(tmp_path, port, 1.0), CoordinatorClient(url, TRAINER_TOKEN) as c:
        t0 = time.monotonic()
        batch = c.lease(1, wait_s=0.0)  # refused for about 1 s, then answered
        assert batch.lease.items == [] and time.monotonic() - t0 >= 0.9
        assert c.health().status == "healthy"


def test_async_client_waits_too(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    async def main() -> str:
        async with AsyncCoordinatorClient(url, TRAINER_TOKEN) as c:
            return (await c.health()).status

    with LateServer(tmp_path, port, 1.0):
        assert asyncio.run(main()) == "healthy"


def test_refusals_are_bounded_and_off_without_retries() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing will ever listen
    with CoordinatorClient(url, retries=0) as c:
        t0 = time.monotonic()
        with pytest.raises(httpx.ConnectError) as info:
            c.health()
        assert time.monotonic() - t0 < GENEROUS_S  # no retry: the default would wait 30 s
        assert _refused(info.value)
    with CoordinatorClient(url, TRAINER_TOKEN, refused_wait_s=0.5) as c:
        t0 = time.monotonic()
        with pytest.raises(httpx.ConnectError):
            c.lease(1)
        assert 0.5 <= time.monotonic() - t0 < GENEROUS_S


def test_other_transport_errors_are_not_refusals() -> None:
    assert not _refused(
        httpx.ConnectError("[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed")
    )
    assert not _refused(httpx.ReadTimeout("timed out"))
