"""Refused groups over HTTP: the trainer names them in its ack, the coordinator keeps them as
dead letters, flags their worker, and bounds what one group or one lease may cost it."""

from __future__ import annotations

import math
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import msgpack
import pytest

from deltarl.services.coordinator.client import CoordinatorClient, CoordinatorError
from deltarl.services.coordinator.schemas import (
    GroupRejection,
    ModelLimits,
    Trajectory,
    WorkerRegistration,
    encode_group,
)
from deltarl.services.coordinator.service import Coordinator

from .conftest import TRAINER_TOKEN, WORKER_TOKEN, LiveServer
from .helpers import group, manifest


def _clients(s: LiveServer) -> tuple[CoordinatorClient, CoordinatorClient, CoordinatorClient]:
    return (
        CoordinatorClient(s.url, TRAINER_TOKEN, retries=0),
        CoordinatorClient(s.url, WORKER_TOKEN, retries=0),
        CoordinatorClient(s.url, retries=0),
    )


def _reg(worker_id: str) -> WorkerRegistration:
    return WorkerRegistration(worker_id=worker_id, engine="e", model="m", capacity=4)


def test_refused_groups_become_dead_letters_over_http(
    make_server: Callable[..., LiveServer],
) -> None:
    server = make_server(suspect_after=2)
    trainer, worker, anon = _clients(server)
    trainer.publish_version(manifest(0), ModelLimits(vocab_size=50_000))
    worker.register(_reg("w1"))
    worker.register(_reg("w2"))
    for i in range(4):
        worker.submit(group(f"k{i}", worker="w1" if i % 2 else "w2"))
    batch = trainer.lease(4)
    ids = [i.submission_id for i in batch.lease.items]
    refused = [
        GroupRejection(submission_id=ids[1], reason="sampling_mismatch", detail="kl 3.1"),
        GroupRejection(submission_id=ids[3], reason="bad_token_id", detail="id 9 >= 4"),
    ]
    with pytest.raises(CoordinatorError) as err:  # not this batch's group: nothing changes
        trainer.ack(
            batch.lease.batch_id, [GroupRejection(submission_id=999, reason="x", detail="")]
        )
    assert err.value.status_code == 422 and err.value.code == "bad_rejection"
    result = trainer.ack(batch.lease.batch_id, refused)
    assert (result.acked, result.rejected) == (4, 2)
    dead = anon.dead_letters()
    assert dead.count == 2 and {d.reason for d in dead.items} == {
        "sampling_mismatch",
        "bad_token_id",
    }
    w1 = anon.worker("w1")
    assert w1.rejected_groups == 2 and w1.suspect
    assert w1.last_rejection is not None and "bad_token_id" in w1.last_rejection
    assert not anon.worker("w2").suspect
    status = anon.status()
    assert status.workers_suspect == 1 and status.queue.dead_letters == 2
    metrics = anon.metrics_text()
    assert 'deltarl_coordinator_rejected_groups_total{reason="bad_token_id"} 1.0' in metrics
    assert "deltarl_coordinator_workers_suspect 1.0" in metrics
    assert 'deltarl_coordinator_worker_rejected_groups{worker="w1"} 2.0' in metrics
    # only the trainer's token may requeue dead letters or clear a worker
    for call in (
        lambda c: c.requeue_dead_letter(ids[1]),
        lambda c: c.clear_rejections("w1"),
    ):
        with pytest.raises(CoordinatorError) as err:
            call(worker)
        assert err.value.status_code in (401, 403)
    trainer.requeue_dead_letter(ids[1])
    again = trainer.lease(4)
    assert [i.submission_id for i in again.lease.items] == [ids[1]]
    with pytest.raises(CoordinatorError) as err:
        trainer.requeue_dead_letter(ids[1])
    assert err.value.status_code == 404
    trainer.clear_rejections("w1")
    assert not anon.worker("w1").suspect


def test_the_model_limits_are_checked_at_submission(server: LiveServer) -> None:
    trainer, worker, _ = _clients(server)
    trainer.publish_version(manifest(0), ModelLimits(vocab_size=50_000, max_tokens=3))
    worker.register(_reg("w1"))
    with pytest.raises(CoordinatorError) as err:
        worker.submit(group("k"))  # token id 40000 fits, but 4 tokens > max_tokens 3
    assert err.value.status_code == 422 and "more than the model takes (3)" in err.value.message
    trainer.publish_version(manifest(1), ModelLimits(vocab_size=100))
    with pytest.raises(CoordinatorError, match="outside the model's vocabulary of 100"):
        worker.submit(group("k2"))


def test_a_lease_is_bounded_in_bytes(make_server: Callable[..., LiveServer]) -> None:
    one = len(encode_group(group("k0")))
    server = make_server(max_lease_bytes=max(1024, 2 * one + 10))
    trainer, worker, _ = _clients(server)
    trainer.publish_version(manifest(0))
    worker.register(_reg("w1"))
    for i in range(6):
        worker.submit(group(f"k{i}"))
    per_lease = (max(1024, 2 * one + 10)) // one
    assert len(trainer.lease(6).lease.items) == per_lease


def test_a_large_group_is_decoded_off_the_event_loop(
    make_server: Callable[..., LiveServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    server = make_server()
    trainer, worker, anon = _clients(server)
    trainer.publish_version(manifest(0))
    worker.register(_reg("w1"))
    threads: list[str] = []
    real = Coordinator.decode

    def spy(self: Coordinator, payload: bytes) -> object:
        threads.append(threading.current_thread().name)
        return real(self, payload)

    monkeypatch.setattr(Coordinator, "decode", spy)
    big = group("big").model_copy(
        update={
            "trajectories": [
                Trajectory(
                    tokens=[7] * 40_000,
                    logprobs=[-1.0] * 40_000,
                    mask=[1] * 40_000,
                    prompt_len=0,
                    reward=1.0,
                    version_min=0,
                    version_max=0,
                )
            ]
        }
    )
    worker.submit(big)  # ~360 KB: over the inline bound
    worker.submit(group("small"))  # ~100 B: on the loop
    assert threads[0] != server.thread.name  # a worker thread, not the event loop's
    assert threads[1] == server.thread.name
    assert anon.status().queue.depth == 2


def test_a_group_over_max_group_bytes_is_refused_with_413(
    make_server: Callable[..., LiveServer],
) -> None:
    server = make_server(max_group_bytes=1024)
    trainer, worker, _ = _clients(server)
    trainer.publish_version(manifest(0))
    worker.register(_reg("w1"))
    big = group("big", n=40)
    with pytest.raises(CoordinatorError) as err:
        worker.submit(big)
    assert err.value.status_code == 413 and err.value.code == "group_too_large"


def test_status_survives_non_finite_sums_in_the_store(
    make_server: Callable[..., LiveServer], tmp_path: Path
) -> None:
    """Rewards are bounded at submission now, but a store written before could hold sums that
    overflow (two rewards of 1.7e308): the status skips them instead of serving a null that
    its own schema refuses."""
    server = make_server()
    trainer, worker, anon = _clients(server)
    trainer.publish_version(manifest(0))
    trainer.publish_version(manifest(1))
    worker.register(_reg("w1"))
    worker.submit(group("k0", vmin=1))
    body = msgpack.unpackb(encode_group(group("huge")), raw=False)
    for t in body["trajectories"]:
        t["reward"] = 1.7e308  # as a hostile worker sends it: no client-side validation
    with pytest.raises(CoordinatorError, match="within ±1e\\+09"):
        worker.submit(msgpack.packb(body, use_bin_type=True))
    db = sqlite3.connect(tmp_path / "coord.sqlite3")
    db.execute("INSERT INTO rewards VALUES (0, 2, ?)", (math.inf,))
    db.commit()
    db.close()
    status = anon.status()  # parses: every mean finite
    assert [r.version for r in status.rewards] == [1]
    page = httpx.get(f"{server.url}/v1/status").json()
    assert all(math.isfinite(r["mean_reward"]) for r in page["rewards"])
