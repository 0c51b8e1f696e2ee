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

Dead letters: a group the trainer could not train on is never queued again in a loop. The
trainer names it when it acks its batch (a :class:`Rejection`: the group was checked and refused,
and its worker's rejection count grows), and a group whose lease expired
:data:`MAX_DELIVERIES` times without an ack (its trainer failed or died holding it, twice) is set
aside at the next lease instead of being leased a third time. A group coming back after an
expiry is leased alone (its ``deliveries`` is 2), so that a trainer training it alone implicates
no other group if it fails on it again. Either way it becomes a *dead letter*: out of the queue, kept with its payload and the reason (:meth:`dead_letters`), until
an operator puts it back (:meth:`requeue_dead_letter`); at most :data:`MAX_DEAD_LETTERS` are
kept (the oldest go first, counted as ``dead_letter_evicted``). A nack is a deliberate return
and does not count as a delivery.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from deltarl.services.coordinator.schemas import (
    VersionManifest,
    VersionRecord,
    WorkerHeartbeat,
    WorkerRegistration,
    manifest_digest,
)


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


MAX_DELIVERIES = 2  # leases that may expire holding a group before it becomes a dead letter
MAX_DEAD_LETTERS = 10_000  # dead letters kept (payloads included); older ones are dropped
UNDELIVERED = "undelivered"  # the reason of a dead letter set aside by lease (expired twice)
UNDELIVERED_DETAIL = (
    "leased and not acknowledged twice: the trainer may have failed on this group; set aside so "
    "that it cannot stop the trainer again"
)


@dataclass(slots=True)
class Rejection:
    """A leased group the trainer refused, named when it acks the group's batch."""

    submission_id: int
    reason: str  # short stable code, e.g. "bad_token_id", "sampling_mismatch"
    detail: str  # what was wrong, for a person


@dataclass(slots=True)
class DeadLetter:
    """A group out of the queue for good (unless requeued), with why."""

    submission_id: int
    worker_id: str
    group_id: str
    version_min: int
    version_max: int
    submitted_at: float
    dead_at: float
    deliveries: int
    reason: str
    detail: str


@dataclass(slots=True)
class WorkerRejections:
    """How many of a worker's groups the trainer refused, and the last reason. Kept per worker
    id across re-registration and removal: leaving and joining again does not clear it."""

    worker_id: str
    rejected: int
    last_reason: str | None = None
    last_detail: str | None = None
    last_at: float | None = None


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
class ChallengeStats:
    """Where one version's weight challenges stand (never an answer). "Active" workers were seen
    after the ``active_after`` time given; ``unchallenged`` and ``active`` count only those that
    may still serve the version (their applied version is at most it, or none yet)."""

    version: int
    posted: bool  # the trainer posted a pool for this version (it may be used up)
    pool_size: int  # pairs not issued yet
    challenged: int  # worker ids issued at least one challenge at this version
    active: int  # active workers that may still serve this version
    unchallenged: int  # of those, the ones never issued a challenge at this version
    waiting: int  # active workers serving this version, unproven there, the pool could not serve
    waiting_total: int  # the same over every version with a pool (each worker at its own)


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
    deliveries: int = 1  # leases that held it, this one included (set by lease)


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
    dead_letters: int = 0  # groups set aside (see the module docstring)
    rejected: dict[str, int] = field(default_factory=dict)  # trainer rejections by reason


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
        self,
        worker_id: str,
        version: int,
        now: float,
        expires_at: float,
        max_attempts: int,
        active_after: float,
    ) -> IssuedChallenge | None:
        """The worker's challenge for ``version``: its outstanding one if it is for that version
        and not expired (re-sent, nothing used), else a pair taken from the pool (replacing any
        other outstanding one), but only if

        * the worker id was issued fewer than ``max_attempts`` challenges at ``version`` (counted
          across registrations, until the version's pool is dropped): one worker uses O(1) pairs
          of a version however often it heartbeats, fails or rejoins;
        * for its second or later one: the pool holds more pairs than the active workers (seen
          after ``active_after``, applied version at most ``version`` or none) never issued one
          at ``version``: retries never take a first challenge's pair.

        None otherwise, and when the trainer posted no pool for ``version``. A worker the pool
        could not serve (used up, or kept for first challenges) counts as waiting at ``version``
        until one is issued to it. Atomic: no pair is ever issued twice."""

    @abstractmethod
    def challenge_stats(self, version: int, active_after: float) -> ChallengeStats:
        """Where ``version``'s challenges stand (see :class:`ChallengeStats`)."""

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
        self,
        max_groups: int,
        lease_s: float,
        now: float,
        min_version: int | None,
        max_bytes: int | None = None,
    ) -> LeaseOutcome:
        """Reclaim expired leases, drop stale groups, set aside as dead letters the groups
        already delivered :data:`MAX_DELIVERIES` times, then lease the oldest ``max_groups``
        whose payloads add up to at most ``max_bytes`` (the first group always, whatever its
        size; None: no byte bound). A group delivered before (its lease expired) is leased
        alone: the lease ends before it, or holds only it."""

    @abstractmethod
    def ack(self, batch_id: str, now: float, rejected: Sequence[Rejection] = ()) -> int:
        """Remove a leased batch's groups for good; returns their number. The ``rejected`` ones
        become dead letters and count against their workers (:class:`WorkerRejections`); each
        must be a group of this batch (else :class:`StoreError`, and nothing changes).
        Repeating a successful ack returns the same number. Raises :class:`LeaseExpired` when
        too late (the groups are then back in the queue) and :class:`UnknownLease` for unknown
        ids."""

    @abstractmethod
    def nack(self, batch_id: str, now: float) -> int:
        """Return a leased batch's groups to the head of the queue now (not counted as a
        delivery)."""

    @abstractmethod
    def dead_letters(self, limit: int) -> tuple[int, list[DeadLetter]]:
        """``(count, the newest ``limit`` dead letters, newest first)``."""

    @abstractmethod
    def requeue_dead_letter(self, submission_id: int) -> bool:
        """Put a dead letter back in the queue, ahead of the groups submitted after it, with its
        deliveries reset; False if there is no such dead letter."""

    @abstractmethod
    def worker_rejections(self) -> dict[str, WorkerRejections]:
        """Every worker id with at least one rejected group."""

    @abstractmethod
    def clear_rejections(self, worker_id: str) -> bool:
        """Forget a worker's rejections (an operator vouches for it); False if it had none."""

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


def load_version_record(raw: str | bytes) -> VersionRecord:
    """A stored version record. Coordinators before ``manifest_digest`` kept the whole manifest
    in each record; such a record reads as the summary it holds, its manifest replaced by that
    manifest's digest (the bucket keeps the manifest itself), so an old store still opens and a
    retried publish of an old version is still told apart from a different one."""
    text = raw if isinstance(raw, str) else raw.decode()
    if '"manifest"' not in text:  # the key alone: "manifest_digest" does not match
        return VersionRecord.model_validate_json(text)
    doc = json.loads(text)
    legacy = VersionManifest.model_validate(doc.pop("manifest"))
    doc.setdefault("manifest_digest", manifest_digest(legacy))
    return VersionRecord.model_validate(doc)
