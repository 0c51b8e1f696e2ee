"""In-memory index of recorded versions, kept in step with the store.

The store is the source of truth for records; this index holds every recorded
:class:`VersionRecord` (a summary, never the manifest: that stays in the bucket) in version
order so that heartbeats, staleness checks, lag and proofs need no store query.
:meth:`VersionIndex.refresh` pulls versions newer than the newest known one (other coordinator
processes may have recorded them); :meth:`VersionIndex.add` inserts one this process recorded.
Both are thread-safe. A reader may therefore see a version recorded by another process up to one
refresh interval late, and a version recorded by this process at once.
"""

from __future__ import annotations

import bisect
import threading

from deltarl.services.coordinator.schemas import (
    ModelLimits,
    VersionManifest,
    VersionRecord,
    manifest_digest,
)
from deltarl.services.coordinator.store import CoordinatorStore


def summarize(
    manifest: VersionManifest,
    previous: VersionRecord | None,
    now: float,
    limits: ModelLimits | None = None,
) -> VersionRecord:
    """The record of a new version, given the version recorded before it (None: first) and the
    model's limits the trainer registered with it."""
    prev_v = None if previous is None else previous.version
    deltas = [o.size for o in manifest.deltas if prev_v is not None and o.base_version == prev_v]
    anchors = [o.size for o in manifest.anchors]
    delta_bytes = min(deltas) if deltas else None
    anchor_bytes = min(anchors) if anchors else None
    if delta_bytes is not None:
        size = delta_bytes
    elif anchor_bytes is not None:
        size = anchor_bytes
    else:
        size = min(o.size for o in manifest.objects)
    if anchors:
        anchor_version: int | None = manifest.version
    else:
        anchor_version = None if previous is None else previous.anchor_version
    return VersionRecord(
        version=manifest.version,
        kind="anchor" if anchors else "delta",
        trainer_step=manifest.step,
        state_digest=manifest.state_digest,
        previous_version=prev_v,
        delta_bytes=delta_bytes,
        anchor_bytes=anchor_bytes,
        bytes=size,
        full_bytes=manifest.full_bytes,
        anchor_version=anchor_version,
        published_at=manifest.created_at.timestamp(),
        recorded_at=now,
        manifest_digest=manifest_digest(manifest),
        limits=limits,
    )


class VersionIndex:
    def __init__(self, store: CoordinatorStore) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._numbers: list[int] = []
        self._records: dict[int, VersionRecord] = {}

    def refresh(self) -> list[VersionRecord]:
        """Load versions recorded since the last refresh; returns them (ascending)."""
        new: list[VersionRecord] = []
        while True:
            with self._lock:
                after = self._numbers[-1] if self._numbers else None
            batch = self._store.list_versions(after, 1000)
            new.extend(r for r in batch if self.add(r))
            if len(batch) < 1000:
                return new

    def add(self, record: VersionRecord) -> bool:
        """Insert a record; False if it was known already."""
        with self._lock:
            if record.version in self._records:
                return False
            bisect.insort(self._numbers, record.version)
            self._records[record.version] = record
            return True

    def latest(self) -> VersionRecord | None:
        with self._lock:
            return self._records[self._numbers[-1]] if self._numbers else None

    def get(self, version: int) -> VersionRecord | None:
        with self._lock:
            return self._records.get(version)

    def after(self, version: int | None, limit: int) -> list[VersionRecord]:
        with self._lock:
            i = 0 if version is None else bisect.bisect_right(self._numbers, version)
            return [self._records[v] for v in self._numbers[i : i + limit]]

    def recent(self, limit: int) -> list[VersionRecord]:
        with self._lock:
            return [self._records[v] for v in self._numbers[-limit:]]

    def first_newer_than(self, version: int) -> VersionRecord | None:
        with self._lock:
            i = bisect.bisect_right(self._numbers, version)
            return self._records[self._numbers[i]] if i < len(self._numbers) else None
