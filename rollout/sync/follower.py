"""Follow the coordinator's weight versions: a thread on the SSE stream, coalesced syncs.

:class:`VersionFollower` learns of new versions and drives a
:class:`~deltarl.rollout.sync.weights.WeightSync` towards the newest one.

Order of calls::

    follow(v)            (the version thread, heartbeat answers, admission control)
      -> wanted = max(wanted, v) -> kick()
    kick()               (also every heartbeat, to retry a failed sync after its backoff)
      -> unless a sync runs, backs off, or the weights are healthy at >= wanted:
         WeightSync.sync_in_background(wanted); when it ends, kick() again
    version thread       (start() .. stop(); its own event loop, so stop() cancels the stream)
      -> AsyncCoordinatorClient.iter_version_events(after=applied) -> follow(record.version)
      -> the stream is refused or breaks: latest_version() -> follow(), wait poll_s, reopen

Guarantees: one sync at a time; versions published while a sync runs are coalesced into the
next one (only the newest target matters, the planner picks the cheapest path to it); a failed
sync is retried with exponential backoff (0.5 s doubling to 30 s), from nothing when it left
the weights unhealthy (``WeightSync`` plans from an anchor then). An older ``latest.json`` put
back in the bucket (``RollbackError``: older than one the reader accepted) fails a sync like
any other failure: the engine keeps the newest version it holds, ``on_error`` reports it (the
worker's heartbeat carries it as ``last_error``), and the retry succeeds once the trainer's next
publication has replaced the pointer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict
from pathlib import Path

import httpx

from deltarl.rollout.sync.records import SyncReport
from deltarl.rollout.sync.weights import WeightSync
from deltarl.services.coordinator.client import AsyncCoordinatorClient, CoordinatorError

logger = logging.getLogger(__name__)

__all__ = ["VersionFollower"]


class VersionFollower:
    """Keeps ``sync`` moving to the newest version the coordinator announces.

    ``coordinator_url``/``token``/``verify``: how the version thread reaches the coordinator
    (worker-role token; ``verify`` as httpx takes it). ``poll_s``: poll period while the event
    stream is down. ``on_error``: called with a message for every failed sync or stream
    (default: log it as a warning).
    """

    def __init__(
        self,
        sync: WeightSync,
        coordinator_url: str,
        token: str | None,
        *,
        verify: ssl.SSLContext | bool = True,
        poll_s: float = 5.0,
        on_error: Callable[[str], None] | None = None,
        sync_log: Path | None = None,
    ) -> None:
        self.sync = sync
        self.sync_log = sync_log
        self.coordinator_url = coordinator_url
        self.token = token
        self.verify = verify
        self.poll_s = poll_s
        self.on_error = on_error or (lambda message: logger.warning("%s", message))
        self.syncs = 0  # background syncs that reached their target
        self.failures = 0  # background syncs that failed
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wanted: int | None = None
        self._future: Future[SyncReport] | None = None
        self._retry_at = 0.0  # no background sync before this (after a failure)
        self._failed_in_a_row = 0

    @property
    def wanted(self) -> int | None:
        """The newest version heard of (the sync target)."""
        return self._wanted

    def follow(self, version: int | None, *, start: bool = True) -> None:
        """Make ``version`` the target if it is newer; ``start``: sync towards it now."""
        if version is None:
            return
        with self._lock:
            if self._wanted is None or version > self._wanted:
                self._wanted = version
        if start:
            self.kick()

    def kick(self) -> None:
        """Start a background sync to the target unless one runs, backs off or is not needed."""
        with self._lock:
            if self._future is not None or self._stop.is_set() or self._wanted is None:
                return
            if time.monotonic() < self._retry_at:
                return
            current = self.sync.version if self.sync.healthy else None
            if current is not None and self._wanted <= current:
                return
            target = self._wanted
            future = self.sync.sync_in_background(target)
            self._future = future
        logger.debug("syncing to v%d in the background", target)
        future.add_done_callback(self._done)

    def _done(self, future: Future[SyncReport]) -> None:
        with self._lock:
            self._future = None
        try:
            report = future.result()
        except Exception as exc:  # bucket, network, failed objects: retried after a backoff
            self.failures += 1
            self._failed_in_a_row += 1
            backoff = min(0.5 * 2 ** (self._failed_in_a_row - 1), 30.0)
            self._retry_at = time.monotonic() + backoff
            self.on_error(f"sync failed (retry in {backoff:.1f} s): {exc}")
            return
        self._failed_in_a_row = 0
        self.syncs += 1
        if self.sync_log is not None and report.steps:
            lines = "".join(json.dumps(asdict(s)) + "\n" for s in report.steps)
            with self.sync_log.open("a") as f:
                f.write(lines)
        if report.failures:  # reached, but around damaged or missing objects: say which
            self.on_error(
                f"v{report.version} reached around {len(report.failures)} failed object(s): "
                + "; ".join(report.failures)
            )
        logger.info(
            "weights at v%s (%s)",
            report.version,
            ", ".join(f"{s.kind} {s.pause_s * 1e3:.1f} ms paused" for s in report.steps) or "-",
        )
        self.kick()

    # ------------------------------------------------------------------ the version thread

    def start(self) -> None:
        """Start the version thread (a daemon)."""
        if self._thread is not None:
            raise RuntimeError("the version thread is already started")
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._run()), name="rollout-versions", daemon=True
        )
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the version thread and wait (up to ``timeout`` s) for a running sync."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        with self._lock:
            future = self._future
        if future is not None:
            with contextlib.suppress(Exception):
                future.result(timeout=timeout)

    async def _run(self) -> None:
        task = asyncio.create_task(self._follow())
        await asyncio.to_thread(self._stop.wait)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _follow(self) -> None:
        """Versions from the SSE stream; poll ``latest_version`` while it is down."""
        async with AsyncCoordinatorClient(
            self.coordinator_url, self.token, verify=self.verify
        ) as client:
            while True:
                try:
                    async for record in client.iter_version_events(after=self.sync.version):
                        self.follow(record.version)
                except (httpx.HTTPError, CoordinatorError, ValueError) as exc:
                    self.on_error(
                        f"version event stream failed ({exc}); polling every {self.poll_s} s"
                    )
                try:
                    latest = await client.latest_version()
                    self.follow(None if latest is None else latest.version)
                except (httpx.TransportError, CoordinatorError) as exc:
                    logger.warning("polling the latest version failed: %s", exc)
                await asyncio.sleep(self.poll_s)
