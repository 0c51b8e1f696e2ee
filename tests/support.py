"""Test helpers every suite shares: a free loopback port (:func:`deltarl.cluster.free_port`), an
ASGI app served by uvicorn in a thread (real HTTP, SSE and WebSockets) for as long as a test needs
it, and the ``deltarl`` command run in this process.

Helpers of one suite stay beside it (``coordinator/helpers.py``, ``env_server/env_helpers.py``,
...); what two suites need lives here."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from deltarl.cluster import free_port as free_port  # re-exported: the one the services use

# A wall-clock bound that only a hang or a wait the code should not make breaks, never a slow or
# loaded machine (the operations it bounds take well under a second on an idle 2-core one, and the
# failures it catches take the tens of seconds to minutes of a retry loop or quadratic time).
# Behaviour is shown by events and counters; this is for where only time shows a wait not made.
GENEROUS_S = 15.0

START_TIMEOUT_S = 10.0  # generous: a loaded 2-core machine starts uvicorn in well under a second


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


# ``deltarl ARGS`` in this process. A subprocess per call cost 3-10 s on 2 cores (Python, torch and
# the project imported again each time), which made the CLI tests the slowest of the fast tier.
# ``deltarl(...)`` invokes the same typer application through click's test runner and answers like
# subprocess.run (returncode, stdout, stderr). What only a real process shows (the installed entry
# point, memory high-water marks, signals) stays with tests that spawn one.


@dataclass(frozen=True)
class Completed:
    args: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str


def deltarl(*args: str) -> Completed:
    """Run ``deltarl *args``; an exception other than the command's own exit propagates (a
    crash is a test failure with its traceback, not an exit code to compare)."""
    from typer.testing import CliRunner

    from deltarl.cli import app

    result = CliRunner().invoke(app, list(args), catch_exceptions=True)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return Completed(args, result.exit_code, result.stdout, result.stderr)


def fast_pacing(**overrides: float) -> Any:
    """The coordinator's :class:`Pacing` for tests: status never cached (a test reads what it
    just did), versions from another process polled every 50 ms."""
    from deltarl.services.coordinator.service import Pacing

    return Pacing(**({"status_cache_s": 0.0, "event_poll_s": 0.05} | overrides))
