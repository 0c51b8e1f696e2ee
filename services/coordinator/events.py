"""Fan-out of new versions to server-sent-event subscribers.

Order of calls: the app creates one :class:`VersionEvents` bound to its event loop at startup.
:meth:`VersionEvents.publish` may be called from any thread (routes run in worker threads); it
hands the record to every subscriber's queue on the loop. A subscriber (:meth:`subscribe`) first
receives the versions after the one it last saw (``Last-Event-ID``) from the index (or, when it
saw none, just the latest version), then live ones, without gaps or duplicates: it registers its queue *before* reading the backlog and skips
anything not newer than what it already sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from deltarl.services.coordinator.schemas import VersionRecord
from deltarl.services.coordinator.versions import VersionIndex

_QUEUE_MAX = 1024


class VersionEvents:
    def __init__(self, loop: asyncio.AbstractEventLoop, index: VersionIndex) -> None:
        self._loop = loop
        self._index = index
        self._queues: set[asyncio.Queue[VersionRecord | None]] = set()

    @property
    def subscribers(self) -> int:
        return len(self._queues)

    def publish(self, record: VersionRecord) -> None:
        """Thread-safe: deliver ``record`` to every subscriber."""
        self._loop.call_soon_threadsafe(self._deliver, record)

    def _deliver(self, record: VersionRecord | None) -> None:
        for q in list(self._queues):
            if q.full():  # a subscriber that does not read: cut it off, it will reconnect
                self._queues.discard(q)
                q.get_nowait()
                q.put_nowait(None)
            else:
                q.put_nowait(record)

    def close(self) -> None:
        """End every stream (shutdown)."""
        self._loop.call_soon_threadsafe(self._deliver, None)

    async def subscribe(self, after: int | None) -> AsyncIterator[VersionRecord]:
        q: asyncio.Queue[VersionRecord | None] = asyncio.Queue(_QUEUE_MAX)
        self._queues.add(q)
        try:
            last = after
            if after is not None:
                backlog = self._index.after(after, 1_000_000)
            else:
                latest = self._index.latest()
                backlog = [latest] if latest is not None else []
            for old in backlog:
                last = old.version
                yield old
            while True:
                new = await q.get()
                if new is None:
                    return
                if last is None or new.version > last:
                    last = new.version
                    yield new
        finally:
            self._queues.discard(q)
