"""A coordinator database written before the workers.weights_digest column existed still opens,
keeps its workers, and gains the column."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from deltarl.services.coordinator.schemas import WorkerHeartbeat
from deltarl.services.coordinator.store.sqlite_store import SQLiteStore


def test_old_database_gains_the_weights_digest_column(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.execute(
        "CREATE TABLE workers (worker_id TEXT PRIMARY KEY, engine TEXT, model TEXT, "
        "capacity INTEGER, registered_at REAL, last_seen REAL, applied_version INTEGER, "
        "in_flight INTEGER, last_error TEXT, rejoins INTEGER, submitted INTEGER)"
    )
    db.execute("INSERT INTO workers VALUES ('w1', 'hf', 'm', 2, 1.0, 1.0, 3, 0, NULL, 0, 5)")
    db.commit()
    db.close()
    store = SQLiteStore(str(path))
    w = store.get_worker("w1")
    assert w is not None and (w.applied_version, w.submitted, w.weights_digest) == (3, 5, None)
    d = "00112233445566778899aabbccddeeff"
    w = store.heartbeat("w1", WorkerHeartbeat(applied_version=3, weights_digest=d), 2.0, 10.0)
    assert w is not None and w.weights_digest == d


def test_old_database_gains_the_proof_columns(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.execute(
        "CREATE TABLE workers (worker_id TEXT PRIMARY KEY, engine TEXT, model TEXT, "
        "capacity INTEGER, registered_at REAL, last_seen REAL, applied_version INTEGER, "
        "in_flight INTEGER, last_error TEXT, rejoins INTEGER, submitted INTEGER, "
        "weights_digest TEXT)"
    )
    db.execute("INSERT INTO workers VALUES ('w1', 'hf', 'm', 2, 1.0, 1.0, 3, 0, NULL, 0, 5, NULL)")
    db.commit()
    db.close()
    store = SQLiteStore(str(path))
    w = store.get_worker("w1")
    assert w is not None and (w.proven_version, w.proof_failures, w.submitted) == (None, 0, 5)
    w = store.record_proof("w1", 3, True, 2.0)
    assert w is not None and (w.proven_version, w.proven_at) == (3, 2.0)
