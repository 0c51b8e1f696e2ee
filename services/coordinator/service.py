"""The coordinator's rules, between the thin HTTP routes and the store.

:class:`Coordinator` methods are synchronous and thread-safe (the routes run them in worker
threads); every state change is one atomic store operation, so concurrent requests and several
coordinator processes sharing a Redis store stay consistent.

Staleness: with ``V`` the newest recorded version and ``S = max_staleness``, a group whose oldest
policy version ``version_min < V - S`` is refused at submit (409 ``stale_version``, counted as
``stale_at_submit``) and dropped at lease time if ``V`` moved on meanwhile (``stale_at_pull``).
A group citing a version newer than ``V`` is refused (409 ``future_version``).

What a group may contain is checked where it enters (:meth:`Coordinator.decode`): the wire's
own bounds (finite rewards, logprobs and temperatures in ranges the trainer's float32 arithmetic
takes; :mod:`.schemas.trajectories`), at most ``max_group_bytes``, and the model's limits the
trainer registered with the latest version (token ids inside its vocabulary, trajectories within
its context). What only the trainer can judge (do the on-policy logprobs match the weights the
group claims?) comes back with the ack: refused groups become dead letters and count against
their worker, which is flagged ``suspect`` after ``suspect_after`` of them (and, with
``refuse_suspect_workers``, gets no admission and no submission until cleared).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.concurrency import run_in_threadpool

from deltarl.services.coordinator.auth import acting_worker_error
from deltarl.services.coordinator.errors import ApiError, conflict, invalid, not_found
from deltarl.services.coordinator.schemas import (
    AckResult,
    AdmissionRequest,
    AdmissionResponse,
    BatchItem,
    BatchLease,
    ChallengePool,
    ChallengePoolResult,
    ChallengePoolStatus,
    DeadLetterInfo,
    DeadLetterList,
    GroupRejection,
    HeartbeatAck,
    LeaseExtension,
    ModelLimits,
    ProofAnswer,
    ProofResult,
    QueueStats,
    RewardPoint,
    StatusSummary,
    TrajectoryGroup,
    VersionManifest,
    VersionPoint,
    VersionRecord,
    WeightChallenge,
    WorkerHeartbeat,
    WorkerInfo,
    WorkerRegistration,
    check_model_limits,
    decode_group,
    manifest_digest,
)
from deltarl.services.coordinator.schemas.versions import MAX_CHALLENGES
from deltarl.services.coordinator.settings import CoordinatorSettings
from deltarl.services.coordinator.store import (
    ChallengeStats,
    CoordinatorStore,
    IdempotencyConflict,
    LeaseExpired,
    NewSubmission,
    Rejection,
    StoreError,
    UnknownLease,
    VersionConflict,
    WorkerRecord,
    WorkerRejections,
)
from deltarl.services.coordinator.versions import VersionIndex, summarize

logger = logging.getLogger(__name__)

# Fixed here rather than settings (nobody had a reason to change them):
PROOF_POOL_VERSIONS = 64  # weight-challenge pools kept for the newest versions: a worker answers
# a challenge of the version it holds, at most max_staleness (4 by default) behind the newest
PROOF_POOL_MARGIN = 8
"""Spare weight challenges asked of the trainer per version, besides one per active worker not yet
challenged at it and a quarter of the active workers: enough for the retries of a few failed
proofs and a few workers joining between two top-ups (the trainer tops the pool up at every
publication), few enough that a version's proofs cost the trainer little (each pair is a few
chunks' hashes)."""
STATUS_WORKERS = 1000  # workers /v1/status lists (laggiest first); ?workers= asks for fewer
STATUS_HISTORY = 500  # versions and reward points /v1/status lists: a page's worth of curve
T = TypeVar("T")


def unknown_worker(worker_id: str) -> ApiError:
    return not_found(
        "unknown_worker", f"worker {worker_id!r} is not registered: POST /v1/workers first"
    )


@dataclass(frozen=True)
class Pacing:
    """How often the coordinator refreshes what it serves. Not settings: the values suit every
    deployment, each for the reason given; tests of a coordinator in their own process pass
    shorter ones to :func:`~deltarl.services.coordinator.app.create_app`."""

    # /v1/status is polled by the status page, `deltarl status`, dashboards and the trainer:
    # computed at most twice a second, 50 readers cost what one does.
    status_cache_s: float = 0.5
    # Versions recorded through another coordinator process sharing the store reach the event
    # stream within this; a request citing an unknown version refreshes at once anyway.
    event_poll_s: float = 0.25
    # Expired leases also return to the queue at every lease request; this bounds the wait
    # only while nobody leases.
    reclaim_interval_s: float = 1.0


class Coordinator:
    def __init__(
        self,
        store: CoordinatorStore,
        settings: CoordinatorSettings,
        clock: Callable[[], float] = time.time,
        pacing: Pacing | None = None,
    ) -> None:
        self.store = store
        self.settings = settings
        self.clock = clock
        self.pacing = pacing or Pacing()
        self.versions = VersionIndex(store)
        self.versions.refresh()
        self._status_lock = threading.Lock()
        # (monotonic time, full summary, {workers limit: (summary, json bytes)})
        self._status: tuple[float, StatusSummary, dict[int, tuple[StatusSummary, bytes]]] | None = (
            None
        )
        self.on_version: Callable[[VersionRecord], None] | None = None  # set by the app

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a service call from an async route: on the event loop when the store's calls are
        short and local (``CoordinatorStore.inline_ok``), else in a worker thread.

        Why not always a thread: the sqlite3 and socket calls release the GIL, so with worker
        threads around, every release hands the GIL to a thread and the event loop waits up to
        the 5 ms switch interval to get it back; at a thousand requests a second that convoy,
        not the work, dominated latency. Every route therefore goes through here, and with an
        inline store the server runs single-threaded."""
        if self.store.inline_ok:
            return fn(*args)
        return await run_in_threadpool(fn, *args)

    # -- versions ---------------------------------------------------------------------------
    def publish(
        self, manifest: VersionManifest, limits: ModelLimits | None = None
    ) -> tuple[VersionRecord, bool]:
        """Record a version (trainer) with the model's limits (checked at every later
        submission). Returns ``(record, created)``; a retry of an identical publish (same
        :func:`manifest_digest`, same limits) returns the stored record with ``created=False``.
        The manifest is checked, summarized and dropped: the bucket keeps it."""
        self.versions.refresh()  # publishes are rare: see versions other processes recorded
        known = self.versions.get(manifest.version)
        if known is not None:
            if known.manifest_digest == manifest_digest(manifest) and known.limits == limits:
                return known, False
            raise conflict(
                "version_conflict",
                f"version {manifest.version} is already recorded with a different manifest",
            )
        previous = self.versions.latest()
        if previous is not None and manifest.version <= previous.version:
            raise conflict(
                "version_out_of_order",
                f"version {manifest.version} is out of order: versions must increase and "
                f"{previous.version} is already recorded",
                {"latest_version": previous.version},
            )
        if previous is None and not manifest.has_anchor:
            raise invalid("anchor_required", "the first version must carry an anchor")
        for o in manifest.deltas:
            assert o.base_version is not None
            base = self.versions.get(o.base_version)
            if base is None:
                self.versions.refresh()  # recorded through another coordinator process?
                base = self.versions.get(o.base_version)
            if base is None:
                raise not_found(
                    "unknown_version",
                    f"delta {o.key} applies to version {o.base_version}, which was never recorded",
                )
            if base.state_digest != o.base_digest:
                raise conflict(
                    "base_digest_mismatch",
                    f"delta {o.key}: base_digest differs from version {o.base_version}'s "
                    "state_digest; it would not apply",
                )
        record = summarize(manifest, previous, self.clock(), limits)
        try:
            stored, created = self.store.add_version(record)
        except VersionConflict as exc:  # another coordinator process raced us
            self.versions.refresh()
            raise conflict("version_conflict", str(exc)) from exc
        self.versions.add(stored)
        if created:
            logger.info(
                "version %d recorded (%s, %d bytes)", stored.version, stored.kind, stored.bytes
            )
            if self.on_version is not None:
                self.on_version(stored)
        return stored, created

    def version(self, version: int) -> VersionRecord:
        rec = self.versions.get(version)
        if rec is None:
            rec = self.store.get_version(version)
        if rec is None:
            raise not_found("unknown_version", f"version {version} was never recorded")
        return rec

    def latest_at_least(self, version: int) -> int | None:
        """The latest version number, refreshed from the store first when ``version`` is newer
        than what this process knows (another coordinator process may have recorded it)."""
        latest = self.latest_number()
        if latest is None or version > latest:
            self.versions.refresh()
            latest = self.latest_number()
        return latest

    def latest_number(self) -> int | None:
        latest = self.versions.latest()
        return None if latest is None else latest.version

    def min_version(self) -> int | None:
        latest = self.latest_number()
        return None if latest is None else latest - self.settings.max_staleness

    # -- workers ----------------------------------------------------------------------------
    def _info(
        self,
        w: WorkerRecord,
        now: float,
        latest: int | None,
        rejections: Mapping[str, WorkerRejections] | None = None,
    ) -> WorkerInfo:
        lag_v = lag_s = None
        if w.applied_version is not None and latest is not None:
            lag_v = max(0, latest - w.applied_version)
            newer = self.versions.first_newer_than(w.applied_version)
            lag_s = 0.0 if newer is None else max(0.0, now - newer.recorded_at)
        lost = now - w.last_seen > self.settings.lost_after_s
        matches = None
        if w.weights_digest is not None and w.applied_version is not None:
            record = self.versions.get(w.applied_version)
            if record is not None:
                matches = record.state_digest == w.weights_digest
        verified = None
        if w.applied_version is not None:
            if w.proven_version == w.applied_version:
                verified = True
            elif w.failed_version == w.applied_version:
                verified = False
        return WorkerInfo(
            worker_id=w.worker_id,
            engine=w.engine,
            model=w.model,
            capacity=w.capacity,
            state="lost" if lost else "active",
            applied_version=w.applied_version,
            in_flight=w.in_flight,
            last_error=w.last_error,
            registered_at=w.registered_at,
            last_seen=w.last_seen,
            rejoins=w.rejoins,
            lag_versions=lag_v,
            lag_seconds=lag_s,
            submitted=w.submitted,
            weights_digest=w.weights_digest,
            digest_matches=matches,
            weights_verified=verified,
            weights_proven_version=w.proven_version,
            weights_proven_at=w.proven_at,
            proof_failures=w.proof_failures,
            **self._rejection_fields(w.worker_id, rejections),
        )

    def _rejection_fields(
        self, worker_id: str, rejections: Mapping[str, WorkerRejections] | None
    ) -> dict[str, Any]:
        got = (rejections if rejections is not None else self.store.worker_rejections()).get(
            worker_id
        )
        if got is None:
            return {}
        return {
            "rejected_groups": got.rejected,
            "last_rejection": f"{got.last_reason}: {got.last_detail}"[:500],
            "suspect": got.rejected >= self.settings.suspect_after,
        }

    def _ack(
        self, w: WorkerRecord, now: float, challenge: WeightChallenge | None = None
    ) -> HeartbeatAck:
        latest = self.versions.latest()
        return HeartbeatAck(
            worker=self._info(w, now, None if latest is None else latest.version),
            latest_version=None if latest is None else latest.version,
            latest_anchor=None if latest is None else latest.anchor_version,
            max_staleness=self.settings.max_staleness,
            heartbeat_interval_s=self.settings.heartbeat_interval_s,
            lost_after_s=self.settings.lost_after_s,
            challenge=challenge,
        )

    def register(self, reg: WorkerRegistration) -> HeartbeatAck:
        now = self.clock()
        w = self.store.register_worker(reg, now)
        return self._ack(w, now)

    def check_applied_version(self, applied_version: int | None) -> None:
        """409 ``future_version`` when a worker claims a version newer than the latest recorded
        (heartbeats and admission requests)."""
        if applied_version is None:
            return
        latest = self.latest_at_least(applied_version)
        if latest is None or applied_version > latest:
            raise conflict(
                "future_version",
                f"applied_version {applied_version} is newer than the latest recorded "
                f"version ({latest})",
            )

    def heartbeat(self, worker_id: str, hb: WorkerHeartbeat) -> HeartbeatAck:
        self.check_applied_version(hb.applied_version)
        now = self.clock()
        w = self.store.heartbeat(worker_id, hb, now, self.settings.lost_after_s)
        if w is None:
            raise unknown_worker(worker_id)
        challenge = None
        if w.applied_version is not None and w.proven_version != w.applied_version:
            issued = self.store.issue_challenge(
                worker_id,
                w.applied_version,
                now,
                now + self.settings.proof_ttl_s,
                self.settings.proof_attempts,
                now - self.settings.lost_after_s,
            )
            if issued is not None:
                challenge = WeightChallenge(
                    version=issued.version,
                    nonce=issued.nonce,
                    chunk_bytes=issued.chunk_bytes,
                    chunks=issued.chunks,
                    expires_at=issued.expires_at,
                )
        return self._ack(w, now, challenge)

    # -- weight proofs ----------------------------------------------------------------------
    def _known_version(self, version: int) -> None:
        if self.versions.get(version) is None:
            self.versions.refresh()
            if self.versions.get(version) is None:
                raise not_found("unknown_version", f"version {version} was never recorded")

    def _challenge_stats(self, version: int, now: float) -> ChallengeStats:
        return self.store.challenge_stats(version, now - self.settings.lost_after_s)

    def _pool_status(self, st: ChallengeStats) -> ChallengePoolStatus:
        """Where a version's challenges stand, and how many more pairs the pool wants: one per
        active worker not yet challenged at it, plus a spare (:data:`PROOF_POOL_MARGIN` and a
        quarter of the active workers) for retries and workers that join. None is wanted of a
        version the trainer posted no challenges for (it may publish none)."""
        target = st.unchallenged + PROOF_POOL_MARGIN + -(-st.active // 4)
        wanted = max(0, min(target, MAX_CHALLENGES) - st.pool_size) if st.posted else 0
        return ChallengePoolStatus(
            version=st.version,
            posted=st.posted,
            pool_size=st.pool_size,
            target=target,
            wanted=wanted,
            workers_active=st.active,
            workers_challenged=st.challenged,
            workers_unchallenged=st.unchallenged,
            workers_waiting=st.waiting,
        )

    def challenge_pool(self, version: int) -> ChallengePoolStatus:
        """``GET /v1/versions/{v}/challenges`` (read): the pool's state, never an answer."""
        self._known_version(version)
        return self._pool_status(self._challenge_stats(version, self.clock()))

    def add_challenges(self, version: int, pool: ChallengePool) -> ChallengePoolResult:
        """Store the trainer's (nonce, answer) pairs for a recorded version (trainer); the
        answer says how many more the fleet needs now (``wanted``)."""
        self._known_version(version)
        latest = self.latest_number()
        keep_from = (version if latest is None else latest) - PROOF_POOL_VERSIONS + 1
        added, size = self.store.add_challenges(
            version,
            pool.chunk_bytes,
            pool.chunks,
            [(p.nonce, p.answer) for p in pool.items],
            keep_from,
        )
        st = self._pool_status(self._challenge_stats(version, self.clock()))
        return ChallengePoolResult(
            version=version, added=added, pool_size=size, target=st.target, wanted=st.wanted
        )

    def prove(self, worker_id: str, body: ProofAnswer) -> ProofResult:
        """Check a worker's answer to its outstanding challenge (used once, right or wrong)."""
        now = self.clock()
        taken = self.store.take_challenge(worker_id, body.nonce)
        if taken is None:
            if self.store.get_worker(worker_id) is None:
                raise unknown_worker(worker_id)
            raise conflict(
                "unknown_challenge",
                "no outstanding weight challenge with this nonce for this worker (never issued, "
                "already answered, or replaced by a newer one): answer the challenge of the "
                "latest heartbeat",
            )
        # constant-time comparison: the answer must not leak through timing
        right = hmac.compare_digest(body.answer.encode(), taken.answer.encode())
        in_time = now <= taken.expires_at
        ok = right and in_time
        if self.store.record_proof(worker_id, taken.version, ok, now) is None:
            raise unknown_worker(worker_id)
        if not ok:
            logger.warning(
                "worker %s failed its weight proof at v%d (%s)",
                worker_id,
                taken.version,
                "wrong answer" if not right else "too late",
            )
        return ProofResult(worker_id=worker_id, version=taken.version, verified=ok)

    def worker(self, worker_id: str) -> WorkerInfo:
        w = self.store.get_worker(worker_id)
        if w is None:
            raise unknown_worker(worker_id)
        return self._info(w, self.clock(), self.latest_number())

    def workers(self) -> list[WorkerInfo]:
        now, latest = self.clock(), self.latest_number()
        rejections = self.store.worker_rejections()
        return [self._info(w, now, latest, rejections) for w in self.store.list_workers()]

    def remove_worker(self, worker_id: str) -> None:
        if not self.store.remove_worker(worker_id):
            raise unknown_worker(worker_id)

    # -- trajectories -----------------------------------------------------------------------
    def decode(self, payload: bytes) -> TrajectoryGroup:
        """Parse and check one submitted group (see the module docstring): 413
        ``group_too_large``, 422 ``bad_payload`` naming what is wrong. CPU- and memory-heavy
        for large groups: the route runs it off the event loop."""
        if len(payload) > self.settings.max_group_bytes:
            raise ApiError(
                413,
                "group_too_large",
                f"a trajectory group of {len(payload)} bytes is over max_group_bytes="
                f"{self.settings.max_group_bytes}: submit smaller groups (or raise "
                "DELTARL_COORDINATOR_MAX_GROUP_BYTES)",
            )
        try:
            group = decode_group(payload)
        except ValueError as exc:
            raise invalid("bad_payload", f"trajectory payload refused: {exc}") from exc
        limits = self.model_limits()
        if limits is not None:
            try:
                check_model_limits(group, limits)
            except ValueError as exc:
                raise invalid("bad_payload", f"trajectory payload refused: {exc}") from exc
        return group

    def model_limits(self) -> ModelLimits | None:
        """The limits the trainer registered with the latest version; None: none registered."""
        latest = self.versions.latest()
        return None if latest is None else latest.limits

    def submit(
        self,
        payload: bytes,
        token_worker: str | None = None,
        group: TrajectoryGroup | None = None,
    ) -> tuple[int, bool, int, int | None]:
        """Validate and queue one group. Returns ``(submission_id, duplicate, depth, V)``.
        ``token_worker``: the worker a per-worker token authenticated (the group must be its).
        ``group``: ``payload`` already :meth:`decode`d (None: decoded here)."""
        if group is None:
            group = self.decode(payload)
        if token_worker is not None and group.worker_id != token_worker:
            raise acting_worker_error(token_worker, group.worker_id)
        if self.store.get_worker(group.worker_id) is None:
            raise unknown_worker(group.worker_id)
        if self.settings.refuse_suspect_workers and self.is_suspect(group.worker_id):
            raise ApiError(
                403,
                "suspect_worker",
                f"worker {group.worker_id!r} is suspect: the trainer refused too many of its "
                "groups (see GET /v1/workers/{id}); an operator clears it with DELETE "
                "/v1/workers/{id}/rejections",
            )
        latest = self.latest_at_least(group.version_max)
        if latest is None or group.version_max > latest:
            raise conflict(
                "future_version",
                f"the group cites policy version {group.version_max}, newer than the latest "
                f"recorded version ({latest})",
                {"latest_version": latest},
            )
        min_version = latest - self.settings.max_staleness
        sub = NewSubmission(
            idempotency_key=group.idempotency_key,
            worker_id=group.worker_id,
            group_id=group.group_id,
            version_min=group.version_min,
            version_max=group.version_max,
            num_trajectories=len(group.trajectories),
            num_tokens=group.num_tokens,
            mean_reward=group.mean_reward,
            payload_digest=hashlib.sha256(payload).hexdigest(),
            payload=payload,
        )
        try:
            out = self.store.submit(sub, self.clock(), min_version, latest - group.version_min)
        except IdempotencyConflict as exc:
            raise conflict("idempotency_conflict", str(exc)) from exc
        if out.status == "stale":
            raise conflict(
                "stale_version",
                f"refused: the group's oldest policy version {group.version_min} is more than "
                f"max_staleness={self.settings.max_staleness} versions behind the latest "
                f"({latest}); update the weights before generating",
                {"latest_version": latest, "min_version": min_version},
            )
        assert out.submission_id is not None
        return out.submission_id, out.status == "duplicate", out.queue_depth, latest

    def lease(self, max_groups: int, lease_s: float | None) -> tuple[BatchLease, list[bytes]]:
        if max_groups < 1 or max_groups > self.settings.max_batch_groups:
            raise invalid(
                "bad_batch_size",
                f"max_groups must be within 1..{self.settings.max_batch_groups}",
            )
        lease_s = self.settings.default_lease_s if lease_s is None else lease_s
        if not 0 < lease_s <= self.settings.max_lease_s:
            raise invalid("bad_lease", f"lease_s must be within (0, {self.settings.max_lease_s}]")
        out = self.store.lease(
            max_groups,
            lease_s,
            self.clock(),
            self.min_version(),
            max_bytes=self.settings.max_lease_bytes,
        )
        items = [
            BatchItem(
                submission_id=m.submission_id,
                worker_id=m.worker_id,
                group_id=m.group_id,
                version_min=m.version_min,
                version_max=m.version_max,
                submitted_at=m.submitted_at,
                num_trajectories=m.num_trajectories,
                num_tokens=m.num_tokens,
                deliveries=m.deliveries,
            )
            for m, _ in out.items
        ]
        lease = BatchLease(
            batch_id=out.batch_id,
            expires_at=out.expires_at,
            items=items,
            dropped_stale=out.dropped_stale,
            current_version=self.latest_number(),
            queue_depth=out.queue_depth,
        )
        return lease, [p for _, p in out.items]

    def extend(self, batch_id: str, lease_s: float | None) -> LeaseExtension:
        lease_s = self.settings.default_lease_s if lease_s is None else lease_s
        if not 0 < lease_s <= self.settings.max_lease_s:
            raise invalid("bad_lease", f"lease_s must be within (0, {self.settings.max_lease_s}]")
        try:
            expires_at = self.store.extend(batch_id, lease_s, self.clock())
        except UnknownLease as exc:
            raise not_found("unknown_batch", str(exc)) from exc
        except LeaseExpired as exc:
            raise conflict("lease_expired", str(exc)) from exc
        return LeaseExtension(batch_id=batch_id, expires_at=expires_at)

    def ack(
        self, batch_id: str, nack: bool = False, rejected: Sequence[GroupRejection] = ()
    ) -> AckResult:
        """Acknowledge (or, ``nack``, return) a lease; ``rejected``: its groups the trainer
        refused (dead letters from now on; a nack takes none)."""
        now = self.clock()
        try:
            if nack:
                n = self.store.nack(batch_id, now)
            else:
                refused = [Rejection(r.submission_id, r.reason, r.detail) for r in rejected]
                n = self.store.ack(batch_id, now, refused)
        except UnknownLease as exc:
            raise not_found("unknown_batch", str(exc)) from exc
        except LeaseExpired as exc:
            raise conflict("lease_expired", str(exc)) from exc
        except StoreError as exc:
            raise invalid("bad_rejection", str(exc)) from exc
        if rejected:
            logger.warning(
                "batch %s: the trainer refused %d group(s): %s",
                batch_id,
                len(rejected),
                ", ".join(sorted({r.reason for r in rejected})),
            )
        return AckResult(batch_id=batch_id, acked=n, rejected=0 if nack else len(rejected))

    # -- dead letters and suspect workers ---------------------------------------------------
    def dead_letters(self, limit: int) -> DeadLetterList:
        count, items = self.store.dead_letters(limit)
        return DeadLetterList(
            count=count,
            items=[
                DeadLetterInfo(
                    submission_id=d.submission_id,
                    worker_id=d.worker_id,
                    group_id=d.group_id,
                    version_min=d.version_min,
                    version_max=d.version_max,
                    submitted_at=d.submitted_at,
                    dead_at=d.dead_at,
                    deliveries=d.deliveries,
                    reason=d.reason,
                    detail=d.detail,
                )
                for d in items
            ],
        )

    def requeue_dead_letter(self, submission_id: int) -> None:
        if not self.store.requeue_dead_letter(submission_id):
            raise not_found("unknown_dead_letter", f"no dead letter {submission_id}")

    def clear_rejections(self, worker_id: str) -> None:
        """An operator vouches for a worker: its rejections are forgotten (not suspect)."""
        if not self.store.clear_rejections(worker_id):
            raise not_found("no_rejections", f"worker {worker_id!r} has no rejected groups")
        logger.warning("worker %s: rejections cleared by the trainer's token", worker_id)

    def is_suspect(self, worker_id: str) -> bool:
        got = self.store.worker_rejections().get(worker_id)
        return got is not None and got.rejected >= self.settings.suspect_after

    def admission(self, req: AdmissionRequest) -> AdmissionResponse:
        """See :class:`AdmissionResponse`; refused like a heartbeat (404 ``unknown_worker``,
        409 ``future_version``)."""
        self.check_applied_version(req.applied_version)
        worker = self.worker(req.worker_id)
        status = self.status()
        latest = status.latest_version
        in_flight = status.in_flight
        budget = self.settings.target_queue_groups - status.queue.depth
        share = budget // max(1, status.workers_active) - worker.in_flight
        grant, reason = min(req.want, max(0, budget - in_flight, share)), "ok"
        if latest is None:
            grant, reason = 0, "no_version"
        elif self.settings.refuse_suspect_workers and worker.suspect:
            grant, reason = 0, "suspect"
        # at the bound, the next version (likely before the group ends) drops what it starts;
        # a worker at the newest version is always admitted (max_staleness = 0: on-policy)
        elif req.applied_version is not None and latest - req.applied_version >= max(
            1, self.settings.max_staleness
        ):
            grant, reason = 0, "update_weights"
        elif grant == 0 and req.want > 0:
            reason = "queue_full"
        return AdmissionResponse(
            grant=grant,
            reason=reason,
            current_version=latest,
            queue_depth=status.queue.depth,
            in_flight=in_flight,
            target_queue_groups=self.settings.target_queue_groups,
        )

    # -- status -----------------------------------------------------------------------------
    def status(self, workers_limit: int | None = None) -> StatusSummary:
        """The summary, computed from the store at most once per ``pacing.status_cache_s`` (then
        shared by every reader); ``workers_limit`` only trims the worker list."""
        return self._status_view(workers_limit)[0]

    def status_json(self, workers_limit: int | None = None) -> bytes:
        """:meth:`status` serialized (cached too: 50 readers cost one serialization)."""
        return self._status_view(workers_limit)[1]

    def _status_view(self, workers_limit: int | None) -> tuple[StatusSummary, bytes]:
        limit = STATUS_WORKERS if workers_limit is None else workers_limit
        now = time.monotonic()
        with self._status_lock:
            cached = self._status
            if cached is None or now - cached[0] >= self.pacing.status_cache_s:
                cached = (now, self._compute_status(), {})
                self._status = cached
            views = cached[2]
            if limit not in views:
                full = cached[1]
                view = full.model_copy(update={"workers": full.workers[:limit]})
                views[limit] = (view, view.model_dump_json().encode())
            return views[limit]

    def _compute_status(self) -> StatusSummary:
        now = self.clock()
        latest = self.versions.latest()
        latest_v = None if latest is None else latest.version
        c = self.store.counters()
        rejections = self.store.worker_rejections()
        workers = [self._info(w, now, latest_v, rejections) for w in self.store.list_workers()]
        workers.sort(
            key=lambda w: (not w.suspect, w.state != "lost", -(w.lag_versions or 0), w.worker_id)
        )
        hist = self.store.staleness_hist()
        proofs = None if latest_v is None else self._challenge_stats(latest_v, now)
        return StatusSummary(
            now=now,
            store=self.store.name,
            trainer_step=None if latest is None else latest.trainer_step,
            latest_version=latest_v,
            latest_anchor=None if latest is None else latest.anchor_version,
            max_staleness=self.settings.max_staleness,
            queue=QueueStats(
                depth=c.depth,
                leased=c.leased,
                submitted_total=c.submitted_total,
                acked_total=c.acked_total,
                duplicates_total=c.duplicates_total,
                dropped=c.dropped,
                oldest_age_s=None if c.oldest_submitted_at is None else now - c.oldest_submitted_at,
                dead_letters=c.dead_letters,
                rejected=c.rejected,
            ),
            workers_suspect=sum(
                r.rejected >= self.settings.suspect_after for r in rejections.values()
            ),
            workers_active=sum(w.state == "active" for w in workers),
            workers_lost=sum(w.state == "lost" for w in workers),
            in_flight=sum(w.in_flight for w in workers if w.state == "active"),
            workers=workers,
            versions=[
                VersionPoint(
                    version=r.version,
                    kind=r.kind,
                    trainer_step=r.trainer_step,
                    bytes=r.bytes,
                    full_bytes=r.full_bytes,
                    recorded_at=r.recorded_at,
                )
                for r in self.versions.recent(STATUS_HISTORY)
            ],
            rewards=[
                RewardPoint(version=v, groups=n, mean_reward=total / n)
                for v, n, total in self.store.reward_curve(STATUS_HISTORY)
                # rewards are bounded at submission; a store written before that is skipped
                if n and math.isfinite(total / n)
            ],
            staleness_hist={str(k): n for k, n in hist.items()},
            challenges=None if proofs is None else self._pool_status(proofs),
            workers_waiting_for_challenge=0 if proofs is None else proofs.waiting_total,
        )


__all__ = ["ApiError", "Coordinator"]
