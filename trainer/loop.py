"""The trainer's main loop: lease groups, train one step, publish the new version, acknowledge.

Order per optimizer step (``v`` is the version of the weights being trained):

1. **pull** (:func:`pull_groups`): lease groups from the coordinator until ``groups_per_step``
   groups within ``max_staleness`` of ``v`` are held; staler ones are dropped and counted (the
   coordinator drops at lease time too, but ``v`` moves on meanwhile); from the moment a lease
   is taken until its ack, a :class:`~.leases.LeaseKeeper` extends it every ``lease_s / 3``, so
   a step slower than the lease never loses its groups to the queue;
2. **train**: the groups the trainer can use (:mod:`.screen`: within the model's limits,
   collatable) are collated and :func:`~deltarl.trainer.learn.step.train_step` trains on them (under ``torchrun``:
   the batch goes to every rank first, each trains its share with DDP; see
   :mod:`deltarl.trainer.learn.distributed`), dropping any group whose on-policy logprobs do not match these weights;
3. **publish**: :meth:`WeightPublisher.publish` snapshots the weights as version ``v + 1``
   (after waiting for version ``v`` to be committed and registered) and uploads in the
   background while the next step pulls and computes;
4. **ack** every lease of the step, naming the groups refused at step 2 (they become the
   coordinator's dead letters and count against their workers): its groups are gone for good.
   A crash before the ack returns them to the queue when the lease expires, so no rollout is
   lost (a group may then be trained on twice, never zero times); a group delivered twice
   without an ack is set aside by the coordinator, so no group can stop the trainer in a loop.

The first version (the starting weights, with an anchor) is published and waited for before
the first pull, so workers have weights to generate with.

Durability (see :mod:`deltarl.trainer.checkpoint.store`): with a :class:`~deltarl.trainer.checkpoint.store.Checkpointer`, a checkpoint is
committed after every ``checkpoint.every``-th step (after that step's publish and ack), at the
end, on a stop request (:class:`GracefulStop`: SIGINT/SIGTERM let the current step finish, then
checkpoint and return) and when data time out. ``resume=`` restores a checkpoint and publishes
its weights as an *anchor-only* version numbered after both the checkpoint's version and the
bucket's newest one, so versions only increase and no worker ever applies a delta against
weights the trainer no longer has. A crash between steps loses at most the steps since the last
checkpoint; the published chain stays valid (every published version is complete and
self-consistent; the versions published after the checkpoint simply become a branch nobody
extends).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Protocol

import httpx
import torch

from deltarl.services.coordinator.client import CoordinatorError
from deltarl.services.coordinator.schemas import LeasedBatch, ModelLimits, TrajectoryGroup
from deltarl.trainer.checkpoint.sharded import ShardedCheckpoint
from deltarl.trainer.checkpoint.store import Checkpoint, Checkpointer
from deltarl.trainer.learn.batch import TrainBatch, collate
from deltarl.trainer.learn.distributed import DistContext, broadcast, wrap_ddp
from deltarl.trainer.learn.optim import build_optimizer
from deltarl.trainer.learn.step import (
    MISMATCH_HINT,
    SamplingMismatchError,
    check_reference,
    train_step,
)
from deltarl.trainer.leases import LeaseKeeper
from deltarl.trainer.metrics import MetricsSink
from deltarl.trainer.publish.weights import PublishFailedError, VersionBook
from deltarl.trainer.screen import LeasedGroup, Refusals, collate_checked, model_limits, screen
from deltarl.trainer.settings import BatchSettings, ExperimentSettings
from deltarl.weightsync.reader import BucketReader

logger = logging.getLogger(__name__)

__all__ = [
    "BatchSource",
    "GracefulStop",
    "Pulled",
    "prepare_batch",
    "pull_groups",
    "train",
    "transient_error",
]


class BatchSource(Protocol):
    """Where groups come from: :class:`~deltarl.services.coordinator.client.CoordinatorClient`
    implements it; tests use an in-memory queue."""

    def lease(
        self, max_groups: int, lease_s: float | None = None, wait_s: float = 0.0
    ) -> LeasedBatch: ...

    def ack(self, batch_id: str) -> Any: ...

    def nack(self, batch_id: str) -> Any: ...

    # also ``ack(batch_id, rejected)`` when the trainer refused some of a batch's groups (see
    # :mod:`.screen`); a source without it fails that ack and the lease expires instead

    # optional: ``extend(batch_id, lease_s)`` keeps a lease alive (see :mod:`.leases`)


@dataclass(slots=True)
class Pulled:
    """The groups of one step and the leases that hold them."""

    entries: list[LeasedGroup] = field(default_factory=list)
    batch_ids: list[str] = field(default_factory=list)
    sizes: dict[str, int] = field(default_factory=dict)  # groups per lease
    refusals: Refusals = field(default_factory=Refusals)  # payloads that did not decode
    dropped_by_coordinator: int = 0  # groups beyond the staleness bound at lease time
    dropped_by_trainer: int = 0  # groups that became too stale after the lease
    lease_errors: int = 0  # lease requests that failed transiently (retried)
    wait_s: float = 0.0

    @property
    def groups(self) -> list[TrajectoryGroup]:
        return [e.group for e in self.entries]


def pull_groups(
    source: BatchSource,
    policy_version: int,
    settings: BatchSettings,
    want: int,
    *,
    poll_s: float = 1.0,
    timeout_s: float | None = None,
    stop: threading.Event | None = None,
    keeper: LeaseKeeper | None = None,
) -> Pulled:
    """Lease until ``want`` fresh groups are held (see the module docstring).

    ``keeper``: each lease taken is handed to it (:meth:`LeaseKeeper.hold`), so it stays alive
    while the rest of the step's groups arrive and while the step runs.

    A lease holding a group that is back after an expiry (``BatchItem.deliveries > 1``: the
    coordinator leases such a group alone) ends the pull: it is the step's only group, or, if
    groups are already held, it is given back for the next step. So a group a trainer died on is
    retried alone, and dying on it again implicates no other group (see :mod:`.screen`).

    Waits ``poll_s`` per lease request (long polling). With ``timeout_s``, or when ``stop`` is
    set, gives up: the leases taken so far are nacked (their groups return to the queue at once)
    and ``TimeoutError`` is raised. Logs a warning every 30 s of waiting (a silent hang is the
    worst failure of an asynchronous trainer).

    A coordinator that is restarting or unreachable (a transport error, or a 5xx answer: see
    :func:`transient_error`) is waited for: the lease request is retried with a backoff from 0.1
    to 5 s, under the same ``timeout_s`` and ``stop``; the leases already held are kept (and
    extended once it answers again: its store is durable). A lease whose answer was lost in the
    outage is never acked, so its groups return to the queue when it expires. Any other error is
    raised.
    """
    out = Pulled()
    t0 = last_warn = time.perf_counter()
    failing = 0  # consecutive failed lease requests
    while len(out.entries) < want:
        now = time.perf_counter()
        if (stop is not None and stop.is_set()) or (timeout_s is not None and now - t0 > timeout_s):
            for bid in out.batch_ids:
                if keeper is not None:
                    keeper.release(bid)
                _nack(source, bid)
            why = "stop requested" if stop is not None and stop.is_set() else "timed out"
            raise TimeoutError(
                f"{why} after {now - t0:.1f} s with {len(out.entries)}/{want} groups for version "
                f"{policy_version}; the leases were returned to the queue"
            )
        if now - last_warn > 30:
            logger.warning(
                "waiting %.0f s for data: %d/%d groups for version %d (are workers running?)",
                now - t0,
                len(out.entries),
                want,
                policy_version,
            )
            last_warn = now
        try:
            leased = source.lease(want - len(out.entries), settings.lease_s, poll_s)
        except Exception as err:
            if not transient_error(err):
                raise
            out.lease_errors += 1
            failing += 1
            if failing == 1 or now - last_warn > 30:
                logger.warning("the coordinator did not answer a lease (%s); retrying", err)
                last_warn = now
            delay = min(0.1 * 2 ** (failing - 1), 5.0)  # 0.1, 0.2, 0.4, ... 5 s
            if stop is not None:
                stop.wait(delay)
            else:
                time.sleep(delay)
            continue
        if failing:
            logger.warning("the coordinator answers again after %d failed lease requests", failing)
            failing = 0
        out.dropped_by_coordinator += leased.lease.dropped_stale
        if not leased.lease.items:
            continue
        batch_id = leased.lease.batch_id
        if any(i.deliveries > 1 for i in leased.lease.items) and out.batch_ids:
            # a group back after an expiry (an earlier trainer may have died on it) is trained
            # in a step of its own, so that dying on it again implicates no other group: give
            # it back (a nack is not a delivery) for the next step to start with
            _nack(source, batch_id)
            break
        out.batch_ids.append(batch_id)
        out.sizes[batch_id] = len(leased.lease.items)
        if keeper is not None:
            keeper.hold(batch_id)
        workers = {i.submission_id: i.worker_id for i in leased.lease.items}
        for r in leased.refused:
            out.refusals.add(batch_id, r.submission_id, r.reason, r.detail)
        for sid, group in zip(leased.submission_ids, leased.groups, strict=True):
            if settings.max_staleness is not None and (
                policy_version - group.version_min > settings.max_staleness
            ):
                out.dropped_by_trainer += 1  # acked with the rest: too stale to train on
                continue
            out.entries.append(LeasedGroup(batch_id, sid, workers.get(sid, group.worker_id), group))
        if any(i.deliveries > 1 for i in leased.lease.items):
            logger.warning(
                "group %s is back after its lease expired: training it alone",
                ", ".join(i.group_id for i in leased.lease.items),
            )
            break
    out.wait_s = time.perf_counter() - t0
    return out


def transient_error(err: BaseException) -> bool:
    """True for a coordinator that is unreachable or restarting (a transport error, a 5xx
    answer): worth retrying. 4xx answers and everything else are real errors."""
    if isinstance(err, httpx.TransportError):
        return True
    return isinstance(err, CoordinatorError) and err.status_code >= 500


def _nack(source: BatchSource, batch_id: str) -> None:
    """Return a lease; if the coordinator cannot take it back now, the lease expires instead
    (its groups return to the queue then: nothing is lost)."""
    try:
        source.nack(batch_id)
    except Exception as err:
        if not (transient_error(err) or isinstance(err, CoordinatorError)):
            raise
        logger.warning(
            "returning batch %s failed (%s): it returns when its lease expires", batch_id, err
        )


def prepare_batch(
    pulled: Pulled, version: int, settings: ExperimentSettings, limits: ModelLimits | None
) -> tuple[TrainBatch | None, list[LeasedGroup]]:
    """The step's batch from the pulled groups the trainer can use (:mod:`.screen`): within
    ``limits``, collatable; the others are added to ``pulled.refusals``. Returns the batch
    (None: no group left) and its groups in batch order."""

    def collate_groups(groups: Sequence[TrajectoryGroup]) -> TrainBatch:
        return collate(
            groups,
            version,
            scale=settings.loss.advantage_scale,
            eps=settings.loss.advantage_eps,
            credit=settings.loss.credit,
        )

    kept = screen(pulled.entries, limits, pulled.refusals)
    return collate_checked(kept, collate_groups, pulled.refusals)


def _ack_all(
    source: BatchSource, keeper: LeaseKeeper, pulled: Pulled, refusals: Refusals
) -> tuple[int, int]:
    """Ack every lease of a step, naming its refused groups; returns the failed acks (an
    expired lease: its groups went back to the queue, to be pulled again) and the groups the
    successful ones acknowledged."""
    failures = acked = 0
    for bid in pulled.batch_ids:
        keeper.release(bid)
        rejected = refusals.by_batch.get(bid, [])
        try:
            if rejected:
                source.ack(bid, rejected)  # type: ignore[call-arg]
            else:
                source.ack(bid)
        except Exception as err:
            failures += 1
            logger.warning("ack of batch %s failed: %s", bid, err)
        else:
            acked += pulled.sizes.get(bid, 0)
    return failures, acked


def _check_trainer_mismatch(
    kept: list[LeasedGroup],
    dropped: dict[int, float],
    version: int,
    source: BatchSource,
    keeper: LeaseKeeper,
    pulled: Pulled,
    ctx: DistContext,
) -> None:
    """Raise :class:`SamplingMismatchError` when every on-policy group of the step was refused
    for its mismatch and they came from at least two workers: then the trainer computes another
    distribution than the fleet samples (its temperature, model or tokenizer), not one worker
    misbehaving (which cannot speak for two with per-worker credentials). The leases are
    returned first (a nack: no group counts as delivered), so nothing is set aside."""
    onpolicy = {
        i for i, e in enumerate(kept) if any(t.version_min == version for t in e.group.trajectories)
    }
    workers = {kept[i].worker_id for i in dropped}
    if not dropped or set(dropped) != onpolicy or len(workers) < 2:
        return
    for bid in pulled.batch_ids:
        keeper.release(bid)
        _nack(source, bid)
    message = (
        f"every on-policy group of version {version} ({len(dropped)}, from {len(workers)} "
        f"workers) has logprobs that differ from the trainer's beyond "
        f"sampling.max_onpolicy_mismatch_kl: {MISMATCH_HINT}"
    )
    broadcast(("error", message), ctx)
    raise SamplingMismatchError(message)


class GracefulStop:
    """Turns SIGINT/SIGTERM into a stop request for :func:`train` (use in the main thread).

    The first signal sets :attr:`event` (the loop finishes its step, checkpoints and returns)
    and records :attr:`signum`; a second one raises ``KeyboardInterrupt`` at once. The previous
    handlers come back on exit::

        with GracefulStop() as stopper:
            train(..., stop=stopper.event, checkpointer=ckpt)
        if stopper.signum is not None:
            sys.exit(128 + stopper.signum)
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> None:
        self.event = threading.Event()
        self.signum: int | None = None
        self._signals = signals
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> GracefulStop:
        for sig in self._signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.event.is_set():
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping now")
        self.signum = signum
        self.event.set()
        logger.warning(
            "%s: finishing the current step, then checkpointing and stopping (send it again to "
            "stop at once)",
            signal.Signals(signum).name,
        )


def _changed_settings(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted names of the settings that differ between two ``model_dump(mode="json")``s."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in sorted(set(old) | set(new)):
            out += _changed_settings(old.get(key), new.get(key), f"{prefix}{key}.")
        return out
    return [] if old == new else [prefix.rstrip(".")]


def _resume_version(publisher: VersionBook, checkpoint: Checkpoint | ShardedCheckpoint) -> int:
    """The version of the resumed weights: after the checkpoint's and the bucket's newest."""
    meta = checkpoint.meta
    latest = BucketReader(publisher.bucket).latest()
    if latest is not None and latest.version == meta.version:
        if latest.state_digest != meta.state_digest:
            logger.warning(
                "the bucket's version %d has state digest %s, the checkpoint's weights %s: is "
                "this the run's bucket? (the anchor published now makes workers consistent)",
                latest.version,
                latest.state_digest,
                meta.state_digest,
            )
    elif meta.bucket_version is not None and (
        latest is None or latest.version < meta.bucket_version
    ):
        logger.warning(
            "the bucket's newest version (%s) is older than the %d seen when the checkpoint was "
            "written: is this the run's bucket?",
            None if latest is None else latest.version,
            meta.bucket_version,
        )
    return max(publisher.next_version(), meta.version + 1)


def train(
    model: torch.nn.Module,
    settings: ExperimentSettings,
    source: BatchSource,
    publisher: VersionBook,
    *,
    sink: MetricsSink | None = None,
    ref_model: torch.nn.Module | None = None,
    data_timeout_s: float | None = None,
    poll_s: float = 1.0,
    stop: threading.Event | None = None,
    max_publish_failures: int = 3,
    checkpointer: Checkpointer | None = None,
    resume: Checkpoint | ShardedCheckpoint | None = None,
    dist: DistContext | None = None,
) -> int:
    """Run optimizer steps up to ``settings.max_steps``; return the last published version.

    ``model`` holds the fp32 master weights (on its device); ``publisher`` registers each
    version with the coordinator when it was built with ``register=``. ``sink`` receives each
    step's metrics (see :class:`~.metrics.MetricsLog`); the ``publish/*`` metrics of step ``k``
    describe the version published after step ``k - 1`` (``publish/version``), the newest one
    committed when step ``k`` ends. A failed publication (raised by the next ``publish``) is
    logged and answered with an anchor-only version of the current weights (``publish/failed``
    is 1 for that step); more than ``max_publish_failures`` failures in a row stop training with
    :class:`~deltarl.trainer.publish.weights.PublishFailedError`. Closes the publisher at the end, so the last
    version is committed (or its failure raised) when this returns.

    ``stop`` (e.g. :attr:`GracefulStop.event`): once set, the step in progress finishes (a pull
    still waiting for data gives its leases back), a checkpoint is written and this returns.
    ``checkpointer``: where checkpoints go (``settings.checkpoint.every``; see the module
    docstring); None: no checkpoints. ``resume``: a loaded checkpoint to continue from: training
    resumes at its ``step + 1`` with its optimizer, scheduler and RNG states.

    ``dist``: under ``torchrun`` this is rank 0's side (see :mod:`deltarl.trainer.learn.distributed`): it alone
    pulls, publishes, acks, reports and checkpoints, sends each step's batch to the other ranks
    (which run :func:`~deltarl.trainer.replica.train_replica`) and trains on its share with DDP.

    ``ref_model``: the frozen reference policy of ``loss.kl_coef > 0`` (see
    :func:`~deltarl.trainer.learn.step.frozen_reference`; under FSDP sharded like ``model``); checked before the
    first version is published (:func:`~deltarl.trainer.learn.step.check_reference`), so a run that cannot train
    never publishes.
    """
    ctx = dist if dist is not None else DistContext()
    if not ctx.is_main:
        raise ValueError(f"rank {ctx.rank} must run train_replica: only rank 0 runs train()")
    check_reference(settings, model, ref_model)
    publisher.follow_precision(model)  # tensors the model keeps in fp32 are published in fp32
    opt, sched = build_optimizer(model.parameters(), settings.optimizer, settings.max_steps)
    failures = 0  # consecutive failed publications
    step = groups_trained = groups_acked = 0
    if resume is not None:
        changed = _changed_settings(resume.meta.settings, settings.model_dump(mode="json"))
        if changed:
            logger.warning("resuming with settings that differ from the checkpoint's: %s", changed)
        resume.restore(model, opt, sched, publish_dtype=publisher.dtype)
        step, groups_trained = resume.meta.step, resume.meta.groups_trained
        groups_acked = resume.meta.groups_acked
        version = publisher.publish(
            publisher.state_of(model), _resume_version(publisher, resume), step=step, anchor=True
        )
        publisher.wait()
        logger.info("resumed after step %d; its weights are version %d (anchor)", step, version)
    else:
        version = publisher.publish(publisher.state_of(model), step=0, anchor=True)
        publisher.wait()
        logger.info("published the starting weights as version %d", version)
    saved = step  # step of the newest checkpoint (or of the start: nothing new to save)
    step_model = wrap_ddp(model, ctx)

    def save() -> None:
        nonlocal saved
        if checkpointer is None or step == saved:
            return
        latest = BucketReader(publisher.bucket).latest()
        checkpointer.save(
            step,
            model,
            opt,
            sched,
            version=version,
            bucket_version=None if latest is None else latest.version,
            bucket_digest=None if latest is None else latest.state_digest,
            groups_trained=groups_trained,
            groups_acked=groups_acked,
            settings=settings.model_dump(mode="json"),
            publish_dtype=publisher.dtype,
        )
        saved = step

    every = settings.checkpoint.every
    keeper = LeaseKeeper(source, settings.batch.lease_s)
    limits = model_limits(model)
    try:
        while step < settings.max_steps:
            if stop is not None and stop.is_set():
                logger.warning("stop requested: stopping after step %d", step)
                break  # the other ranks are told after the loop
            t_step = time.perf_counter()
            try:
                pulled = pull_groups(
                    source,
                    version,
                    settings.batch,
                    settings.batch.groups_per_step,
                    poll_s=poll_s,
                    timeout_s=data_timeout_s,
                    stop=stop,
                    keeper=keeper,
                )
            except TimeoutError as err:
                if stop is not None and stop.is_set():
                    logger.warning("stop requested while waiting for data after step %d", step)
                    break
                save()  # between steps: the state is consistent (FSDP: every rank saves)
                broadcast(("timeout", str(err)), ctx)
                raise
            refusals = pulled.refusals
            batch, kept = prepare_batch(pulled, version, settings, limits)
            if batch is None:  # nothing usable: no step, the leases are done with
                logger.warning(
                    "none of the %d groups pulled for version %d can be trained on; pulling again",
                    len(pulled.entries) + len(refusals),
                    version,
                )
                groups_acked += _ack_all(source, keeper, pulled, refusals)[1]
                continue
            step += 1
            broadcast(("step", (batch, version)), ctx)
            dropped: dict[int, float] = {}
            metrics = train_step(
                step_model,
                opt,
                sched,
                batch,
                settings,
                ref_model=ref_model,
                dist=ctx,
                dropped=dropped,
            )
            for index, kl in dropped.items():
                refusals.refuse(
                    kept[index],
                    "sampling_mismatch",
                    f"its on-policy tokens' mean mismatch KL is {kl:.4g} nats/token (limit "
                    f"{settings.sampling.max_onpolicy_mismatch_kl}): not sampled by version "
                    f"{version}'s weights as it claims",
                )
            _check_trainer_mismatch(kept, dropped, version, source, keeper, pulled, ctx)
            waited = publisher.waited_s
            failed = False
            try:
                version = publisher.publish(publisher.state_of(model), step=step)
                failures = 0
            except PublishFailedError:
                failures += 1
                if failures > max_publish_failures:
                    raise
                logger.exception("publication failed; re-anchoring with the current weights")
                failed = True
                version = publisher.publish(publisher.state_of(model), step=step, anchor=True)
            ack_failures, acked = _ack_all(source, keeper, pulled, refusals)
            groups_trained += len(kept) - len(dropped)
            groups_acked += acked
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
                    "batch/lease_errors": float(pulled.lease_errors),
                    "lease/extensions": float(keeper.extensions),
                    "lease/extend_failures": float(keeper.failures),
                    "publish/failed": float(failed),
                    "time/step_s": time.perf_counter() - t_step,
                    **refusals.metrics(),
                }
            )
            if sink is not None:
                sink(step, metrics)
            if every and step % every == 0:
                save()
        save()  # the end, or a stop request (before "stop": FSDP ranks save their shards too)
        broadcast(("stop", version), ctx)
    finally:
        keeper.close()
        publisher.close()
    return version
