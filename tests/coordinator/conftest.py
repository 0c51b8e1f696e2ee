"""Fixtures: a real redis-server per session, and every store backend behind one fixture."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import support
from support import free_port

from deltarl.services.coordinator.store import CoordinatorStore


class RedisServer:
    """A redis-server in a temp dir (AOF on, fsync always), restartable on the same port."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        exe = shutil.which("redis-server")
        assert exe is not None
        self.proc = subprocess.Popen(
            [
                exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.workdir),
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--save",
                "",
                "--protected-mode",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.skip(
            "redis-server is not installed (apt-get install -y redis-server; make system-deps)"
        )
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


StoreFactory = Callable[..., CoordinatorStore]


@pytest.fixture(params=["sqlite", "redis"])
def store_factory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreFactory]:
    """Returns a function opening the same store again (a coordinator restart)."""
    opened: list[CoordinatorStore] = []
    if request.param == "sqlite":
        from deltarl.services.coordinator.store.sqlite_store import SQLiteStore

        path = tmp_path / "coord.sqlite3"

        def make(**options: Any) -> CoordinatorStore:
            opened.append(SQLiteStore(path, **options))
            return opened[-1]
    else:
        server: RedisServer = request.getfixturevalue("redis_server")
        from deltarl.services.coordinator.store.redis_store import RedisStore

        prefix = "t" + uuid.uuid4().hex[:12]

        def make(**options: Any) -> CoordinatorStore:
            opened.append(RedisStore(server.url, prefix=prefix, **options))
            return opened[-1]

    yield make
    for s in opened:
        s.close()


@pytest.fixture
def store(store_factory: StoreFactory) -> CoordinatorStore:
    return store_factory()


TRAINER_TOKEN = "trainer-secret-token"
WORKER_TOKEN = "worker-secret-token"


class LiveServer(support.LiveServer):
    """A coordinator made from ``settings``, served at once (real HTTP, real SSE)."""

    def __init__(
        self, settings: object, clock: Callable[[], float] | None = None, pacing: object = None
    ) -> None:
        from deltarl.services.coordinator.app import create_app

        app = create_app(settings, clock=clock, pacing=pacing or support.fast_pacing())  # type: ignore[arg-type]
        super().__init__(app)
        self.start()


def coordinator_settings(tmp_path: Path, **overrides: object) -> object:
    from deltarl.services.coordinator.settings import CoordinatorSettings

    values: dict[str, object] = {
        "sqlite_path": str(tmp_path / "coord.sqlite3"),
        "trainer_token": TRAINER_TOKEN,
        "worker_token": WORKER_TOKEN,
    }
    values.update(overrides)
    return CoordinatorSettings(**values)  # type: ignore[arg-type]


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[Callable[..., LiveServer]]:
    servers: list[LiveServer] = []

    def make(
        clock: Callable[[], float] | None = None, pacing: object = None, **overrides: object
    ) -> LiveServer:
        settings = coordinator_settings(tmp_path, **overrides)
        servers.append(LiveServer(settings, clock=clock, pacing=pacing))
        return servers[-1]

    yield make
    for s in servers:
        s.stop()


@pytest.fixture
def server(make_server: Callable[..., LiveServer]) -> LiveServer:
    return make_server()
