"""The trainer's main loop: lease groups, train one step, publish the new version, acknowledge.

Order per optimizer step (``v`` is the version of the weights being trained):

1. **pull** (:func:`pull_groups`): lease groups from the coordinator until ``groups_per_step``
   groups within ``max_staleness`` of ``v`` are held; staler ones are dropped and counted (the
   coordinator drops at lease time too, but ``v`` moves on meanwhile);
2. **train**: :func:`~.step.train_step` on the collated groups;
3. **publish**: :meth:`WeightPublisher.publish` snapshots the weights as version ``v + 1``
   (after waiting for version ``v`` to be committed and registered) and uploads in the
   background while the next step pulls and computes;
4. **ack** every lease of the step: its groups are gone for good. A crash before the ack
   returns them to the queue when the lease expires, so no rollout is lost (a group may then be
   trained on twice, never zero times).

The first version (the starting weights, with an anchor) is published and waited for before
the first pull, so workers have weights to generate with.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from deltarl.services.schemas import LeasedBatch, TrajectoryGroup

from .batch import collate, filter_stale
from .metrics import MetricsSink
from .optim import build_optimizer
from .publisher import PublishFailedError, WeightPublisher, publishable_state
from .settings import BatchSettings, ExperimentSettings
from .step import train_step

logger = logging.getLogger(__name__)

__all__ = ["BatchSource", "Pulled", "pull_groups", "train"]


class BatchSource(Protocol):
    """Where groups come from: :class:`~deltarl.services.coordinator.client.CoordinatorClient`
    implements it; tests use an in-memory queue."""

    def lease(
        self, max_groups: int, lease_s: float | None = None, wait_s: float = 0.0
    ) -> LeasedBatch: ...

    def ack(self, batch_id: str) -> Any: ...

    def nack(self, batch_id: str) -> Any: ...


@dataclass(slots=True)
class Pulled:
    """The groups of one step and the leases that hold them."""

    groups: list[TrajectoryGroup] = field(default_factory=list)
    batch_ids: list[str] = field(default_factory=list)
    dropped_by_coordinator: int = 0  # groups beyond the staleness bound at lease time
    dropped_by_trainer: int = 0  # groups that became too stale after the lease
    wait_s: float = 0.0


def pull_groups(
    source: BatchSource,
    policy_version: int,
    settings: BatchSettings,
    want: int,
    *,
    poll_s: float = 1.0,
    timeout_s: float | None = None,
    stop: threading.Event | None = None,
) -> Pulled:
    """Lease until ``want`` fresh groups are held (see the module docstring).

    Waits ``poll_s`` per lease request (long polling). With ``timeout_s``, or when ``stop`` is
    set, gives up: the leases taken so far are nacked (their groups return to the queue at once)
    and ``TimeoutError`` is raised. Logs a warning every 30 s of waiting (a silent hang is the
    worst failure of an asynchronous trainer).
    """
    out = Pulled()
    t0 = last_warn = time.perf_counter()
    while len(out.groups) < want:
        now = time.perf_counter()
        if (stop is not None and stop.is_set()) or (timeout_s is not None and now - t0 > timeout_s):
            for bid in out.batch_ids:
                source.nack(bid)
            why = "stop requested" if stop is not None and stop.is_set() else "timed out"
            raise TimeoutError(
                f"{why} after {now - t0:.1f} s with {len(out.groups)}/{want} groups for version "
                f"{policy_version}; the leases were returned to the queue"
            )
        if now - last_warn > 30:
            logger.warning(
                "waiting %.0f s for data: %d/%d groups for version %d (are workers running?)",
                now - t0,
                len(out.groups),
                want,
                policy_version,
            )
            last_warn = now
        leased = source.lease(want - len(out.groups), settings.lease_s, poll_s)
        out.dropped_by_coordinator += leased.lease.dropped_stale
        if not leased.lease.items:
            continue
        out.batch_ids.append(leased.lease.batch_id)
        kept = filter_stale(leased.groups, policy_version, settings.max_staleness)
        out.groups.extend(kept.kept)
        out.dropped_by_trainer += kept.dropped_groups
    out.wait_s = time.perf_counter() - t0
    return out


def train(
    model: torch.nn.Module,
    settings: ExperimentSettings,
    source: BatchSource,
    publisher: WeightPublisher,
    *,
    sink: MetricsSink | None = None,
    ref_model: torch.nn.Module | None = None,
    data_timeout_s: float | None = None,
    poll_s: float = 1.0,
    stop: threading.Event | None = None,
    max_publish_failures: int = 3,
) -> int:
    """Run ``settings.max_steps`` optimizer steps; return the last published version.

    ``model`` holds the fp32 master weights (on its device); ``publisher`` registers each
    version with the coordinator when it was built with ``register=``. ``sink`` receives each
    step's metrics (see :class:`~.metrics.MetricsLog`); the ``publish/*`` metrics of step ``k``
    describe the version published after step ``k - 1`` (``publish/version``), the newest one
    committed when step ``k`` ends. A failed publication (raised by the next ``publish``) is
    logged and answered with an anchor-only version of the current weights (``publish/failed``
    is 1 for that step); more than ``max_publish_failures`` failures in a row stop training with
    :class:`~.publisher.PublishFailedError`. Closes the publisher at the end, so the last
    version is committed (or its failure raised) when this returns.
    """
    opt, sched = build_optimizer(model.parameters(), settings.optimizer, settings.max_steps)
    failures = 0  # consecutive failed publications
    version = publisher.publish(publishable_state(model), step=0, anchor=True)
    publisher.wait()
    logger.info("published the starting weights as version %d", version)
    try:
        for step in range(1, settings.max_steps + 1):
            pulled = pull_groups(
                source,
                version,
                settings.batch,
                settings.batch.groups_per_step,
                poll_s=poll_s,
                timeout_s=data_timeout_s,
                stop=stop,
            )
            batch = collate(
                pulled.groups,
                version,
                scale=settings.loss.advantage_scale,
                eps=settings.loss.advantage_eps,
            )
            metrics = train_step(model, opt, sched, batch, settings, ref_model=ref_model)
            waited = publisher.waited_s
            failed = False
            try:
                version = publisher.publish(publishable_state(model), step=step)
                failures = 0
            except PublishFailedError:
                failures += 1
                if failures > max_publish_failures:
                    raise
                logger.exception("publication failed; re-anchoring with the current weights")
                failed = True
                version = publisher.publish(publishable_state(model), step=step, anchor=True)
            ack_failures = 0
            for bid in pulled.batch_ids:
                try:
                    source.ack(bid)
                except Exception as err:  # an expired lease: its groups went back to the queue
                    ack_failures += 1
                    logger.warning("ack of batch %s failed: %s", bid, err)
            report = publisher.last_report  # the previous version's, committed by now
            if report is not None:
                metrics.update(report.metrics())
            metrics.update(
                {
                    "version": float(version),
                    "time/data_wait_s": pulled.wait_s,
                    "time/publish_wait_s": publisher.waited_s - waited,
                    "batch/dropped_stale_coordinator": float(pulled.dropped_by_coordinator),
                    "batch/dropped_stale_trainer": float(pulled.dropped_by_trainer),
                    "batch/ack_failures": float(ack_failures),
                    "publish/failed": float(failed),
                }
            )
            if sink is not None:
                sink(step, metrics)
    finally:
        publisher.close()
    return version
