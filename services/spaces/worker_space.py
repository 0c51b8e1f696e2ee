"""``deltarl spaces worker``: the rollout worker behind the HTTP port a Docker Space requires.

A Docker Space is reported healthy only while something answers on its ``app_port``, and a
rollout worker serves no HTTP. This launcher therefore

1. serves ``GET /`` and ``GET /health`` on ``0.0.0.0:<port>`` (JSON: the worker's state, its
   pid, uptime and exit code; 200 while the worker runs, 503 once it has exited);
2. runs ``deltarl rollout`` as a child process (same environment, same stdout/stderr, so its
   logs are the Space's logs);
3. forwards SIGTERM/SIGINT to the child, waits for it, and exits with the child's exit status
   (128 + N when a signal N killed it):
   a worker that stops stops the Space (shown as an error on its page) instead of leaving an
   idle GPU that looks healthy.

Standard library only; no settings are read here (the child reads ``DELTARL_ROLLOUT_*``).
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from typing import Any

logger = logging.getLogger(__name__)

ROLLOUT_COMMAND = (sys.executable, "-m", "deltarl", "rollout")


class _State:
    """What the health endpoint reports (written by the main thread, read by the server)."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.pid: int | None = None
        self.exit_code: int | None = None

    def body(self) -> dict[str, Any]:
        state = "starting" if self.pid is None else "running"
        if self.exit_code is not None:
            state = "exited"
        return {
            "service": "rollout",
            "state": state,
            "pid": self.pid,
            "exit_code": self.exit_code,
            "uptime_s": round(time.monotonic() - self.started, 1),
        }


def _handler(state: _State) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] not in ("/", "/health"):
                self.send_error(404)
                return
            body = state.body()
            data = json.dumps(body).encode()
            self.send_response(503 if body["state"] == "exited" else 200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # the proxy polls: stay quiet
            return

    return Handler


def run_worker(port: int, command: Sequence[str] = ROLLOUT_COMMAND, host: str = "0.0.0.0") -> int:
    """Serve the health endpoint on ``host:port`` while ``command`` runs; its exit status."""
    state = _State()
    server = ThreadingHTTPServer((host, port), _handler(state))
    thread = threading.Thread(target=server.serve_forever, name="space-health", daemon=True)
    thread.start()
    logger.info("health endpoint on %s:%d; starting %s", host, server.server_port, command)
    child = subprocess.Popen(list(command))
    state.pid = child.pid

    def forward(signum: int, frame: FrameType | None) -> None:
        logger.info("signal %d: passing it to the worker (pid %d)", signum, child.pid)
        child.send_signal(signum)

    # Signal handlers can only be installed from the main thread (the Space's case).
    main = threading.current_thread() is threading.main_thread()
    signals = (signal.SIGTERM, signal.SIGINT) if main else ()
    previous = {s: signal.signal(s, forward) for s in signals}
    try:
        code = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    state.exit_code = code
    logger.log(logging.INFO if code == 0 else logging.ERROR, "the worker exited with %d", code)
    server.shutdown()
    server.server_close()
    return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell reports
