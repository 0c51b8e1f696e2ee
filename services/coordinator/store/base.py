"""The coordinator's store: one abstract interface, two backends (SQLite, Redis).

Every method is one atomic operation on durable state: when it returns, its effect survives a
restart of the coordinator process (SQLite: a committed WAL transaction; Redis: a Lua script or
command, as durable as the server's persistence — run it with AOF). Methods are synchronous and
thread-safe; the HTTP layer calls them from worker threads. Several coordinator processes may
share one store: every read-modify-write that matters (version order, idempotent submit, lease,
ack) happens inside the store atomically, never as a read in Python followed by a write.

Queue life cycle of a group: ``submit`` (queued) -> ``lease`` (leased by one batch) -> ``ack``
(gone) or ``nack``/lease expiry (queued again at the head, original order); ``extend`` keeps a
lease alive while its holder still works on it. ``lease`` first
reclaims expired leases, then drops queued groups whose ``version_min`` is below ``min_version``
(counted as ``stale_at_pull``), then takes the oldest remaining groups.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Literal

from deltarl.services.coordinator.schemas import VersionRecord, WorkerHeartbeat, WorkerRegistration


class StoreError(ValueError):
    """Base of the store's refusals (bad input given the current state; never a bug)."""


class VersionConflict(StoreError):
    """The version is out of order, or already published with different content."""


class UnknownLease(StoreError):
    """No such batch id (never issued, or already acknowledged long ago)."""


class LeaseExpired(StoreError):
    """The lease expired (or was nacked) before the ack: its groups went back to the queue."""


class IdempotencyConflict(StoreError):
    """An idempotency key was reused for a different payload."""


@dataclass(slots=True)
class WorkerRecord:
    """A worker's durable state (the service derives state and lag from it)."""

    worker_id: str
    engine: str
    model: str
    capacity: int
    registered_at: float
    last_seen: float
    applied_version: int | None = None
    in_flight: int = 0
    last_error: str | None = None
    rejoins: int = 0
    submitted: int = 0
    weights_digest: str | None = None
    # weight proofs (docs/security.md): last version proven by a correct answer, when, the last
    # version a wrong or late answer was given for, and how many such answers since registering
    proven_version: int | None = None
    proven_at: float | None = None
    failed_version: int | None = None
    proof_failures: int = 0


@dataclass(slots=True)
class IssuedChallenge:
    """A weight challenge issued to one worker (the answer stays in the store)."""

    version: int
    nonce: str
    chunk_bytes: int
    chunks: int
    expires_at: float


@dataclass(slots=True)
class TakenChallenge:
    """A worker's outstanding challenge, removed from the store to be checked (used once)."""

    version: int
    answer: str
    expires_at: float


@dataclass(slots=True)
class NewSubmission:
    """A validated group, ready to be queued. ``payload`` is the wire bytes, kept unchanged."""

    idempotency_key: str
    worker_id: str
    group_id: str
    version_min: int
    version_max: int
    num_trajectories: int
    num_tokens: int
    mean_reward: float
    payload_digest: str  # sha256 hex of payload: detects a reused key with another payload
    payload: bytes


@dataclass(slots=True)
class QueuedMeta:
    """What the store keeps next to a queued payload."""

    submission_id: int
    worker_id: str
    group_id: str
    version_min: int
    version_max: int
    submitted_at: float
    num_trajectories: int
    num_tokens: int


@dataclass(slots=True)
class SubmitOutcome:
    status: Literal["accepted", "duplicate", "stale"]
    submission_id: int | None  # None when refused as stale
    queue_depth: int


@dataclass(slots=True)
class LeaseOutcome:
    batch_id: str  # "" when nothing was leased
    expires_at: float
    items: list[tuple[QueuedMeta, bytes]]
    dropped_stale: int
    queue_depth: int


@dataclass(slots=True)
class StoreCounters:
    depth: int
    leased: int
    submitted_total: int
    acked_total: int
    duplicates_total: int
    dropped: dict[str, int] = field(default_factory=dict)
    oldest_submitted_at: float | None = None


class CoordinatorStore(ABC):
    """Durable state of the coordinator. See the module docstring for the guarantees."""

    name: str
    #: True when a call is a short local operation (SQLite): routes may then run it on the event
    #: loop instead of paying a thread hop. False for network stores (Redis): a round trip would
    #: stall the loop, so routes always call them from worker threads.
    inline_ok: bool = False

    # -- versions ---------------------------------------------------------------------------
    @abstractmethod
    def add_version(self, record: VersionRecord) -> tuple[VersionRecord, bool]:
        """Record a version atomically.

        Accepted only if ``record.version > latest`` (gaps allowed; any version when empty).
        Re-adding an existing version with identical content (``recorded_at`` ignored) returns
        ``(stored, False)``: a safe retry. Anything else raises :class:`VersionConflict`.
        Returns ``(stored, True)`` when newly added.
        """

    @abstractmethod
    def get_version(self, version: int) -> VersionRecord | None: ...

    @abstractmethod
    def list_versions(self, after: int | None, limit: int) -> list[VersionRecord]:
        """Versions ``> after`` (all when None), ascending, at most ``limit``."""

    @abstractmethod
    def recent_versions(self, limit: int) -> list[VersionRecord]:
        """The newest ``limit`` versions, ascending."""

    @abstractmethod
    def latest_version(self) -> VersionRecord | None: ...

    @abstractmethod
    def latest_anchor(self) -> VersionRecord | None: ...

    # -- workers ----------------------------------------------------------------------------
    @abstractmethod
    def register_worker(self, reg: WorkerRegistration, now: float) -> WorkerRecord:
        """Create or refresh a worker. Re-registering an id keeps its counters and counts a
        rejoin; its reported version/in-flight/error, its proofs and its outstanding challenge
        are reset (it restarted: what it proved before says nothing about its new weights)."""

    @abstractmethod
    def heartbeat(
        self, worker_id: str, hb: WorkerHeartbeat, now: float, lost_after_s: float
    ) -> WorkerRecord | None:
        """Update a worker's report; None if unknown. A heartbeat after more than
        ``lost_after_s`` of silence counts a rejoin."""

    @abstractmethod
    def get_worker(self, worker_id: str) -> WorkerRecord | None: ...

    @abstractmethod
    def list_workers(self) -> list[WorkerRecord]: ...

    @abstractmethod
    def remove_worker(self, worker_id: str) -> bool:
        """Forget a worker (and its outstanding challenge); False if unknown. Its accepted
        groups stay queued."""

    # -- weight proofs ----------------------------------------------------------------------
    @abstractmethod
    def add_challenges(
        self,
        version: int,
        chunk_bytes: int,
        chunks: int,
        pairs: list[tuple[str, str]],
        keep_from: int,
    ) -> tuple[int, int]:
        """Add (nonce, answer) pairs to ``version``'s pool (a nonce already in it is skipped)
        and drop the pools of versions below ``keep_from``. Returns ``(added, pool size)``."""

    @abstractmethod
    def issue_challenge(
        self, worker_id: str, version: int, now: float, expires_at: float
    ) -> IssuedChallenge | None:
        """The worker's challenge for ``version``: its outstanding one if it is for that version
        and not expired, else a pair taken from the pool (replacing any other outstanding one);
        None when the pool is empty. Atomic: no pair is ever issued twice."""

    @abstractmethod
    def take_challenge(self, worker_id: str, nonce: str) -> TakenChallenge | None:
        """Remove and return the worker's outstanding challenge if its nonce is ``nonce``."""

    @abstractmethod
    def record_proof(
        self, worker_id: str, version: int, ok: bool, now: float
    ) -> WorkerRecord | None:
        """Record a checked answer: a right one sets ``proven_version``/``proven_at``, a wrong
        or late one sets ``failed_version`` and counts a failure. None if the worker is unknown."""

    # -- trajectory queue -------------------------------------------------------------------
    @abstractmethod
    def submit(
        self, sub: NewSubmission, now: float, min_version: int | None, staleness: int
    ) -> SubmitOutcome:
        """Queue a group, atomically and idempotently.

        In order: a known idempotency key returns ``duplicate`` with the original id (or raises
        :class:`IdempotencyConflict` if the payload differs); a group with ``version_min <
        min_version`` is refused as ``stale`` and counted (``stale_at_submit``); otherwise it is
        appended, and the reward curve, the staleness histogram (bucket ``staleness``) and the
        worker's ``submitted`` counter are updated in the same transaction.
        """

    @abstractmethod
    def lease(
        self, max_groups: int, lease_s: float, now: float, min_version: int | None
    ) -> LeaseOutcome:
        """Reclaim expired leases, drop stale groups, lease the oldest ``max_groups``."""

    @abstractmethod
    def ack(self, batch_id: str, now: float) -> int:
        """Remove a leased batch's groups for good; returns their number. Repeating a
        successful ack returns the same number. Raises :class:`LeaseExpired` when too late
        (the groups are then back in the queue) and :class:`UnknownLease` for unknown ids."""

    @abstractmethod
    def nack(self, batch_id: str, now: float) -> int:
        """Return a leased batch's groups to the head of the queue now."""

    @abstractmethod
    def extend(self, batch_id: str, lease_s: float, now: float) -> float:
        """Move an active lease's expiry to ``now + lease_s`` (also earlier than before);
        returns the new expiry. Raises :class:`LeaseExpired` when the lease already expired
        (its groups are then back in the queue), was acked or nacked, and
        :class:`UnknownLease` for unknown ids."""

    @abstractmethod
    def reclaim_expired(self, now: float) -> int:
        """Return the groups of every expired lease to the queue; returns how many groups."""

    @abstractmethod
    def count_drop(self, reason: str, n: int = 1) -> None: ...

    @abstractmethod
    def counters(self) -> StoreCounters: ...

    @abstractmethod
    def reward_curve(self, limit: int) -> list[tuple[int, int, float]]:
        """``(version, groups, reward_sum)`` for the newest ``limit`` versions, ascending."""

    @abstractmethod
    def staleness_hist(self) -> dict[int, int]: ...

    @abstractmethod
    def ping(self) -> None:
        """Raise if the backend does not answer."""

    @abstractmethod
    def close(self) -> None: ...


def same_version_content(a: VersionRecord, b: VersionRecord) -> bool:
    """True when two records describe the same publish (bookkeeping times ignored)."""
    skip = {"recorded_at"}
    return a.model_dump(exclude=skip) == b.model_dump(exclude=skip)
