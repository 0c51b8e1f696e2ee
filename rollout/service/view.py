"""What the worker's HTTP and metrics layers read of a running worker: a small read-only view.

:class:`~deltarl.rollout.service.worker.RolloutWorker` satisfies :class:`WorkerView`; ``http.py`` and
``metrics.py`` depend on this protocol, never on the worker class (no import cycle).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from deltarl.rollout.engines.base import Engine
from deltarl.rollout.sync.follower import VersionFollower
from deltarl.rollout.sync.weights import WeightSync

if TYPE_CHECKING:
    from deltarl.rollout.distill.hints import HintStats
    from deltarl.rollout.distill.teaching import TeacherStats


@dataclass(slots=True)
class WorkerStats:
    """Counters of one worker process (for logs and tests)."""

    started: int = 0  # groups started
    submitted: int = 0  # groups accepted as new by the coordinator
    duplicates: int = 0  # submissions the coordinator had already accepted
    dropped_failed: int = 0  # groups sampled by weights that failed verification
    dropped_refused: int = 0  # groups the coordinator refused (stale, invalid)
    dropped_timeout: int = 0  # groups not submitted within submit_timeout_s / shutdown
    group_errors: int = 0  # groups that failed while playing (engine, env)
    abandoned: int = 0  # groups cancelled unfinished at the shutdown deadline
    proofs_ok: int = 0  # weight challenges answered and accepted
    proofs_failed: int = 0  # weight challenges answered and refused (wrong or late)


class MetricsText(Protocol):
    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        ...


class WorkerView(Protocol):
    """The state of a worker that ``/health`` and ``/metrics`` read (each read is a snapshot)."""

    worker_id: str
    model_name: str
    engine: Engine
    sync: WeightSync  # status() and timings
    follower: VersionFollower  # wanted, syncs, failures
    stats: WorkerStats

    @property
    def teacher_stats(self) -> TeacherStats: ...

    @property
    def hint_stats(self) -> HintStats: ...

    @property
    def metrics(self) -> MetricsText: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def last_error(self) -> str | None: ...

    @property
    def stopping(self) -> bool: ...
