"""Test helpers every suite shares: a free loopback port, and an ASGI app served by uvicorn in a
thread (real HTTP, SSE and WebSockets) for as long as a test needs it."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

START_TIMEOUT_S = 10.0  # generous: a loaded 2-core machine starts uvicorn in well under a second


def free_port() -> int:
    """A port nobody listens on now (the OS picks it; a race with another process is possible
    but has not been seen: prefer ``LiveServer``, which keeps its socket bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LiveServer:
    """``app`` served by uvicorn in a daemon thread on a socket bound here, so the port is taken
    before the server starts. ``with LiveServer(app) as server`` or ``start()`` / ``stop()``."""

    def __init__(self, app: Any, **config: Any) -> None:
        import uvicorn

        self.app = app
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        settings = {"log_level": "warning", "lifespan": "on"} | config
        self.server = uvicorn.Server(uvicorn.Config(app, **settings))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"uvicorn did not start within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()

    def __enter__(self) -> LiveServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
