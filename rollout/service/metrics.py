"""Prometheus metrics of one rollout worker process (``GET /metrics``; its own registry).

Three sources, so that the hot paths only pay for what they alone know:

* **events** observed where they happen: episodes and generate calls
  (:class:`~deltarl.rollout.episodes.runner.EpisodeRunner` calls :meth:`RolloutMetrics.generated` and
  :meth:`RolloutMetrics.episode_finished`), refused and accepted submissions and the initial
  sync (:class:`~deltarl.rollout.service.worker.RolloutWorker`);
* **state** read at scrape time: the worker's :class:`~deltarl.rollout.service.worker.WorkerStats`
  (groups), the weight sync's status (versions, health) and the version follower's sync counts;
* **weight updates**: each :class:`~deltarl.rollout.sync.records.StepTiming` that
  ``WeightSync.timings`` gained since the previous scrape is observed at scrape time (the deque
  keeps the latest 1,000: more updates than that between two scrapes are counted short).

Every metric name and its meaning: docs/rollout.md, "HTTP endpoints". Importing this module
pulls in neither torch nor transformers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from deltarl.rollout.engines.base import Completion
from deltarl.rollout.sync.records import StepTiming

if TYPE_CHECKING:
    from deltarl.rollout.episodes.runner import Episode
    from deltarl.rollout.service.view import WorkerView

__all__ = ["RolloutMetrics"]

P = "deltarl_rollout_"

SECONDS_FAST = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)
SECONDS_SLOW = (1e-3, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)
PHASES = ("download", "decode", "stage", "wait", "verify", "mirror")


class _StateCollector(Collector):
    """Gauges and counters read from the worker at scrape time."""

    def __init__(self, worker: WorkerView, metrics: RolloutMetrics) -> None:
        self._worker = worker
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        w, g, c = self._worker, GaugeMetricFamily, CounterMetricFamily
        status = w.sync.status()
        yield g(
            P + "weights_healthy",
            "1 while generation may run, 0 while refused",
            value=int(status.healthy),
        )
        yield g(
            P + "weights_version",
            "Version the engine generates with (-1: none)",
            value=_or_minus_one(status.version),
        )
        yield g(
            P + "weights_verified_version",
            "Newest verified version held by the engine (-1: none)",
            value=_or_minus_one(status.verified_version),
        )
        yield g(
            P + "weights_target_version",
            "Newest version this worker heard of, its sync target (-1: none)",
            value=_or_minus_one(w.follower.wanted),
        )
        yield g(P + "in_flight_groups", "Groups being played", value=w.in_flight)
        s = w.stats
        yield c(P + "groups_started", "Groups started (admitted)", value=s.started)
        yield c(
            P + "groups_submitted", "Groups accepted as new by the coordinator", value=s.submitted
        )
        yield c(
            P + "groups_duplicate",
            "Submissions the coordinator had already accepted (retries after a lost answer)",
            value=s.duplicates,
        )
        dropped = c(P + "groups_dropped", "Groups lost, by reason", labels=["reason"])
        for reason, n in (
            ("verification_failed", s.dropped_failed),
            ("rejected", s.dropped_refused),
            ("timeout", s.dropped_timeout),
            ("error", s.group_errors),
            ("abandoned", s.abandoned),
        ):
            dropped.add_metric([reason], n)
        yield dropped
        proofs = c(
            P + "weight_proofs",
            "Weight challenges answered (docs/security.md), by the coordinator's verdict",
            labels=["result"],
        )
        proofs.add_metric(["verified"], s.proofs_ok)
        proofs.add_metric(["refused"], s.proofs_failed)
        yield proofs
        t = w.teacher_stats
        teacher = c(
            P + "teacher_requests",
            "Teacher requests (per group: on-policy distillation, hinted turns with "
            "hint_scorer=teacher), by result: ok, failed (after the client's retries), refused "
            "(4xx: the group is dropped; hinted turns: the hints are skipped)",
            labels=["result"],
        )
        teacher.add_metric(["ok"], t.requests_ok)
        teacher.add_metric(["failed"], t.requests_failed)
        teacher.add_metric(["refused"], t.refused)
        yield teacher
        yield g(P + "teacher_waiting_groups", "Groups waiting for teacher data", value=t.waiting)
        h = w.hint_stats
        hints = c(
            P + "hints",
            "Failed episodes given to the hinter (hinted self-distillation), by outcome: "
            "hinted, none (nothing to say), malformed (skipped), failed (hinter or scoring)",
            labels=["result"],
        )
        for result in ("hinted", "none", "malformed", "failed"):
            hints.add_metric([result], getattr(h, result))
        yield hints
        yield c(
            P + "teacher_missing_groups",
            "Groups submitted without teacher data (teacher.required = false)",
            value=t.missing,
        )
        m = self._metrics
        syncs = c(P + "weight_syncs", "Weight syncs (sync_to runs), by result", labels=["result"])
        syncs.add_metric(["ok"], m.initial_syncs_ok + w.follower.syncs)
        syncs.add_metric(["failed"], m.initial_syncs_failed + w.follower.failures)
        yield syncs


class RolloutMetrics:
    """The metrics of one worker; see the module docstring for where each value comes from.

    Built by :class:`~deltarl.rollout.service.worker.RolloutWorker` (or given to it), which calls
    :meth:`watch` with itself; :meth:`render` is the body of ``GET /metrics``.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.initial_syncs_ok = 0
        self.initial_syncs_failed = 0
        self._worker: WorkerView | None = None
        self._last_timing: StepTiming | None = None
        # -- episodes and generation
        episodes = Counter(
            P + "episodes", "Episodes played to their end, by outcome", ["outcome"], registry=r
        )
        self._episodes = {o: episodes.labels(o) for o in ("done", "max_turns", "max_tokens")}
        self._reward = Histogram(
            P + "episode_reward",
            "Final reward of each episode played to its end",
            buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0),
            registry=r,
        )
        self._tokens = Counter(P + "tokens_generated", "Tokens sampled by the engine", registry=r)
        self._generate_s = Histogram(
            P + "generate_seconds",
            "Wall time of one batched generate call",
            buckets=SECONDS_SLOW,
            registry=r,
        )
        # -- submissions
        self._rejected = Counter(
            P + "groups_rejected",
            "Groups the coordinator refused, by its error code (also in groups_dropped)",
            ["code"],
            registry=r,
        )
        self._staleness = Histogram(
            P + "submitted_staleness_versions",
            "Newest published version at acceptance minus the group's oldest policy version",
            buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
            registry=r,
        )
        # -- weight updates (from WeightSync.timings)
        self._updates = Counter(
            P + "weight_updates",
            "Objects applied and verified, by kind",
            ["kind"],
            registry=r,
        )
        self._chained = Counter(
            P + "weight_chained_deltas",
            "Deltas applied that were chained on the previous delta (also in weight_updates)",
            registry=r,
        )
        self._update_bytes = Counter(
            P + "weight_update_bytes", "Bytes of the objects applied, by kind", ["kind"], registry=r
        )
        self._pause_s = Histogram(
            P + "weight_pause_seconds",
            "Generation paused for one apply (anchors: load and verify)",
            ["kind"],
            buckets=SECONDS_FAST,
            registry=r,
        )
        self._phase_s = Histogram(
            P + "weight_phase_seconds",
            "Time of each phase of one weight update, outside the pause",
            ["kind", "phase"],
            buckets=SECONDS_SLOW,
            registry=r,
        )
        self._published_s = Histogram(
            P + "weight_publish_to_applied_seconds",
            "From the manifest's created_at (publisher's clock) to the apply here",
            ["kind"],
            buckets=SECONDS_SLOW,
            registry=r,
        )
        self._info = Info(P + "worker", "This worker's id, engine and model", registry=r)

    def watch(self, worker: WorkerView) -> None:
        """Read ``worker``'s state at every scrape (once per metrics object)."""
        if self._worker is not None:
            raise RuntimeError("these metrics already watch a worker")
        self._worker = worker
        self.registry.register(_StateCollector(worker, self))
        self._info.info(
            {
                "worker_id": worker.worker_id,
                "engine": worker.engine.type,
                "model": worker.model_name,
            }
        )

    # ------------------------------------------------------------------ hooks

    def generated(self, completions: Sequence[Completion], seconds: float) -> None:
        """One batched generate call returned ``completions`` after ``seconds``."""
        self._tokens.inc(sum(len(c.token_ids) for c in completions))
        self._generate_s.observe(seconds)

    def episode_finished(self, episode: Episode) -> None:
        """An episode was played to its end (by the environment or a limit)."""
        self._episodes[episode.truncated or "done"].inc()
        self._reward.observe(episode.reward)

    def group_accepted(self, version_min: int | None, current_version: int | None) -> None:
        """The coordinator accepted a group (new, not a duplicate)."""
        if version_min is not None and current_version is not None:
            self._staleness.observe(max(0, current_version - version_min))

    def group_rejected(self, code: str) -> None:
        """The coordinator refused a group (``stale``, ``invalid_trajectory``, ...)."""
        self._rejected.labels(code).inc()

    def initial_sync(self, ok: bool) -> None:
        """The worker's first sync (before the version follower starts) ended."""
        if ok:
            self.initial_syncs_ok += 1
        else:
            self.initial_syncs_failed += 1

    # ------------------------------------------------------------------ scrape

    def render(self) -> bytes:
        """Prometheus text of every metric (observes the weight updates since the last call)."""
        self._observe_updates()
        return generate_latest(self.registry)

    def _observe_updates(self) -> None:
        if self._worker is None:
            return
        timings = tuple(self._worker.sync.timings)  # one C-level copy, appended by another thread
        start = 0
        if self._last_timing is not None:
            for i in range(len(timings) - 1, -1, -1):
                if timings[i] is self._last_timing:
                    start = i + 1
                    break
        for t in timings[start:]:
            self._updates.labels(t.kind).inc()
            self._update_bytes.labels(t.kind).inc(t.bytes)
            if t.chained:
                self._chained.inc()
            self._pause_s.labels(t.kind).observe(t.pause_s)
            for phase in PHASES:
                self._phase_s.labels(t.kind, phase).observe(getattr(t, f"{phase}_s"))
            if t.publish_to_applied_s is not None:
                self._published_s.labels(t.kind).observe(max(0.0, t.publish_to_applied_s))
        if timings:
            self._last_timing = timings[-1]


def _or_minus_one(value: int | None) -> int:
    return -1 if value is None else value
