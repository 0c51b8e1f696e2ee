"""The main loop against an in-memory queue whose worker follows the bucket like a real one:
it catches up through the planner, samples with the published weights, and ends bit-identical
to the trainer."""

from __future__ import annotations

import threading
import time
from collections import deque
from pathlib import Path

import httpx
import pytest
import torch
from test_step import Bigram, rollout
from test_weight_publisher import FakeCoordinator, assert_bit_identical

from deltarl.buckets import ObjectInfo
from deltarl.buckets.local import LocalBucket
from deltarl.services.coordinator.client import CoordinatorError
from deltarl.services.coordinator.schemas import BatchItem, BatchLease, LeasedBatch, TrajectoryGroup
from deltarl.trainer.loop import pull_groups, train
from deltarl.trainer.metrics import MetricsLog, read_metrics
from deltarl.trainer.publish.weights import WeightPublisher
from deltarl.trainer.settings import BatchSettings, ExperimentSettings
from deltarl.weightsync.anchor import decode_anchor
from deltarl.weightsync.codec.formats import decode_delta
from deltarl.weightsync.delta import apply_delta
from deltarl.weightsync.manifest import version_tag
from deltarl.weightsync.reader import BucketReader


class FakeQueue:
    """Coordinator queue + one worker that runs a few groups ahead of the trainer."""

    def __init__(self, bucket: LocalBucket, ahead: int = 4) -> None:
        self.reader = BucketReader(bucket)
        self.gen = torch.Generator().manual_seed(7)
        self.worker = Bigram()
        self.replica: dict[str, torch.Tensor] | None = None
        self.applied: int | None = None
        self.queue: deque[TrajectoryGroup] = deque()
        self.ahead = ahead
        self.leased: dict[str, list[TrajectoryGroup]] = {}
        self.acked: list[str] = []
        self.nacked: list[str] = []
        self.inject_stale_at: int | None = None

    def catch_up(self) -> None:
        latest = self.reader.latest_version()
        if latest is None or latest == self.applied:
            return
        for ref in self.reader.plan(self.applied).steps:
            data = self.reader.fetch(ref)
            if ref.kind == "anchor":
                self.replica = decode_anchor(data)[0]
            else:
                assert self.replica is not None
                apply_delta(self.replica, decode_delta(data, self.replica))
        assert self.replica is not None
        self.applied = latest
        self.worker.load_state_dict({k: v.float() for k, v in self.replica.items()})

    def lease(
        self, max_groups: int, lease_s: float | None = None, wait_s: float = 0.0
    ) -> LeasedBatch:
        self.catch_up()
        if self.applied is None:
            return LeasedBatch(lease=self._lease("", []), groups=[])
        if self.inject_stale_at is not None and self.applied >= self.inject_stale_at:
            self.queue.appendleft(rollout(self.worker, self.gen, 1, 8, 0)[0])
            self.inject_stale_at = None
        while len(self.queue) < max_groups + self.ahead:
            self.queue.extend(rollout(self.worker, self.gen, 1, 8, self.applied))
        take = [self.queue.popleft() for _ in range(max_groups)]
        bid = f"b{len(self.leased)}"
        self.leased[bid] = take
        return LeasedBatch(lease=self._lease(bid, take), groups=take)

    def _lease(self, bid: str, groups: list[TrajectoryGroup]) -> BatchLease:
        items = [
            BatchItem(
                submission_id=i,
                worker_id=g.worker_id,
                group_id=g.group_id,
                version_min=g.version_min,
                version_max=g.version_max,
                submitted_at=time.time(),
                num_trajectories=len(g.trajectories),
                num_tokens=g.num_tokens,
            )
            for i, g in enumerate(groups)
        ]
        return BatchLease(
            batch_id=bid,
            expires_at=time.time() + 60,
            items=items,
            dropped_stale=0,
            current_version=self.applied,
            queue_depth=len(self.queue),
        )

    def ack(self, batch_id: str) -> None:
        assert batch_id in self.leased
        self.acked.append(batch_id)

    def nack(self, batch_id: str) -> None:
        self.nacked.append(batch_id)
        self.queue.extendleft(reversed(self.leased[batch_id]))


def test_loop_learns_and_the_worker_ends_bit_identical(tmp_path: Path) -> None:
    torch.manual_seed(0)
    settings = ExperimentSettings.load(
        None,
        [
            "max_steps=20",
            "optimizer.lr=0.2",
            "batch.groups_per_step=4",
            "batch.micro_batch_size=16",
            "publish.anchor_every=8",
            f"run_dir={tmp_path / 'run'}",
        ],
    )
    bucket = LocalBucket(tmp_path / "bucket")
    queue = FakeQueue(bucket)
    queue.inject_stale_at = 6
    coordinator = FakeCoordinator()
    model = Bigram()
    with WeightPublisher(bucket, settings.publish, register=coordinator) as pub:
        last = train(model, settings, queue, pub, sink=MetricsLog(settings.run_dir), poll_s=0.0)
    assert last == settings.max_steps
    assert [m.version for m in coordinator.manifests] == list(range(settings.max_steps + 1))

    rows = read_metrics(settings.run_dir)
    assert [r["step"] for r in rows] == list(range(1, settings.max_steps + 1))
    rewards = [float(r["reward/mean"] or 0) for r in rows]
    assert sum(rewards[:4]) / 4 < 0.3 and sum(rewards[-4:]) / 4 > 0.6, rewards
    assert sum(float(r["batch/dropped_stale_trainer"] or 0) for r in rows) == 1
    # each row reports the publication of the previous version (committed by then)
    assert [r["publish/version"] for r in rows] == list(range(settings.max_steps))
    assert "publish/anchor_bytes" in rows[0] and all("publish/delta_bytes" in r for r in rows[1:])
    assert max(float(r["staleness/1"] or 0) for r in rows if "staleness/1" in r) > 0
    assert sorted(queue.acked) == sorted(queue.leased) and not queue.nacked

    queue.catch_up()
    assert queue.applied == last and queue.replica is not None
    want = {n: t.to(torch.bfloat16) for n, t in model.state_dict().items()}
    assert_bit_identical(queue.replica, want)


class EmptyQueue(FakeQueue):
    def lease(
        self, max_groups: int, lease_s: float | None = None, wait_s: float = 0.0
    ) -> LeasedBatch:
        if not self.leased:  # one lease with a group, then nothing
            return super().lease(1, lease_s, wait_s)
        return LeasedBatch(lease=self._lease("", []), groups=[])


def test_pull_gives_up_and_returns_its_leases(tmp_path: Path) -> None:
    bucket = LocalBucket(tmp_path / "bucket")
    with WeightPublisher(bucket) as pub:
        pub.publish(Bigram().state_dict())
    queue = EmptyQueue(bucket)
    with pytest.raises(TimeoutError, match="1/3 groups"):
        pull_groups(queue, 0, BatchSettings(), 3, poll_s=0.0, timeout_s=0.05)
    assert queue.nacked == ["b0"] and len(queue.queue) >= 1
    stop = threading.Event()
    stop.set()
    with pytest.raises(TimeoutError, match="stop requested"):
        pull_groups(queue, 0, BatchSettings(), 3, poll_s=0.0, stop=stop)


class OnceFailingBucket(LocalBucket):
    """Fails the first upload of one version's objects."""

    def __init__(self, root: Path, version: int) -> None:
        super().__init__(root)
        self.prefix = f"objects/{version_tag(version)}/"
        self.armed = True

    def put_bytes(self, key: str, data: bytes, *, overwrite: bool = True) -> ObjectInfo:
        if self.armed and key.startswith(self.prefix):
            self.armed = False
            raise OSError(f"simulated outage writing {key}")
        return super().put_bytes(key, data, overwrite=overwrite)


def test_loop_reanchors_after_a_failed_publication(tmp_path: Path) -> None:
    settings = ExperimentSettings.load(
        None, ["max_steps=8", "batch.groups_per_step=2", f"run_dir={tmp_path / 'run'}"]
    )
    bucket = OnceFailingBucket(tmp_path / "bucket", 5)
    queue = FakeQueue(bucket)
    coordinator = FakeCoordinator()
    model = Bigram()
    with WeightPublisher(bucket, settings.publish, register=coordinator) as pub:
        last = train(model, settings, queue, pub, sink=MetricsLog(settings.run_dir), poll_s=0.0)
    # version 5 (step 5's weights) never reached the bucket; step 6's weights took its number
    # as an anchor-only version, and deltas resumed after it
    assert last == 7 and not bucket.armed
    kinds = {m.version: (m.has_anchor, bool(m.deltas)) for m in coordinator.manifests}
    assert sorted(kinds) == list(range(8))
    assert kinds[5] == (True, False) and kinds[6] == (False, True)
    rows = read_metrics(settings.run_dir)
    assert [r["publish/failed"] for r in rows] == [0, 0, 0, 0, 0, 1, 0, 0]
    queue.catch_up()
    assert queue.replica is not None
    want = {n: t.to(torch.bfloat16) for n, t in model.state_dict().items()}
    assert_bit_identical(queue.replica, want)


class FlakyQueue(FakeQueue):
    """A coordinator that restarts: the first lease requests fail with ``errors``."""

    def __init__(self, bucket: LocalBucket, errors: list[Exception]) -> None:
        super().__init__(bucket)
        self.errors = errors

    def lease(
        self, max_groups: int, lease_s: float | None = None, wait_s: float = 0.0
    ) -> LeasedBatch:
        if self.errors:
            raise self.errors.pop(0)
        return super().lease(max_groups, lease_s, wait_s)

    def nack(self, batch_id: str) -> None:
        raise httpx.ConnectError("connection refused")


def test_pull_waits_out_a_coordinator_restart_and_raises_real_errors(tmp_path: Path) -> None:
    bucket = LocalBucket(tmp_path / "bucket")
    with WeightPublisher(bucket) as pub:
        pub.publish(Bigram().state_dict())
    outage: list[Exception] = [
        httpx.ConnectError("connection refused"),
        httpx.RemoteProtocolError("Server disconnected without sending a response."),
        CoordinatorError(503, "unavailable", "starting"),
    ]
    queue = FlakyQueue(bucket, outage)
    pulled = pull_groups(queue, 0, BatchSettings(), 2, poll_s=0.0)
    assert len(pulled.groups) == 2 and pulled.lease_errors == 3 and not outage
    for err in (CoordinatorError(422, "bad_batch_size", "no"), ValueError("corrupt batch")):
        with pytest.raises(type(err)):
            pull_groups(FlakyQueue(bucket, [err]), 0, BatchSettings(), 2, poll_s=0.0)
    # giving up while the coordinator is down: the nack fails, the lease will expire instead
    with pytest.raises(TimeoutError, match="timed out"):
        pull_groups(
            EmptyAfterOne(FlakyQueue(bucket, [])), 0, BatchSettings(), 3, poll_s=0.0, timeout_s=0.05
        )


class EmptyAfterOne:
    """One lease with a group, then empty answers; returning leases fails (coordinator down)."""

    def __init__(self, inner: FlakyQueue) -> None:
        self.inner, self.done = inner, False

    def lease(
        self, max_groups: int, lease_s: float | None = None, wait_s: float = 0.0
    ) -> LeasedBatch:
        if self.done:
            return LeasedBatch(lease=self.inner._lease("", []), groups=[])
        self.done = True
        return self.inner.lease(1, lease_s, wait_s)

    def ack(self, batch_id: str) -> None:
        self.inner.ack(batch_id)

    def nack(self, batch_id: str) -> None:
        self.inner.nack(batch_id)
