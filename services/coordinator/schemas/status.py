"""``GET /v1/status``: one summary of where a run stands (also feeds the status page)."""

from __future__ import annotations

from pydantic import Field

from deltarl.services.coordinator.schemas.common import Count, Version, WireModel
from deltarl.services.coordinator.schemas.versions import ChallengePoolStatus
from deltarl.services.coordinator.schemas.workers import WorkerInfo


class QueueStats(WireModel):
    depth: Count = Field(description="Groups waiting to be leased.")
    leased: Count = Field(description="Groups held by unexpired or not yet reclaimed leases.")
    submitted_total: Count = Field(description="Groups ever accepted (duplicates not counted).")
    acked_total: Count = Field(description="Groups acknowledged by the trainer.")
    duplicates_total: Count = Field(description="Submissions ignored as idempotent retries.")
    dropped: dict[str, Count] = Field(
        description="Groups dropped by reason: 'stale_at_submit' (refused), 'stale_at_pull'."
    )
    oldest_age_s: float | None = Field(description="Age of the oldest waiting group; None: empty.")
    dead_letters: Count = Field(
        default=0,
        description="Groups set aside (refused by the trainer, or leased twice without an ack); "
        "listed by GET /v1/dead-letters.",
    )
    rejected: dict[str, Count] = Field(
        default_factory=dict, description="Groups the trainer refused, by reason code."
    )


class VersionPoint(WireModel):
    """One version, for charts: delta bytes against full-model bytes over time."""

    version: Version = Field(description="Policy version.")
    kind: str = Field(description="'anchor' or 'delta'.")
    trainer_step: Count | None = Field(description="Optimizer step; None if unknown.")
    bytes: Count = Field(description="Bytes a replica downloads for this version.")
    full_bytes: Count = Field(description="Bytes of a full checkpoint.")
    recorded_at: float = Field(description="When the coordinator recorded it (Unix s).")


class RewardPoint(WireModel):
    """Mean reward of the groups accepted for one policy version (version_max of each group)."""

    version: Version = Field(description="Policy version (the groups' version_max).")
    groups: Count = Field(description="Accepted groups generated with it.")
    mean_reward: float = Field(description="Mean over those groups of their mean reward.")


class StatusSummary(WireModel):
    now: float = Field(description="Coordinator wall clock (Unix s).")
    store: str = Field(description="Store backend: 'sqlite' or 'redis'.")
    trainer_step: Count | None = Field(description="Step of the newest version; None: no version.")
    latest_version: Version | None = Field(description="Newest version; None: none recorded yet.")
    latest_anchor: Version | None = Field(description="Newest version with an anchor; None: none.")
    max_staleness: Count = Field(description="Configured staleness bound (versions).")
    queue: QueueStats = Field(description="Trajectory queue counters.")
    workers_active: Count = Field(description="Workers heard from within lost_after_s.")
    workers_lost: Count = Field(description="Registered workers silent for longer.")
    in_flight: int = Field(ge=0, description="Groups being generated, summed over active workers.")
    workers_suspect: Count = Field(
        default=0, description="Registered workers flagged suspect (see WorkerInfo.suspect)."
    )
    workers: list[WorkerInfo] = Field(description="Up to the requested limit, laggiest first.")
    versions: list[VersionPoint] = Field(description="Most recent versions, oldest first.")
    rewards: list[RewardPoint] = Field(description="Reward curve by version, oldest first.")
    staleness_hist: dict[str, Count] = Field(
        description="Accepted groups by staleness at submit (latest - version_min), as string keys."
    )
    challenges: ChallengePoolStatus | None = Field(
        default=None,
        description="The newest version's weight challenges (pool left, workers waiting); None "
        "before the first version.",
    )
    workers_waiting_for_challenge: Count = Field(
        default=0,
        description="Active workers, each at the version it serves, unproven there, that asked "
        "for a weight challenge the pool could not give (starvation: the trainer must top up).",
    )
