"""Retention: GC keeps the newest anchors and never breaks a plan from a retained version."""

from __future__ import annotations

import random
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from deltarl.buckets.local import LocalBucket
from deltarl.weightsync.manifest import MANIFESTS_PREFIX, OBJECTS_PREFIX, xxh3_hex
from deltarl.weightsync.planner import plan_catch_up, reachable_versions
from deltarl.weightsync.reader import BucketReader
from deltarl.weightsync.retention import RetentionPolicy, collect_garbage
from deltarl.weightsync.writer import BucketWriter, NewObject

LATER = timedelta(days=1)


def digest(v: int) -> str:
    return xxh3_hex(f"state-{v}".encode())


def anchor(v: int) -> NewObject:
    return NewObject("anchor", "safetensors", b"A" * 1000 + str(v).encode())


def delta(base: int, v: int, size: int = 10) -> NewObject:
    return NewObject(
        "delta",
        "deltarl-compact-v1",
        bytes([v % 251]) * size,
        base_version=base,
        base_digest=digest(base),
    )


def publish(pub: BucketWriter, v: int, objs: Iterable[NewObject]) -> None:
    pub.publish(v, list(objs), state_digest=digest(v), numel=500, full_bytes=1000, step=v)


class RecordingBucket(LocalBucket):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.deleted: list[str] = []

    def delete_many(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        self.deleted.extend(keys)
        super().delete_many(keys)


@pytest.fixture
def bucket(tmp_path: Path) -> RecordingBucket:
    return RecordingBucket(tmp_path / "bucket")


def history(bucket: RecordingBucket, n: int = 23, every: int = 5) -> None:
    """Anchors every ``every`` versions, deltas v-1 -> v, squashed v-3 -> v on even versions."""
    pub = BucketWriter(bucket, anchor_every=every)
    for v in range(n):
        objs = [anchor(v)] if pub.should_anchor(v) else []
        if v:
            objs.append(delta(v - 1, v))
        if v >= 3 and v % 2 == 0:
            objs.append(delta(v - 3, v, size=15))
        publish(pub, v, objs)


def assert_plans_intact(bucket: RecordingBucket, retained: list[int]) -> None:
    reader = BucketReader(bucket)
    manifests = reader.manifests()
    assert sorted(manifests) == retained
    latest = max(retained)
    for current in [None, *retained]:
        for target in retained:
            if current is not None and target < current:
                continue
            plan = plan_catch_up(manifests, current, target)
            for ref in plan.steps:
                reader.fetch(ref)  # exists and verifies
        assert reader.plan(current).target == latest


def test_keeps_latest_anchors_and_everything_after(bucket: RecordingBucket) -> None:
    history(bucket)
    before = BucketReader(bucket).manifests()
    report = collect_garbage(bucket, RetentionPolicy(keep_anchors=2), now=datetime.now(UTC) + LATER)
    assert report.cutoff == 15 and report.latest == 22
    assert report.retained_versions == list(range(15, 23))
    assert report.deleted_versions == list(range(15))
    assert report.orphans_in_grace == []
    assert_plans_intact(bucket, list(range(15, 23)))
    # The objects of deleted versions are gone; those of retained versions all remain.
    keys = {o.key for o in bucket.list(OBJECTS_PREFIX)}
    assert keys == {o.key for v in range(15, 23) for o in before[v].objects}
    assert report.freed_bytes > 0
    # Running it again deletes nothing.
    again = collect_garbage(bucket, RetentionPolicy(keep_anchors=2), now=datetime.now(UTC) + LATER)
    assert again.deleted_objects == [] and again.deleted_manifests == []


def test_manifests_are_deleted_before_their_objects(bucket: RecordingBucket) -> None:
    history(bucket, n=12)
    collect_garbage(bucket, RetentionPolicy(keep_anchors=1))
    kinds = [k.split("/")[0] for k in bucket.deleted]
    assert kinds and kinds == sorted(kinds)  # every "manifests" before any "objects"
    assert "manifests" in kinds and "objects" in kinds


def test_few_anchors_keeps_everything(bucket: RecordingBucket) -> None:
    history(bucket, n=8)  # anchors at 0 and 5
    report = collect_garbage(bucket, RetentionPolicy(keep_anchors=2))
    assert report.cutoff is None and report.deleted_versions == [] and bucket.deleted == []


def test_cutoff_moves_back_when_a_version_needs_an_older_base(bucket: RecordingBucket) -> None:
    pub = BucketWriter(bucket, anchor_every=0)
    publish(pub, 0, [anchor(0)])
    for v in range(1, 11):
        publish(pub, v, [delta(v - 1, v), *([anchor(v)] if v in (5, 10) else [])])
    publish(pub, 11, [delta(8, 11)])  # only a squashed delta from before the newest anchor
    publish(pub, 12, [delta(11, 12)])
    report = collect_garbage(bucket, RetentionPolicy(keep_anchors=1))
    assert report.cutoff == 5 and report.retained_versions == list(range(5, 13))
    assert_plans_intact(bucket, list(range(5, 13)))


def test_orphans_of_a_crashed_publish_wait_for_the_grace_period(bucket: RecordingBucket) -> None:
    pub = BucketWriter(bucket)
    publish(pub, 0, [anchor(0)])
    real_put = bucket.put_bytes

    def crash_on_manifest(key: str, data: bytes, *, overwrite: bool = True):  # type: ignore[no-untyped-def]
        if key.startswith(MANIFESTS_PREFIX):
            raise RuntimeError("crash")
        return real_put(key, data, overwrite=overwrite)

    bucket.put_bytes = crash_on_manifest  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        publish(pub, 1, [delta(0, 1), anchor(1)])
    bucket.put_bytes = real_put  # type: ignore[method-assign]
    orphans = {o.key for o in bucket.list("objects/v000000000001/")}
    assert len(orphans) == 2

    policy = RetentionPolicy(orphan_grace_s=600)
    soon = collect_garbage(bucket, policy, now=datetime.now(UTC) + timedelta(seconds=60))
    assert set(soon.orphans_in_grace) == orphans and soon.deleted_objects == []
    dry = collect_garbage(bucket, policy, now=datetime.now(UTC) + LATER, dry_run=True)
    assert set(dry.deleted_objects) == orphans and bucket.list("objects/v000000000001/") != []
    late = collect_garbage(bucket, policy, now=datetime.now(UTC) + LATER)
    assert set(late.deleted_objects) == orphans
    assert bucket.list("objects/v000000000001/") == []
    assert_plans_intact(bucket, [0])


def test_objects_of_a_pending_manifest_are_not_orphans(bucket: RecordingBucket) -> None:
    pub = BucketWriter(bucket)
    publish(pub, 0, [anchor(0)])
    real_put = bucket.put_bytes

    def crash_on_pointer(key: str, data: bytes, *, overwrite: bool = True):  # type: ignore[no-untyped-def]
        if key == "latest.json":
            raise RuntimeError("crash")
        return real_put(key, data, overwrite=overwrite)

    bucket.put_bytes = crash_on_pointer  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        publish(pub, 1, [delta(0, 1)])
    bucket.put_bytes = real_put  # type: ignore[method-assign]
    report = collect_garbage(bucket, now=datetime.now(UTC) + LATER)
    assert report.deleted_objects == [] and report.orphans_in_grace == []


@pytest.mark.parametrize("seed", range(12))
def test_random_histories_never_lose_a_plan(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    bucket = RecordingBucket(tmp_path / "b")
    pub = BucketWriter(bucket, anchor_every=rng.choice([0, 3, 4, 7]))
    v, published = 0, [0]
    publish(pub, 0, [anchor(0)])
    for _ in range(rng.randint(5, 25)):
        v += rng.choice([1, 1, 1, 2])  # versions may skip
        bases = rng.sample(published[-5:], k=min(len(published[-5:]), rng.randint(1, 2)))
        objs = [delta(b, v, size=rng.randint(5, 50)) for b in bases]
        if pub.should_anchor(v) or rng.random() < 0.1:
            objs.append(anchor(v))
        publish(pub, v, objs)
        published.append(v)
    before = BucketReader(bucket).manifests()
    keep = rng.randint(1, 3)
    report = collect_garbage(
        bucket, RetentionPolicy(keep_anchors=keep), now=datetime.now(UTC) + LATER
    )
    retained = report.retained_versions
    assert retained[-1] == v and set(retained) | set(report.deleted_versions) == set(before)
    anchored_kept = [r for r in retained if before[r].has_anchor]
    assert len(anchored_kept) >= min(keep, sum(m.has_anchor for m in before.values()))
    # Every retained version reachable before the GC is still reachable, with every object present.
    still = reachable_versions({r: before[r] for r in retained})
    assert reachable_versions(before) & set(retained) <= still
    reader = BucketReader(bucket)
    for current in [None, *retained]:
        plan = reader.plan(current)
        for ref in plan.steps:
            reader.fetch(ref)
