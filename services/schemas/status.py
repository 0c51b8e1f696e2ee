"""``GET /v1/status``: one summary of where a run stands (also feeds the status page)."""

from __future__ import annotations

from pydantic import Field

from .common import WireModel
from .workers import WorkerInfo


class QueueStats(WireModel):
    depth: int = Field(description="Groups waiting to be leased.")
    leased: int = Field(description="Groups held by unexpired or not yet reclaimed leases.")
    submitted_total: int = Field(description="Groups ever accepted (duplicates not counted).")
    acked_total: int = Field(description="Groups acknowledged by the trainer.")
    duplicates_total: int = Field(description="Submissions ignored as idempotent retries.")
    dropped: dict[str, int] = Field(
        description="Groups dropped by reason: 'stale_at_submit' (refused), 'stale_at_pull'."
    )
    oldest_age_s: float | None = Field(description="Age of the oldest waiting group; None: empty.")


class VersionPoint(WireModel):
    """One version, for charts: delta bytes against full-model bytes over time."""

    version: int
    kind: str
    trainer_step: int | None = Field(description="Optimizer step; None if unknown.")
    bytes: int = Field(description="Bytes a replica downloads for this version.")
    full_bytes: int = Field(description="Bytes of a full checkpoint.")
    recorded_at: float


class RewardPoint(WireModel):
    """Mean reward of the groups accepted for one policy version (version_max of each group)."""

    version: int
    groups: int
    mean_reward: float


class StatusSummary(WireModel):
    now: float = Field(description="Coordinator wall clock (Unix s).")
    store: str
    trainer_step: int | None = Field(description="Step of the newest version; None: no version.")
    latest_version: int | None
    latest_anchor: int | None
    max_staleness: int
    queue: QueueStats
    workers_active: int
    workers_lost: int
    in_flight: int = Field(description="Groups being generated, summed over active workers.")
    workers: list[WorkerInfo] = Field(description="Up to the requested limit, laggiest first.")
    versions: list[VersionPoint] = Field(description="Most recent versions, oldest first.")
    rewards: list[RewardPoint] = Field(description="Reward curve by version, oldest first.")
    staleness_hist: dict[str, int] = Field(
        description="Accepted groups by staleness at submit (latest - version_min), as string keys."
    )
