"""Records and errors of the weight sync (torch-free): timings, reports, status, verdicts.

See :mod:`deltarl.rollout.sync.weights` for the protocol they describe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Verdict = Literal["verified", "pending", "failed"]


class WeightsUnhealthyError(RuntimeError):
    """The engine's weights are missing or failed verification: generation must not run."""


class SyncError(RuntimeError):
    """A sync could not reach its target; :attr:`WeightSync.healthy` says if the weights are
    still usable (at :attr:`WeightSync.version`)."""


@dataclass(slots=True)
class StepTiming:
    """One applied object. Times in seconds; ``None`` where not applicable.

    ``wait_s``: waiting for the in-flight forward step before the pause; ``pause_s``: how long
    generation was paused (the apply, plus verification with ``verify_before_resume`` and for
    anchors); ``publish_to_*``: from the manifest's ``created_at`` (publisher's clock) to the
    weights being applied / verified here. ``chained``: a chained delta (decoded against the
    context of the delta applied before it). ``apply``: how a delta was written in the pause,
    ``"kernel"`` (one store launch per bit width) or ``"index_copy"`` (one per changed tensor);
    empty for anchors.
    """

    version: int
    base_version: int | None
    kind: Literal["anchor", "delta"]
    format: str
    bytes: int
    changed: int | None
    download_s: float
    decode_s: float
    stage_s: float
    wait_s: float
    pause_s: float
    verify_s: float
    mirror_s: float
    publish_to_applied_s: float | None
    publish_to_verified_s: float | None
    chained: bool = False
    apply: str = ""


@dataclass(slots=True)
class SyncReport:
    """What one :meth:`WeightSync.sync_to` call did."""

    start_version: int | None  # verified version before the call (None: no weights)
    target: int
    version: int | None = None  # verified version after the call
    steps: list[StepTiming] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # objects that failed, and why
    planned_bytes: int = 0  # sum of the plans' total_bytes (one plan per attempt)
    downloaded_bytes: int = 0  # object bytes actually fetched from the bucket

    @property
    def fell_back(self) -> bool:
        """True if some object failed and the sync went around it (another plan)."""
        return bool(self.failures)


@dataclass(frozen=True, slots=True)
class SyncStatus:
    """A snapshot for heartbeats and status pages."""

    version: int | None  # version generation runs with (applied; maybe pending verification)
    verified_version: int | None  # newest verified version (None: none yet)
    healthy: bool
    reason: str  # "ok", or why generation is refused
    seq: int  # weight states installed so far (see WeightsStamp)
