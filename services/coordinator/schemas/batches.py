"""Submission results, leased batches, acks and admission control.

Queue protocol (trainer side), in order:

1. ``POST /v1/batches/lease`` -> a :class:`LeasedBatch` (msgpack): up to ``max_groups`` groups,
   oldest first, none older than the staleness bound at lease time (older ones are dropped and
   counted, see ``BatchLease.dropped_stale``), all held by this lease until ``expires_at``.
2. Train on them, then ``POST /v1/batches/{batch_id}/ack`` before ``expires_at``: the groups are
   gone for good. ``POST /v1/batches/{batch_id}/nack`` returns them to the queue at once.
3. A lease that is neither acked nor nacked expires: its groups go back to the head of the queue
   (in their original order) and the next lease may receive them; an ack after expiry is refused
   (409 ``lease_expired``). So a trainer that dies loses nothing, and a group is trained on at
   most once per successful ack.
4. ``POST /v1/batches/{batch_id}/extend`` (body ``{"lease_s": ...}``) moves ``expires_at`` to
   now + ``lease_s`` while the trainer still works on the batch (409 ``lease_expired`` once it
   expired, was acked or nacked): a trainer renews its leases well before they expire, so
   a slow step never loses its groups to the queue.
5. A group the trainer refuses (it fails a check, or its on-policy logprobs do not match the
   weights it claims) is named in the ack's body (:class:`AckRequest`): it becomes a *dead
   letter* (kept with its reason, ``GET /v1/dead-letters``) and counts against its worker; a
   group whose lease expired twice is set aside the same way at the next lease, so no group can
   stop a trainer again and again.
"""

from __future__ import annotations

from typing import Any

import msgpack
from pydantic import Field, model_validator

from deltarl.services.coordinator.schemas.common import ID_PATTERN, Count, Version, WireModel
from deltarl.services.coordinator.schemas.trajectories import (
    MAX_TOKENS_PER_TRAJECTORY,
    MAX_TRAJECTORIES_PER_GROUP,
    TrajectoryGroup,
    decode_group,
)

BATCH_FORMAT = "deltarl-batch-v1"


class SubmitResult(WireModel):
    """Answer to ``POST /v1/trajectories`` (worker role)."""

    submission_id: Count = Field(description="Queue sequence number assigned at acceptance.")
    duplicate: bool = Field(
        description="True when this idempotency key was already accepted: nothing was added."
    )
    queue_depth: Count = Field(description="Groups waiting in the queue after this submission.")
    current_version: Version | None = Field(description="Newest published version at acceptance.")


class BatchItem(WireModel):
    """Metadata of one group in a leased batch (the payload travels alongside, see LeasedBatch)."""

    submission_id: Count = Field(description="Queue sequence number.")
    worker_id: str = Field(description="Worker that submitted the group.")
    group_id: str = Field(description="The group's id (prompt).")
    version_min: Version = Field(description="Oldest policy version in the group.")
    version_max: Version = Field(description="Newest policy version in the group.")
    submitted_at: float = Field(description="Acceptance time (Unix s).")
    num_trajectories: int = Field(
        ge=1, le=MAX_TRAJECTORIES_PER_GROUP, description="Trajectories in the group."
    )
    num_tokens: int = Field(
        ge=0,
        le=MAX_TRAJECTORIES_PER_GROUP * MAX_TOKENS_PER_TRAJECTORY,
        description="Tokens in the group, prompts included.",
    )
    deliveries: int = Field(
        default=1,
        ge=1,
        description="Leases that held the group, this one included. 2: an earlier lease "
        "expired holding it (its trainer may have failed on it); such a group is leased "
        "alone, to be trained alone, and is set aside if that lease expires too.",
    )


class BatchLease(WireModel):
    """The lease part of a leased batch."""

    batch_id: str = Field(description="Lease id: ack or nack with it. Empty when no items.")
    expires_at: float = Field(description="Unix s after which the items return to the queue.")
    items: list[BatchItem] = Field(description="Leased groups, oldest first; may be empty.")
    dropped_stale: Count = Field(
        description="Groups found beyond the staleness bound during this pull (dropped, counted)."
    )
    current_version: Version | None = Field(description="Newest published version at lease time.")
    queue_depth: Count = Field(description="Groups still waiting after this lease.")


REASON_PATTERN = r"^[a-z][a-z0-9_]{0,63}$"
MAX_DETAIL = 1000


class GroupRejection(WireModel):
    """A leased group the trainer refused (in :class:`AckRequest`)."""

    submission_id: Count = Field(description="The group's submission id (its BatchItem's).")
    reason: str = Field(
        pattern=REASON_PATTERN,
        description="Stable code of what was wrong, e.g. 'bad_token_id', 'sampling_mismatch'.",
    )
    detail: str = Field(max_length=MAX_DETAIL, description="What was wrong, for a person.")


class LeasedBatch(WireModel):
    """A decoded lease answer: the lease plus its groups, in the order of ``lease.items``.

    A payload that does not decode (a coordinator older than this reader's checks let it in) is
    not raised: it is listed in ``refused``, to be named in the ack, and left out of ``groups``;
    ``submission_ids`` gives each decoded group's id."""

    lease: BatchLease = Field(description="Lease id, expiry and per-group metadata.")
    groups: list[TrajectoryGroup] = Field(description="Decoded groups, in the items' order.")
    submission_ids: list[int] = Field(
        default_factory=list,
        description="Submission id of each decoded group (same length as groups); empty in a "
        "batch built with every item decoded: then the items' ids.",
    )
    refused: list[GroupRejection] = Field(
        default_factory=list, description="Groups whose payload did not decode, and why."
    )

    @model_validator(mode="after")
    def _ids(self) -> LeasedBatch:
        if not self.submission_ids and len(self.groups) == len(self.lease.items):
            self.submission_ids = [i.submission_id for i in self.lease.items]
        if len(self.submission_ids) != len(self.groups):
            raise ValueError(
                f"{len(self.submission_ids)} submission ids for {len(self.groups)} groups"
            )
        return self


class AckRequest(WireModel):
    """``POST /v1/batches/{batch_id}/ack`` body (optional): the batch's refused groups."""

    rejected: list[GroupRejection] = Field(
        default_factory=list,
        max_length=1_000_000,
        description="Groups of this batch the trainer refused: they become dead letters and "
        "count against their workers. Each must belong to the batch (422 otherwise).",
    )


class AckResult(WireModel):
    batch_id: str = Field(description="The lease acknowledged (or returned).")
    acked: Count = Field(description="Groups removed from the queue for good (or returned: nack).")
    rejected: Count = Field(
        default=0, description="Of those, groups refused by the trainer (now dead letters)."
    )


class DeadLetterInfo(WireModel):
    """A group set aside: refused by the trainer, or leased twice without an ack."""

    submission_id: Count = Field(description="Queue sequence number.")
    worker_id: str = Field(description="Worker that submitted the group.")
    group_id: str = Field(description="The group's id (prompt).")
    version_min: Version = Field(description="Oldest policy version in the group.")
    version_max: Version = Field(description="Newest policy version in the group.")
    submitted_at: float = Field(description="Acceptance time (Unix s).")
    dead_at: float = Field(description="When it was set aside (Unix s).")
    deliveries: Count = Field(description="Leases that held it.")
    reason: str = Field(description="Why: the trainer's reason code, or 'undelivered'.")
    detail: str = Field(description="What was wrong, for a person.")


class DeadLetterList(WireModel):
    """``GET /v1/dead-letters``: the newest dead letters."""

    count: Count = Field(description="Dead letters kept (all of them, not only those listed).")
    items: list[DeadLetterInfo] = Field(description="The newest ones, newest first.")


class LeaseExtension(WireModel):
    """Answer to ``POST /v1/batches/{batch_id}/extend`` (trainer role)."""

    batch_id: str = Field(description="The lease extended.")
    expires_at: float = Field(description="New expiry (Unix s): now + lease_s.")


class AdmissionRequest(WireModel):
    """``POST /v1/admission`` body (worker role): may I start ``want`` more groups?"""

    worker_id: str = Field(
        pattern=ID_PATTERN, description="The asking worker (registered: 404 unknown_worker if not)."
    )
    want: int = Field(ge=0, le=1_000_000, description="Groups the worker would like to start.")
    applied_version: Version | None = Field(
        default=None,
        description="Version it would generate with (409 future_version if newer than the "
        "latest recorded, like a heartbeat); None: not loaded yet.",
    )


class AdmissionResponse(WireModel):
    """How much work is worth starting now.

    ``grant`` = min(want, max(0, room, fair_share - own_in_flight)) with
    ``room = target_queue_groups - queued - in_flight_everywhere`` and
    ``fair_share = (target_queue_groups - queued) // active_workers``: a worker may always fill
    its fair share of the budget, whatever the others report in flight (one worker's claim cannot
    starve the rest). 0 when the worker's weights are already so old that what it generates
    would likely be refused (``latest - applied_version >= max(1, max_staleness)``: at the
    bound, the next version drops it): it must catch up first. A worker at the latest version
    is admitted under any bound, ``max_staleness = 0`` (on-policy) included.
    """

    grant: int = Field(ge=0, le=1_000_000, description="Groups the worker may start now (<= want).")
    reason: str = Field(
        description="'ok', 'queue_full', 'update_weights', 'no_version' or 'suspect' (the "
        "worker is flagged and refuse_suspect_workers is on)."
    )
    current_version: Version | None = Field(description="Newest version; None: none recorded yet.")
    queue_depth: Count = Field(description="Groups waiting to be leased.")
    in_flight: int = Field(
        ge=0, description="Groups in flight across all active workers (sum of their heartbeats)."
    )
    target_queue_groups: int = Field(ge=1, description="Configured queue + in-flight budget.")


def encode_leased_batch(lease: BatchLease, payloads: list[bytes]) -> bytes:
    """Serialize a lease answer: msgpack ``{"format", "lease": {...}, "payloads": [bin, ...]}``.

    Payloads are the submitted ``deltarl-traj-v1`` bytes, unchanged.
    """
    if len(payloads) != len(lease.items):
        raise ValueError(f"{len(payloads)} payloads for {len(lease.items)} items")
    body: dict[str, Any] = {
        "format": BATCH_FORMAT,
        "lease": lease.model_dump(mode="json"),
        "payloads": payloads,
    }
    return msgpack.packb(body, use_bin_type=True)


def decode_leased_batch(data: bytes) -> LeasedBatch:
    """Parse a lease answer; every group is validated like a submission."""
    try:
        body = msgpack.unpackb(data, raw=False, max_bin_len=1 << 31)
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise ValueError(f"batch is not valid msgpack: {exc}") from exc
    if not isinstance(body, dict) or body.get("format") != BATCH_FORMAT:
        raise ValueError(f"batch format must be {BATCH_FORMAT!r}")
    lease = BatchLease.model_validate(body.get("lease"))
    payloads = body.get("payloads")
    if not isinstance(payloads, list) or len(payloads) != len(lease.items):
        raise ValueError("batch payloads do not match its items")
    groups, ids, refused = [], [], []
    for item, payload in zip(lease.items, payloads, strict=True):
        try:
            groups.append(decode_group(payload))
            ids.append(item.submission_id)
        except ValueError as exc:
            refused.append(
                GroupRejection(
                    submission_id=item.submission_id,
                    reason="bad_payload",
                    detail=str(exc)[:MAX_DETAIL],
                )
            )
    return LeasedBatch(lease=lease, groups=groups, submission_ids=ids, refused=refused)
