"""VersionFollower without a coordinator: coalesced background syncs and backoff after a failure."""

from __future__ import annotations

import json
import time
from pathlib import Path

from rollout_helpers import FakeTrainer, clone_state, same_bits, tiny_engine
from worker_helpers import wait_for

from deltarl.buckets.local import LocalBucket
from deltarl.rollout.sync.follower import VersionFollower
from deltarl.rollout.sync.weights import WeightSync
from deltarl.weightsync.reader import BucketReader


def make(
    bucket: LocalBucket, sync_log: Path | None = None
) -> tuple[FakeTrainer, WeightSync, VersionFollower, list[str]]:
    trainer = FakeTrainer(bucket, clone_state(dict(tiny_engine(seed=1).named_parameters())))
    sync = WeightSync(tiny_engine(seed=2), BucketReader(bucket))
    errors: list[str] = []
    # never started: no version thread, only follow()/kick()
    return (
        trainer,
        sync,
        VersionFollower(sync, "http://unused", None, on_error=errors.append, sync_log=sync_log),
        errors,
    )


def test_versions_published_during_a_sync_are_coalesced(
    bucket: LocalBucket, tmp_path: Path
) -> None:
    trainer, sync, follower, errors = make(bucket, sync_log=tmp_path / "syncs.jsonl")
    for _ in range(3):
        trainer.step()
    with sync._sync_lock:  # the first background sync waits here, as if it were long
        follower.follow(1)
        follower.follow(2)
        follower.follow(3)
        follower.follow(2)  # older than the target: ignored
        assert follower.wanted == 3
    wait_for(lambda: follower.syncs == 2, 10, "the syncs did not finish")
    time.sleep(0.1)
    assert follower.syncs == 2 and not errors  # to 1, then straight to 3 (2 skipped as a target)
    assert sync.version == 3 and same_bits(dict(sync.engine.named_parameters()), trainer.states[3])
    # the sync log: one JSON line per applied object (the anchor, then deltas 1, 2, 3)
    rows = [json.loads(x) for x in (tmp_path / "syncs.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["version"]) for r in rows] == [
        ("anchor", 0),
        ("delta", 1),
        ("delta", 2),
        ("delta", 3),
    ]
    assert all(r["pause_s"] >= 0 and r["bytes"] > 0 for r in rows)
    follower.stop()
    sync.close()


def test_a_failed_sync_backs_off_then_retries(bucket: LocalBucket) -> None:
    trainer, sync, follower, errors = make(bucket)
    follower.follow(1)  # not published yet: the sync fails
    wait_for(lambda: follower.failures == 1, 10, "the sync did not fail")
    assert "not published yet" in errors[0]
    trainer.step()
    follower.kick()  # within the backoff (0.5 s): nothing starts
    time.sleep(0.1)
    assert follower.failures == 1 and sync.version is None
    time.sleep(0.5)
    follower.kick()
    wait_for(lambda: sync.version == 1, 10, "no retry after the backoff")
    assert follower.syncs == 1
    follower.stop()
    sync.close()
