"""``deltarl spaces worker``: the rollout worker behind the HTTP port a Docker Space requires.

The worker serves its own ``GET /health`` and ``GET /metrics`` (rollout/service/http.py), but a Space
should not face it directly: its ``/health`` is 503 while the worker loads the model and until
the trainer publishes its first version (which may be hours after the Space starts, or never if
no trainer comes), a state the Spaces runtime must not mistake for a failed launch; and its
``/metrics`` needs no token, so on ``app_port`` a public Space would publish it. This launcher
therefore

1. runs ``deltarl rollout`` as a child process (same environment, same stdout/stderr, so its
   logs are the Space's logs) with its endpoints on loopback: ``DELTARL_ROLLOUT_HOST=127.0.0.1``
   and ``DELTARL_ROLLOUT_PORT`` set explicitly (8702 by default), so a taken port stops the
   worker instead of moving it where this launcher would not look;
2. serves on ``0.0.0.0:<port>`` (the Space's ``app_port``):

   * ``GET /`` and ``GET /health``: liveness, 200 while the worker process runs (503 once it
     has exited); the JSON body holds the process state (pid, uptime, exit code) and the
     worker's own ``/health`` answer under ``worker`` (``worker_http_status``: 200, 503, or null
     while its port is not open yet, e.g. during the model load) and ``ready`` (it said 200);
   * ``GET /ready``: the worker's ``/health`` passed through, status code and body (503 with
     the launcher's body while the worker does not answer): readiness for whoever wants it;
   * ``/metrics`` is not forwarded (it stays on the container's loopback);
3. forwards SIGTERM/SIGINT to the child, waits for it, and exits with the child's exit status
   (128 + N when a signal N killed it):
   a worker that stops stops the Space (shown as an error on its page) instead of leaving an
   idle GPU that looks healthy.

Standard library only; no settings class is read here (the child reads ``DELTARL_ROLLOUT_*``;
the worker's port and TLS certificate are read from the same variables).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from typing import Any

logger = logging.getLogger(__name__)

ROLLOUT_COMMAND = (sys.executable, "-m", "deltarl", "rollout")
DEFAULT_WORKER_PORT = 8702  # rollout/settings.py's DEFAULT_PORT (a test checks that they agree)
WORKER_HOST = "127.0.0.1"
HOST_ENV = "DELTARL_ROLLOUT_HOST"
PORT_ENV = "DELTARL_ROLLOUT_PORT"
TLS_CERT_ENV = "DELTARL_ROLLOUT_TLS_CERTFILE"
PROBE_TIMEOUT_S = 2.0
MAX_BODY = 64 * 1024


def worker_port(environ: Mapping[str, str]) -> int:
    """The port the worker's endpoints get: ``DELTARL_ROLLOUT_PORT``, else 8702."""
    value = environ.get(PORT_ENV, "").strip()
    if not value:
        return DEFAULT_WORKER_PORT
    try:
        port = int(value)
    except ValueError:
        raise ValueError(f"{PORT_ENV}={value!r} is not a port number") from None
    if not 0 < port < 65536:
        raise ValueError(
            f"{PORT_ENV}={port}: the launcher needs a fixed port between 1 and 65535 to find the "
            "worker's /health (0, a port picked by the OS, cannot be found)"
        )
    return port


class _State:
    """What the endpoints report (written by the main thread, read by the server)."""

    def __init__(self, worker_url: str) -> None:
        self.started = time.monotonic()
        self.pid: int | None = None
        self.exit_code: int | None = None
        self.worker_url = worker_url
        self._context = ssl.create_default_context()
        self._context.check_hostname = False  # loopback, our own child: only ask if it answers
        self._context.verify_mode = ssl.CERT_NONE

    def probe(self) -> tuple[int | None, Any, str | None]:
        """(status, JSON body, error) of the worker's ``GET /health``; status None: no answer."""
        url = self.worker_url + "/health"
        try:
            with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S, context=self._context) as r:
                status, raw = r.status, r.read(MAX_BODY)
        except urllib.error.HTTPError as exc:  # 503: starting or unhealthy, with a body
            status, raw = exc.code, exc.read(MAX_BODY)
        except Exception as exc:  # not listening yet (model load), or gone
            return None, None, f"{url}: {exc}"
        try:
            return status, json.loads(raw), None
        except ValueError:
            return status, None, f"{url}: HTTP {status}, not JSON"

    def body(self) -> dict[str, Any]:
        state = "starting" if self.pid is None else "running"
        if self.exit_code is not None:
            state = "exited"
        status, worker, error = (None, None, None) if state != "running" else self.probe()
        return {
            "service": "rollout",
            "state": state,
            "pid": self.pid,
            "exit_code": self.exit_code,
            "uptime_s": round(time.monotonic() - self.started, 1),
            "ready": status == 200,
            "worker_http_status": status,
            "worker": worker,
            "worker_error": error,
        }


def _handler(state: _State) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            if path not in ("/", "/health", "/ready"):
                self.send_error(404)
                return
            body = state.body()
            if path == "/ready":  # the worker's own answer, else 503 with ours
                answered = body["worker_http_status"] is not None and body["worker"] is not None
                if answered:
                    self._send(body["worker_http_status"], body["worker"])
                else:
                    self._send(503, body)
            else:
                self._send(503 if body["state"] == "exited" else 200, body)

        def _send(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # the proxy polls: stay quiet
            return

    return Handler


def child_environment(environ: Mapping[str, str], port: int) -> dict[str, str]:
    """The worker's environment: ``environ`` with its endpoints pinned to loopback:``port``."""
    return {**environ, HOST_ENV: WORKER_HOST, PORT_ENV: str(port)}


def run_worker(
    port: int,
    command: Sequence[str] = ROLLOUT_COMMAND,
    host: str = "0.0.0.0",
    environ: Mapping[str, str] | None = None,
) -> int:
    """Serve the endpoints on ``host:port`` while ``command`` runs; its exit status.

    ``environ``: the child's environment before the host and port are pinned (default: this
    process's); the worker's port is its ``DELTARL_ROLLOUT_PORT``, else 8702.
    """
    environ = dict(os.environ if environ is None else environ)
    wport = worker_port(environ)
    if wport == port:
        raise ValueError(
            f"{PORT_ENV}={wport} is the launcher's own port: give the worker another one"
        )
    scheme = "https" if environ.get(TLS_CERT_ENV) else "http"
    state = _State(f"{scheme}://{WORKER_HOST}:{wport}")
    server = ThreadingHTTPServer((host, port), _handler(state))
    thread = threading.Thread(target=server.serve_forever, name="space-health", daemon=True)
    thread.start()
    logger.info(
        "health endpoint on %s:%d (the worker's own: %s/health); starting %s",
        host,
        server.server_port,
        state.worker_url,
        command,
    )
    child = subprocess.Popen(list(command), env=child_environment(environ, wport))
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
