"""A rollout worker against an old signed ``latest.json`` put back in the bucket: it keeps
serving the newest version it holds, reports the problem, never moves back, and follows the
trainer again once the trainer publishes; a restarted worker does not start on the old version."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from rollout_helpers import FakeTrainer, clone_state, same_bits, tiny_engine
from worker_helpers import wait_for

from deltarl.buckets.local import LocalBucket
from deltarl.rollout.sync.follower import VersionFollower
from deltarl.rollout.sync.records import SyncError
from deltarl.rollout.sync.weights import WeightSync
from deltarl.weightsync.manifest import LATEST_KEY
from deltarl.weightsync.reader import BucketReader, RollbackError
from deltarl.weightsync.signing import Signer, Verifier, generate_key


@pytest.fixture
def signer(tmp_path: Path) -> Signer:
    return generate_key(tmp_path / "trainer.key")


def signed_run(bucket: LocalBucket, signer: Signer) -> tuple[FakeTrainer, bytes]:
    """Versions 0..2, signed; returns the trainer and the signed pointer of version 1."""
    trainer = FakeTrainer(
        bucket, clone_state(dict(tiny_engine(seed=1).named_parameters())), signer=signer
    )
    trainer.step()
    old_pointer = bucket.get_bytes(LATEST_KEY)
    trainer.step()
    return trainer, old_pointer


def worker_sync(bucket: LocalBucket, signer: Signer) -> WeightSync:
    reader = BucketReader(bucket, verifier=Verifier([signer.public_hex]))
    return WeightSync(tiny_engine(seed=2), reader)


def test_a_replayed_pointer_leaves_the_worker_at_its_version_until_the_trainer_publishes(
    bucket: LocalBucket, signer: Signer
) -> None:
    trainer, old_pointer = signed_run(bucket, signer)
    sync = worker_sync(bucket, signer)
    errors: list[str] = []
    follower = VersionFollower(sync, "http://unused", None, on_error=errors.append)
    follower.follow(2)
    wait_for(lambda: sync.version == 2, 20, "no sync to v2")
    bucket.put_bytes(LATEST_KEY, old_pointer, overwrite=True)  # validly signed, for v1
    with pytest.raises(RollbackError, match="already accepted version 2"):
        sync.sync_to()
    follower.follow(3)  # the coordinator announces v3 before the bucket shows it
    wait_for(lambda: follower.failures == 1, 20, "the sync did not fail")
    assert "points at version 1, but this reader already accepted version 2" in errors[0]
    assert sync.healthy and sync.version == 2  # still serving v2, not v1
    assert same_bits(dict(sync.engine.named_parameters()), trainer.states[2])
    trainer.step()  # v3: the trainer's pointer replaces the old one
    time.sleep(0.6)  # past the backoff
    follower.kick()
    wait_for(lambda: sync.version == 3, 20, "no sync to v3 after the trainer published")
    assert same_bits(dict(sync.engine.named_parameters()), trainer.states[3])
    follower.stop()
    sync.close()


def test_a_restarted_worker_does_not_start_on_a_replayed_version(
    bucket: LocalBucket, signer: Signer
) -> None:
    """A fresh worker remembers no pointer; its floor is the coordinator's latest version, the
    target of its first sync, which an older pointer in the bucket does not reach."""
    _, old_pointer = signed_run(bucket, signer)
    bucket.put_bytes(LATEST_KEY, old_pointer, overwrite=True)
    sync = worker_sync(bucket, signer)
    with pytest.raises(SyncError, match=r"not published yet .*latest: 1"):
        sync.sync_to(2)  # the coordinator's latest version
    assert sync.version is None and not sync.healthy  # v1 was not loaded
    sync.close()


def test_an_unhealthy_worker_reloads_at_least_the_version_it_held(
    bucket: LocalBucket, signer: Signer
) -> None:
    trainer, _ = signed_run(bucket, signer)
    sync = worker_sync(bucket, signer)
    sync.sync_to(2)
    sync._set_unhealthy("test: weights damaged")
    report = sync.sync_to(1)  # an older target: the worker goes back to v2, not to v1
    assert report.target == 2 and report.version == 2 and sync.healthy
    assert report.steps[0].kind == "anchor" and report.steps[-1].version == 2
    assert same_bits(dict(sync.engine.named_parameters()), trainer.states[2])
    assert sync.sync_to(1).steps == []  # healthy at v2: nothing to do
    sync.close()
