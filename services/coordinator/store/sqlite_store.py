"""SQLite store: the embedded default (one file, WAL, durable across restarts).

Concurrency: one connection guarded by a lock serialises this process's operations; each
operation is one ``BEGIN IMMEDIATE`` transaction, so several processes sharing the file are
serialised by SQLite's own write lock too. ``synchronous=NORMAL`` (default) survives a crash or
kill of the process; ``FULL`` also survives power loss (slower: one fsync per commit).
"""

from __future__ import annotations

import sqlite3
import threading
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from deltarl.services.coordinator.schemas import VersionRecord, WorkerHeartbeat, WorkerRegistration
from deltarl.services.coordinator.store.base import (
    MAX_DEAD_LETTERS,
    MAX_DELIVERIES,
    UNDELIVERED,
    UNDELIVERED_DETAIL,
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
    load_version_record,
    same_version_content,
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS versions (
    version INTEGER PRIMARY KEY, kind TEXT NOT NULL, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS workers (
    worker_id TEXT PRIMARY KEY, engine TEXT, model TEXT, capacity INTEGER,
    registered_at REAL, last_seen REAL, applied_version INTEGER, in_flight INTEGER,
    last_error TEXT, rejoins INTEGER, submitted INTEGER, weights_digest TEXT,
    proven_version INTEGER, proven_at REAL, failed_version INTEGER,
    proof_failures INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS submissions (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, idem_key TEXT NOT NULL UNIQUE, digest TEXT NOT NULL,
    worker_id TEXT, group_id TEXT, version_min INTEGER, version_max INTEGER,
    num_trajectories INTEGER, num_tokens INTEGER, submitted_at REAL,
    state TEXT NOT NULL, batch_id TEXT, payload BLOB,
    deliveries INTEGER NOT NULL DEFAULT 0, dead_at REAL, reason TEXT, detail TEXT);
CREATE INDEX IF NOT EXISTS submissions_state ON submissions(state, seq);
CREATE INDEX IF NOT EXISTS submissions_batch ON submissions(batch_id);
CREATE TABLE IF NOT EXISTS leases (
    batch_id TEXT PRIMARY KEY, expires_at REAL, state TEXT NOT NULL, n INTEGER);
CREATE INDEX IF NOT EXISTS leases_active ON leases(state, expires_at);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS rejections (
    worker_id TEXT PRIMARY KEY, n INTEGER NOT NULL, last_reason TEXT, last_detail TEXT,
    last_at REAL);
CREATE TABLE IF NOT EXISTS rewards (version INTEGER PRIMARY KEY, n INTEGER, total REAL);
CREATE TABLE IF NOT EXISTS staleness (k INTEGER PRIMARY KEY, n INTEGER);
CREATE TABLE IF NOT EXISTS challenge_pool (
    nonce TEXT PRIMARY KEY, version INTEGER NOT NULL, answer TEXT NOT NULL,
    chunk_bytes INTEGER NOT NULL, chunks INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS challenge_pool_version ON challenge_pool(version);
CREATE TABLE IF NOT EXISTS challenges_out (
    worker_id TEXT PRIMARY KEY, nonce TEXT NOT NULL, version INTEGER NOT NULL,
    answer TEXT NOT NULL, chunk_bytes INTEGER NOT NULL, chunks INTEGER NOT NULL,
    expires_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS challenge_versions (version INTEGER PRIMARY KEY);
CREATE TABLE IF NOT EXISTS challenge_attempts (
    version INTEGER NOT NULL, worker_id TEXT NOT NULL, issued INTEGER NOT NULL,
    waiting INTEGER NOT NULL, PRIMARY KEY (version, worker_id));
"""

# columns added to ``workers`` after its first release: (name, type) added by ALTER TABLE to a
# database written before them
_WORKER_MIGRATIONS = (
    ("weights_digest", "TEXT"),
    ("proven_version", "INTEGER"),
    ("proven_at", "REAL"),
    ("failed_version", "INTEGER"),
    ("proof_failures", "INTEGER NOT NULL DEFAULT 0"),
)

# columns added to ``submissions`` after its first release (dead letters)
_SUBMISSION_MIGRATIONS = (
    ("deliveries", "INTEGER NOT NULL DEFAULT 0"),
    ("dead_at", "REAL"),
    ("reason", "TEXT"),
    ("detail", "TEXT"),
)

_DEAD_COLS = (
    "seq, worker_id, group_id, version_min, version_max, submitted_at, dead_at, deliveries, "
    "reason, detail"
)

_META_COLS = (
    "seq, worker_id, group_id, version_min, version_max, submitted_at, num_trajectories, "
    "num_tokens, deliveries"
)


def _meta(row: tuple[Any, ...]) -> QueuedMeta:
    return QueuedMeta(*row[:9])


class SQLiteStore(CoordinatorStore):
    name = "sqlite"
    inline_ok = True

    def __init__(
        self,
        path: str | Path,
        synchronous: str = "NORMAL",
        max_dead_letters: int = MAX_DEAD_LETTERS,
    ) -> None:
        """``max_dead_letters``: dead letters kept (tests lower it)."""
        self.max_dead_letters = max_dead_letters
        if synchronous.upper() not in {"NORMAL", "FULL", "EXTRA"}:
            raise ValueError(f"sqlite synchronous must be NORMAL, FULL or EXTRA, not {synchronous}")
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA synchronous={synchronous.upper()}")
        self._db.execute("PRAGMA busy_timeout=10000")
        with self._lock:
            self._db.executescript(_SCHEMA)
            # pools posted before challenge_versions existed
            self._db.execute(
                "INSERT OR IGNORE INTO challenge_versions SELECT DISTINCT version "
                "FROM challenge_pool"
            )
            cols = {r[1] for r in self._db.execute("PRAGMA table_info(workers)")}
            for col, kind in _WORKER_MIGRATIONS:
                if col not in cols:  # a database written before the column existed
                    self._db.execute(f"ALTER TABLE workers ADD COLUMN {col} {kind}")
            cols = {r[1] for r in self._db.execute("PRAGMA table_info(submissions)")}
            for col, kind in _SUBMISSION_MIGRATIONS:
                if col not in cols:
                    self._db.execute(f"ALTER TABLE submissions ADD COLUMN {col} {kind}")

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction under the process lock (BEGIN IMMEDIATE .. COMMIT/ROLLBACK)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _read(self, sql: str, args: tuple[Any, ...] = ()) -> list[Any]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    @staticmethod
    def _bump(db: sqlite3.Connection, name: str, n: int = 1) -> None:
        db.execute(
            "INSERT INTO counters(name, value) VALUES (?, ?) "
            "ON CONFLICT(name) DO UPDATE SET value = value + excluded.value",
            (name, n),
        )

    # -- versions ---------------------------------------------------------------------------
    def add_version(self, record: VersionRecord) -> tuple[VersionRecord, bool]:
        with self._tx() as db:
            row = db.execute("SELECT body FROM versions WHERE version = ?", (record.version,))
            existing = row.fetchone()
            if existing is not None:
                old = load_version_record(existing[0])
                if same_version_content(old, record):
                    return old, False
                raise VersionConflict(
                    f"version {record.version} is already published with different content"
                )
            latest = db.execute("SELECT MAX(version) FROM versions").fetchone()[0]
            if latest is not None and record.version <= latest:
                raise VersionConflict(
                    f"version {record.version} is out of order: versions must increase and "
                    f"{latest} is already recorded"
                )
            db.execute(
                "INSERT INTO versions(version, kind, body) VALUES (?, ?, ?)",
                (record.version, record.kind, record.model_dump_json()),
            )
            return record, True

    def _versions(self, sql: str, args: tuple[Any, ...] = ()) -> list[VersionRecord]:
        return [load_version_record(r[0]) for r in self._read(sql, args)]

    def get_version(self, version: int) -> VersionRecord | None:
        found = self._versions("SELECT body FROM versions WHERE version = ?", (version,))
        return found[0] if found else None

    def list_versions(self, after: int | None, limit: int) -> list[VersionRecord]:
        return self._versions(
            "SELECT body FROM versions WHERE version > ? ORDER BY version LIMIT ?",
            (-1 if after is None else after, limit),
        )

    def recent_versions(self, limit: int) -> list[VersionRecord]:
        found = self._versions("SELECT body FROM versions ORDER BY version DESC LIMIT ?", (limit,))
        return found[::-1]

    def latest_version(self) -> VersionRecord | None:
        found = self._versions("SELECT body FROM versions ORDER BY version DESC LIMIT 1")
        return found[0] if found else None

    def latest_anchor(self) -> VersionRecord | None:
        found = self._versions(
            "SELECT body FROM versions WHERE kind = 'anchor' ORDER BY version DESC LIMIT 1"
        )
        return found[0] if found else None

    # -- workers ----------------------------------------------------------------------------
    _WORKER_COLS = (
        "worker_id, engine, model, capacity, registered_at, last_seen, applied_version, "
        "in_flight, last_error, rejoins, submitted, weights_digest, proven_version, proven_at, "
        "failed_version, proof_failures"
    )

    def register_worker(self, reg: WorkerRegistration, now: float) -> WorkerRecord:
        with self._tx() as db:
            db.execute(
                f"INSERT INTO workers({self._WORKER_COLS}) "
                "VALUES (?, ?, ?, ?, ?, ?, NULL, 0, NULL, 0, 0, NULL, NULL, NULL, NULL, 0) "
                "ON CONFLICT(worker_id) DO UPDATE SET engine = excluded.engine, "
                "model = excluded.model, capacity = excluded.capacity, last_seen = ?, "
                "applied_version = NULL, in_flight = 0, last_error = NULL, weights_digest = NULL, "
                "proven_version = NULL, proven_at = NULL, failed_version = NULL, "
                "proof_failures = 0, rejoins = rejoins + 1",
                (reg.worker_id, reg.engine, reg.model, reg.capacity, now, now, now),
            )
            db.execute("DELETE FROM challenges_out WHERE worker_id = ?", (reg.worker_id,))
            row = db.execute(
                f"SELECT {self._WORKER_COLS} FROM workers WHERE worker_id = ?", (reg.worker_id,)
            ).fetchone()
        return WorkerRecord(*row)

    def heartbeat(
        self, worker_id: str, hb: WorkerHeartbeat, now: float, lost_after_s: float
    ) -> WorkerRecord | None:
        with self._tx() as db:
            db.execute(
                "UPDATE workers SET rejoins = rejoins + (CASE WHEN ? - last_seen > ? THEN 1 ELSE 0 "
                "END), last_seen = ?, applied_version = ?, in_flight = ?, last_error = ?, "
                "weights_digest = ? WHERE worker_id = ?",
                (
                    now,
                    lost_after_s,
                    now,
                    hb.applied_version,
                    hb.in_flight,
                    hb.last_error,
                    hb.weights_digest,
                    worker_id,
                ),
            )
            row = db.execute(
                f"SELECT {self._WORKER_COLS} FROM workers WHERE worker_id = ?", (worker_id,)
            ).fetchone()
        return None if row is None else WorkerRecord(*row)

    def get_worker(self, worker_id: str) -> WorkerRecord | None:
        rows = self._read(
            f"SELECT {self._WORKER_COLS} FROM workers WHERE worker_id = ?", (worker_id,)
        )
        return WorkerRecord(*rows[0]) if rows else None

    def list_workers(self) -> list[WorkerRecord]:
        rows = self._read(f"SELECT {self._WORKER_COLS} FROM workers ORDER BY worker_id")
        return [WorkerRecord(*r) for r in rows]

    def remove_worker(self, worker_id: str) -> bool:
        with self._tx() as db:
            db.execute("DELETE FROM challenges_out WHERE worker_id = ?", (worker_id,))
            return db.execute("DELETE FROM workers WHERE worker_id = ?", (worker_id,)).rowcount > 0

    # -- weight proofs ----------------------------------------------------------------------
    def add_challenges(
        self,
        version: int,
        chunk_bytes: int,
        chunks: int,
        pairs: list[tuple[str, str]],
        keep_from: int,
    ) -> tuple[int, int]:
        with self._tx() as db:
            for table in ("challenge_pool", "challenge_versions", "challenge_attempts"):
                db.execute(f"DELETE FROM {table} WHERE version < ?", (keep_from,))
            db.execute("INSERT OR IGNORE INTO challenge_versions VALUES (?)", (version,))
            added = 0
            for nonce, answer in pairs:
                cur = db.execute(
                    "INSERT OR IGNORE INTO challenge_pool VALUES (?, ?, ?, ?, ?)",
                    (nonce, version, answer, chunk_bytes, chunks),
                )
                added += cur.rowcount
            size = db.execute(
                "SELECT COUNT(*) FROM challenge_pool WHERE version = ?", (version,)
            ).fetchone()[0]
        return added, size

    @staticmethod
    def _unchallenged(db: sqlite3.Connection, version: int, active_after: float) -> int:
        """Active workers that may still serve ``version`` and were never issued a challenge
        at it."""
        return int(
            db.execute(
                "SELECT COUNT(*) FROM workers w WHERE w.last_seen > ? AND (w.applied_version IS "
                "NULL OR w.applied_version <= ?) AND NOT EXISTS (SELECT 1 FROM challenge_attempts "
                "a WHERE a.version = ? AND a.worker_id = w.worker_id AND a.issued > 0)",
                (active_after, version, version),
            ).fetchone()[0]
        )

    def issue_challenge(
        self,
        worker_id: str,
        version: int,
        now: float,
        expires_at: float,
        max_attempts: int,
        active_after: float,
    ) -> IssuedChallenge | None:
        with self._tx() as db:
            row = db.execute(
                "SELECT nonce, version, chunk_bytes, chunks, expires_at FROM challenges_out "
                "WHERE worker_id = ?",
                (worker_id,),
            ).fetchone()
            if row is not None and row[1] == version and row[4] > now:
                return IssuedChallenge(version, row[0], row[2], row[3], row[4])
            if (
                db.execute(
                    "SELECT 1 FROM challenge_versions WHERE version = ?", (version,)
                ).fetchone()
                is None
            ):
                return None  # no pool posted for this version
            got = db.execute(
                "SELECT issued FROM challenge_attempts WHERE version = ? AND worker_id = ?",
                (version, worker_id),
            ).fetchone()
            issued = 0 if got is None else int(got[0])
            if issued >= max_attempts:
                return None
            row = db.execute(
                "SELECT nonce, answer, chunk_bytes, chunks FROM challenge_pool WHERE version = ? "
                "ORDER BY rowid LIMIT 1",
                (version,),
            ).fetchone()
            if row is not None and issued > 0:  # a retry: only from the pool's surplus
                left = db.execute(
                    "SELECT COUNT(*) FROM challenge_pool WHERE version = ?", (version,)
                ).fetchone()[0]
                if left <= self._unchallenged(db, version, active_after):
                    row = None
            if row is None:
                db.execute(
                    "INSERT INTO challenge_attempts VALUES (?, ?, 0, 1) "
                    "ON CONFLICT(version, worker_id) DO UPDATE SET waiting = 1",
                    (version, worker_id),
                )
                return None
            db.execute("DELETE FROM challenge_pool WHERE nonce = ?", (row[0],))
            db.execute(
                "INSERT OR REPLACE INTO challenges_out VALUES (?, ?, ?, ?, ?, ?, ?)",
                (worker_id, row[0], version, row[1], row[2], row[3], expires_at),
            )
            db.execute(
                "INSERT INTO challenge_attempts VALUES (?, ?, 1, 0) ON CONFLICT(version, "
                "worker_id) DO UPDATE SET issued = issued + 1, waiting = 0",
                (version, worker_id),
            )
        return IssuedChallenge(version, row[0], row[2], row[3], expires_at)

    def challenge_stats(self, version: int, active_after: float) -> ChallengeStats:
        with self._lock:
            db = self._db
            posted = (
                db.execute(
                    "SELECT 1 FROM challenge_versions WHERE version = ?", (version,)
                ).fetchone()
                is not None
            )
            left = db.execute(
                "SELECT COUNT(*) FROM challenge_pool WHERE version = ?", (version,)
            ).fetchone()[0]
            challenged = db.execute(
                "SELECT COUNT(*) FROM challenge_attempts WHERE version = ? AND issued > 0",
                (version,),
            ).fetchone()[0]
            active = db.execute(
                "SELECT COUNT(*) FROM workers WHERE last_seen > ? AND (applied_version IS NULL "
                "OR applied_version <= ?)",
                (active_after, version),
            ).fetchone()[0]
            unchallenged = self._unchallenged(db, version, active_after)
            waiting_sql = (
                "SELECT COUNT(*) FROM challenge_attempts a JOIN workers w ON w.worker_id = "
                "a.worker_id WHERE a.waiting = 1 AND a.version = w.applied_version AND "
                "w.last_seen > ? AND (w.proven_version IS NULL OR w.proven_version != "
                "w.applied_version)"
            )
            waiting = db.execute(waiting_sql + " AND a.version = ?", (active_after, version))
            waiting_n = waiting.fetchone()[0]
            waiting_total = db.execute(waiting_sql, (active_after,)).fetchone()[0]
        return ChallengeStats(
            version=version,
            posted=posted,
            pool_size=int(left),
            challenged=int(challenged),
            active=int(active),
            unchallenged=unchallenged,
            waiting=int(waiting_n),
            waiting_total=int(waiting_total),
        )

    def take_challenge(self, worker_id: str, nonce: str) -> TakenChallenge | None:
        with self._tx() as db:
            row = db.execute(
                "SELECT version, answer, expires_at FROM challenges_out "
                "WHERE worker_id = ? AND nonce = ?",
                (worker_id, nonce),
            ).fetchone()
            if row is None:
                return None
            db.execute("DELETE FROM challenges_out WHERE worker_id = ?", (worker_id,))
        return TakenChallenge(row[0], row[1], row[2])

    def record_proof(
        self, worker_id: str, version: int, ok: bool, now: float
    ) -> WorkerRecord | None:
        with self._tx() as db:
            if ok:
                db.execute(
                    "UPDATE workers SET proven_version = ?, proven_at = ? WHERE worker_id = ?",
                    (version, now, worker_id),
                )
            else:
                db.execute(
                    "UPDATE workers SET failed_version = ?, proof_failures = proof_failures + 1 "
                    "WHERE worker_id = ?",
                    (version, worker_id),
                )
            row = db.execute(
                f"SELECT {self._WORKER_COLS} FROM workers WHERE worker_id = ?", (worker_id,)
            ).fetchone()
        return None if row is None else WorkerRecord(*row)

    # -- queue ------------------------------------------------------------------------------
    def submit(
        self, sub: NewSubmission, now: float, min_version: int | None, staleness: int
    ) -> SubmitOutcome:
        with self._tx() as db:
            row = db.execute(
                "SELECT seq, digest FROM submissions WHERE idem_key = ?", (sub.idempotency_key,)
            ).fetchone()
            if row is not None:
                if row[1] != sub.payload_digest:
                    raise IdempotencyConflict(
                        f"idempotency key {sub.idempotency_key!r} was already used for a "
                        "different payload; use a new key for new data"
                    )
                self._bump(db, "duplicates_total")
                return SubmitOutcome("duplicate", row[0], self._depth(db))
            if min_version is not None and sub.version_min < min_version:
                self._bump(db, "drop:stale_at_submit")
                return SubmitOutcome("stale", None, self._depth(db))
            cur = db.execute(
                "INSERT INTO submissions(idem_key, digest, worker_id, group_id, version_min, "
                "version_max, num_trajectories, num_tokens, submitted_at, state, payload) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 'queued', ?)",
                (
                    sub.idempotency_key,
                    sub.payload_digest,
                    sub.worker_id,
                    sub.group_id,
                    sub.version_min,
                    sub.version_max,
                    sub.num_trajectories,
                    sub.num_tokens,
                    now,
                    sub.payload,
                ),
            )
            self._bump(db, "submitted_total")
            db.execute(
                "INSERT INTO rewards VALUES (?, 1, ?) ON CONFLICT(version) DO UPDATE SET "
                "n = n + 1, total = total + excluded.total",
                (sub.version_max, sub.mean_reward),
            )
            db.execute(
                "INSERT INTO staleness VALUES (?, 1) ON CONFLICT(k) DO UPDATE SET n = n + 1",
                (staleness,),
            )
            db.execute(
                "UPDATE workers SET submitted = submitted + 1 WHERE worker_id = ?",
                (sub.worker_id,),
            )
            seq = cur.lastrowid
            assert seq is not None
            return SubmitOutcome("accepted", seq, self._depth(db))

    @staticmethod
    def _depth(db: sqlite3.Connection) -> int:
        return int(
            db.execute("SELECT COUNT(*) FROM submissions WHERE state = 'queued'").fetchone()[0]
        )

    @staticmethod
    def _reclaim(db: sqlite3.Connection, now: float) -> int:
        expired = [
            r[0]
            for r in db.execute(
                "SELECT batch_id FROM leases WHERE state = 'active' AND expires_at <= ?", (now,)
            )
        ]
        n = 0
        for batch_id in expired:
            n += db.execute(
                "UPDATE submissions SET state = 'queued', batch_id = NULL "
                "WHERE batch_id = ? AND state = 'leased'",
                (batch_id,),
            ).rowcount
            db.execute("UPDATE leases SET state = 'expired' WHERE batch_id = ?", (batch_id,))
        return n

    def lease(
        self,
        max_groups: int,
        lease_s: float,
        now: float,
        min_version: int | None,
        max_bytes: int | None = None,
    ) -> LeaseOutcome:
        expires = now + lease_s
        with self._tx() as db:
            self._reclaim(db, now)
            dropped = 0
            if min_version is not None:
                dropped = db.execute(
                    "UPDATE submissions SET state = 'dropped', payload = NULL "
                    "WHERE state = 'queued' AND version_min < ?",
                    (min_version,),
                ).rowcount
                if dropped:
                    self._bump(db, "drop:stale_at_pull", dropped)
            undelivered = db.execute(
                "UPDATE submissions SET state = 'dead', batch_id = NULL, dead_at = ?, "
                "reason = ?, detail = ? WHERE state = 'queued' AND deliveries >= ?",
                (now, UNDELIVERED, UNDELIVERED_DETAIL, MAX_DELIVERIES),
            ).rowcount
            if undelivered:
                self._bump(db, f"drop:{UNDELIVERED}", undelivered)
                self._evict_dead(db)
            sizes = db.execute(
                "SELECT seq, length(payload), deliveries FROM submissions WHERE state = 'queued' "
                "ORDER BY seq LIMIT ?",
                (max_groups,),
            ).fetchall()
            taken: list[int] = []
            total = 0
            for seq, size, delivered in sizes:
                total += size
                if taken and (delivered or (max_bytes is not None and total > max_bytes)):
                    break
                taken.append(seq)
                if delivered:  # back after an expiry: alone
                    break
            rows = [
                db.execute(
                    f"SELECT {_META_COLS}, payload FROM submissions WHERE seq = ?", (seq,)
                ).fetchone()
                for seq in taken
            ]
            batch_id = ""
            if rows:
                batch_id = uuid.uuid4().hex
                db.execute(
                    "INSERT INTO leases VALUES (?, ?, 'active', ?)", (batch_id, expires, len(rows))
                )
                db.executemany(
                    "UPDATE submissions SET state = 'leased', batch_id = ?, "
                    "deliveries = deliveries + 1 WHERE seq = ?",
                    [(batch_id, r[0]) for r in rows],
                )
            items = [(_meta((*r[:8], r[8] + 1)), bytes(r[9])) for r in rows]
            return LeaseOutcome(batch_id, expires, items, dropped, self._depth(db))

    def _evict_dead(self, db: sqlite3.Connection) -> None:
        """Keep at most ``max_dead_letters`` dead letters: the oldest are dropped (their rows stay,
        without payload, so a retry of their idempotency key is still a duplicate)."""
        count = db.execute("SELECT COUNT(*) FROM submissions WHERE state = 'dead'").fetchone()[0]
        if count > self.max_dead_letters:
            n = db.execute(
                "UPDATE submissions SET state = 'dropped', payload = NULL WHERE seq IN ("
                "SELECT seq FROM submissions WHERE state = 'dead' "
                "ORDER BY dead_at, seq LIMIT ?)",
                (count - self.max_dead_letters,),
            ).rowcount
            self._bump(db, "drop:dead_letter_evicted", n)

    def _lease_state(self, db: sqlite3.Connection, batch_id: str) -> tuple[str, float, int]:
        row = db.execute(
            "SELECT state, expires_at, n FROM leases WHERE batch_id = ?", (batch_id,)
        ).fetchone()
        if row is None:
            raise UnknownLease(f"unknown batch id {batch_id!r}")
        return row[0], row[1], row[2]

    def ack(self, batch_id: str, now: float, rejected: Sequence[Rejection] = ()) -> int:
        with self._tx() as db:
            state, expires_at, n = self._lease_state(db, batch_id)
            if state == "active" and expires_at <= now:
                self._reclaim(db, now)  # committed: the groups are back in the queue
                state = "expired"
            if state == "active" and rejected:
                self._reject(db, batch_id, rejected, now)
            if state == "active":
                n = db.execute(
                    "UPDATE submissions SET state = 'acked', payload = NULL WHERE batch_id = ? "
                    "AND state = 'leased'",
                    (batch_id,),
                ).rowcount
                n += len(rejected)
                db.execute(
                    "UPDATE leases SET state = 'acked', n = ? WHERE batch_id = ?", (n, batch_id)
                )
                self._bump(db, "acked_total", n)
                state = "acked"
        if state != "acked":
            raise LeaseExpired(
                f"batch {batch_id} is {state}: its groups went back to the queue; lease "
                "again (and use a longer lease_s if training takes longer)"
            )
        return n

    def _reject(
        self, db: sqlite3.Connection, batch_id: str, rejected: Sequence[Rejection], now: float
    ) -> None:
        """Make the batch's ``rejected`` groups dead letters and count them per worker (inside
        the ack's transaction: a refusal rolls everything back)."""
        owners = dict(
            db.execute(
                "SELECT seq, worker_id FROM submissions WHERE batch_id = ? AND state = 'leased'",
                (batch_id,),
            ).fetchall()
        )
        seen = set()
        for r in rejected:
            if r.submission_id not in owners or r.submission_id in seen:
                raise StoreError(
                    f"submission {r.submission_id} is not a group of batch {batch_id} (or is "
                    "named twice): only the batch's own groups can be rejected with its ack"
                )
            seen.add(r.submission_id)
        for r in rejected:
            db.execute(
                "UPDATE submissions SET state = 'dead', batch_id = NULL, dead_at = ?, "
                "reason = ?, detail = ? WHERE seq = ?",
                (now, r.reason, r.detail, r.submission_id),
            )
            db.execute(
                "INSERT INTO rejections VALUES (?, 1, ?, ?, ?) ON CONFLICT(worker_id) DO UPDATE "
                "SET n = n + 1, last_reason = excluded.last_reason, "
                "last_detail = excluded.last_detail, last_at = excluded.last_at",
                (owners[r.submission_id], r.reason, r.detail, now),
            )
            self._bump(db, f"reject:{r.reason}")
        self._evict_dead(db)

    def nack(self, batch_id: str, now: float) -> int:
        with self._tx() as db:
            state, _, _ = self._lease_state(db, batch_id)
            if state != "active":
                raise LeaseExpired(f"batch {batch_id} is {state}, not leased")
            n = db.execute(
                "UPDATE submissions SET state = 'queued', batch_id = NULL, "
                "deliveries = MAX(deliveries - 1, 0) WHERE batch_id = ? AND state = 'leased'",
                (batch_id,),
            ).rowcount
            db.execute("UPDATE leases SET state = 'nacked' WHERE batch_id = ?", (batch_id,))
            return n

    def extend(self, batch_id: str, lease_s: float, now: float) -> float:
        with self._tx() as db:
            state, expires_at, _ = self._lease_state(db, batch_id)
            if state == "active" and expires_at <= now:
                self._reclaim(db, now)  # committed: the groups are back in the queue
                state = "expired"
            if state == "active":
                expires_at = now + lease_s
                db.execute(
                    "UPDATE leases SET expires_at = ? WHERE batch_id = ?", (expires_at, batch_id)
                )
        if state != "active":
            raise LeaseExpired(f"batch {batch_id} is {state}: its lease cannot be extended")
        return expires_at

    def reclaim_expired(self, now: float) -> int:
        with self._tx() as db:
            return self._reclaim(db, now)

    def dead_letters(self, limit: int) -> tuple[int, list[DeadLetter]]:
        with self._lock:
            count = self._db.execute(
                "SELECT COUNT(*) FROM submissions WHERE state = 'dead'"
            ).fetchone()[0]
            rows = self._db.execute(
                f"SELECT {_DEAD_COLS} FROM submissions WHERE state = 'dead' "
                "ORDER BY dead_at DESC, seq DESC LIMIT ?",
                (limit,),
            ).fetchall()
        return int(count), [DeadLetter(*r) for r in rows]

    def requeue_dead_letter(self, submission_id: int) -> bool:
        with self._tx() as db:
            return (
                db.execute(
                    "UPDATE submissions SET state = 'queued', deliveries = 0, dead_at = NULL, "
                    "reason = NULL, detail = NULL WHERE seq = ? AND state = 'dead'",
                    (submission_id,),
                ).rowcount
                == 1
            )

    def worker_rejections(self) -> dict[str, WorkerRejections]:
        rows = self._read("SELECT worker_id, n, last_reason, last_detail, last_at FROM rejections")
        return {r[0]: WorkerRejections(*r) for r in rows}

    def clear_rejections(self, worker_id: str) -> bool:
        with self._tx() as db:
            return (
                db.execute("DELETE FROM rejections WHERE worker_id = ?", (worker_id,)).rowcount == 1
            )

    def count_drop(self, reason: str, n: int = 1) -> None:
        with self._tx() as db:
            self._bump(db, f"drop:{reason}", n)

    def counters(self) -> StoreCounters:
        with self._lock:
            db = self._db
            values = dict(db.execute("SELECT name, value FROM counters").fetchall())
            states = dict(
                db.execute(
                    "SELECT state, COUNT(*) FROM submissions "
                    "WHERE state IN ('queued', 'leased', 'dead') GROUP BY state"
                ).fetchall()
            )
            oldest = db.execute(
                "SELECT submitted_at FROM submissions WHERE state = 'queued' ORDER BY seq LIMIT 1"
            ).fetchone()
        return StoreCounters(
            depth=int(states.get("queued", 0)),
            leased=int(states.get("leased", 0)),
            submitted_total=int(values.get("submitted_total", 0)),
            acked_total=int(values.get("acked_total", 0)),
            duplicates_total=int(values.get("duplicates_total", 0)),
            dropped={k[5:]: int(v) for k, v in values.items() if k.startswith("drop:")},
            oldest_submitted_at=None if oldest is None else float(oldest[0]),
            dead_letters=int(states.get("dead", 0)),
            rejected={k[7:]: int(v) for k, v in values.items() if k.startswith("reject:")},
        )

    def reward_curve(self, limit: int) -> list[tuple[int, int, float]]:
        rows = self._read(
            "SELECT version, n, total FROM rewards ORDER BY version DESC LIMIT ?", (limit,)
        )
        return [(int(v), int(n), float(t)) for v, n, t in reversed(rows)]

    def staleness_hist(self) -> dict[int, int]:
        return {int(k): int(n) for k, n in self._read("SELECT k, n FROM staleness ORDER BY k")}

    def ping(self) -> None:
        self._read("SELECT 1")

    def close(self) -> None:
        with self._lock:
            self._db.close()
