"""Coordinator stores: :class:`CoordinatorStore` (the interface), SQLite and Redis backends.

:func:`open_store` picks one from the settings (``DELTARL_COORDINATOR_STORE=sqlite|redis``).
The backends' modules are imported lazily so that SQLite users need no ``redis`` package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deltarl.services.coordinator.store.base import (
    MAX_DEAD_LETTERS,
    MAX_DELIVERIES,
    UNDELIVERED,
    ChallengeStats,
    CoordinatorStore,
    DeadLetter,
    IdempotencyConflict,
    IssuedChallenge,
    LeaseExpired,
    LeaseOutcome,
    NewSubmission,
    QueuedMeta,
    Rejection,
    StoreCounters,
    StoreError,
    SubmitOutcome,
    TakenChallenge,
    UnknownLease,
    VersionConflict,
    WorkerRecord,
    WorkerRejections,
)

if TYPE_CHECKING:
    from deltarl.services.coordinator.settings import CoordinatorSettings

__all__ = [
    "MAX_DEAD_LETTERS",
    "MAX_DELIVERIES",
    "UNDELIVERED",
    "ChallengeStats",
    "CoordinatorStore",
    "DeadLetter",
    "IdempotencyConflict",
    "IssuedChallenge",
    "LeaseExpired",
    "LeaseOutcome",
    "NewSubmission",
    "QueuedMeta",
    "Rejection",
    "StoreCounters",
    "StoreError",
    "SubmitOutcome",
    "TakenChallenge",
    "UnknownLease",
    "VersionConflict",
    "WorkerRecord",
    "WorkerRejections",
    "open_store",
]


def open_store(settings: CoordinatorSettings) -> CoordinatorStore:
    """The store named by ``settings.store``."""
    if settings.store == "sqlite":
        from deltarl.services.coordinator.store.sqlite_store import SQLiteStore

        return SQLiteStore(settings.sqlite_path, synchronous=settings.sqlite_synchronous)
    if settings.store == "redis":
        from deltarl.services.coordinator.store.redis_store import RedisStore

        return RedisStore(settings.redis_url, prefix=settings.redis_prefix)
    raise ValueError(f"unknown store {settings.store!r}: use 'sqlite' or 'redis'")
