"""Keeping the trainer's leases alive while it works on their groups.

A lease expires ``lease_s`` after it was taken (or last extended); an expired lease's groups go
back to the head of the coordinator's queue and its ack is refused. A training step on CPU, a
long wait for the rest of a step's groups, or a slow publication can outlast the lease, so
:class:`LeaseKeeper` extends every held lease from a background thread (``POST
/v1/batches/{id}/extend``, :meth:`CoordinatorClient.extend
<deltarl.services.coordinator.client.CoordinatorClient.extend>`) every ``lease_s / 3`` seconds,
from the moment :func:`~.loop.pull_groups` takes it until the loop acks or nacks it.

Order of calls (the loop's)::

    keeper = LeaseKeeper(source, lease_s)      # starts the thread
    keeper.hold(batch_id)                      # right after each lease
    ...                                        # wait for more groups, train, publish
    keeper.release(batch_id); source.ack(id)   # release first: no extension races the ack
    keeper.close()                             # at the end (also in a ``finally``)

Guarantee: as long as the trainer process runs and the coordinator answers at least once per
``2 * lease_s / 3``, a held lease never expires, so its groups are never re-queued (and trained
on by nobody else) while the trainer still works on them. A trainer that dies stops extending,
and its groups return to the queue at most ``lease_s`` later, as before. A failed extension is
logged and retried at the next tick; one refused because the lease is gone (409) drops the
lease from the keeper (its ack will then fail and be counted in ``batch/ack_failures``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["LeaseKeeper"]


class LeaseKeeper:
    """Extends the leases it holds every ``lease_s / 3`` seconds (see the module docstring).

    ``source``: anything with ``extend(batch_id, lease_s)`` (``CoordinatorClient``); a source
    without it is tolerated (a warning says that leases then last ``lease_s`` at most).
    ``every_s`` overrides the renewal period (tests).
    """

    def __init__(self, source: Any, lease_s: float, *, every_s: float | None = None) -> None:
        self.lease_s = lease_s
        self.every_s = every_s if every_s is not None else lease_s / 3
        self._extend = getattr(source, "extend", None)
        self._held: dict[str, float] = {}  # batch id -> monotonic time of the last renewal
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.extensions = 0  # successful extensions since the start
        self.failures = 0  # failed extension requests since the start
        self._thread: threading.Thread | None = None
        if self._extend is None:
            logger.warning(
                "%s cannot extend leases: a step that takes longer than batch.lease_s=%.0f s "
                "loses its groups to the queue",
                type(source).__name__,
                lease_s,
            )
            return
        self._thread = threading.Thread(target=self._run, name="deltarl-leases", daemon=True)
        self._thread.start()

    def hold(self, batch_id: str) -> None:
        """Start extending ``batch_id`` (a lease just taken)."""
        if batch_id:
            with self._lock:
                self._held[batch_id] = time.monotonic()

    def release(self, batch_id: str) -> None:
        """Stop extending ``batch_id`` (call before acking or nacking it)."""
        with self._lock:
            self._held.pop(batch_id, None)

    @property
    def held(self) -> list[str]:
        with self._lock:
            return list(self._held)

    def close(self) -> None:
        """Stop the thread (held leases are left to expire, or to the caller's ack/nack)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def __enter__(self) -> LeaseKeeper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        tick = min(self.every_s, 1.0) / 2
        while not self._stop.wait(tick):
            now = time.monotonic()
            with self._lock:
                due = [b for b, t in self._held.items() if now - t >= self.every_s]
            for batch_id in due:
                self._renew(batch_id)

    def _renew(self, batch_id: str) -> None:
        assert self._extend is not None
        try:
            self._extend(batch_id, self.lease_s)
        except Exception as err:
            with self._lock:
                if batch_id not in self._held:
                    return  # acked or nacked meanwhile: the refusal is expected
                gone = getattr(err, "status_code", None) in (404, 409)
                if gone:
                    self._held.pop(batch_id)
            self.failures += 1
            logger.warning(
                "extending the lease of batch %s failed%s: %s",
                batch_id,
                " (it is gone: its groups went back to the queue)" if gone else "; retrying",
                err,
            )
            return
        with self._lock:
            if batch_id in self._held:
                self._held[batch_id] = time.monotonic()
                self.extensions += 1
