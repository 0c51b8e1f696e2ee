"""One contract, every store: SQLite and a real redis-server run the same tests."""

from __future__ import annotations

import threading

import pytest

from deltarl.services.coordinator.schemas import WorkerHeartbeat, WorkerRegistration
from deltarl.services.coordinator.store import (
    CoordinatorStore,
    IdempotencyConflict,
    IssuedChallenge,
    LeaseExpired,
    Rejection,
    StoreError,
    UnknownLease,
    VersionConflict,
)

from .conftest import StoreFactory
from .helpers import record, submission

T0 = 1_000_000.0


def test_versions_in_order_and_idempotent(store: CoordinatorStore) -> None:
    assert store.latest_version() is None
    for v in range(3):
        stored, created = store.add_version(record(v))
        assert created and stored.version == v
    again, created = store.add_version(record(2))  # a retry of the same publish
    assert not created and again.version == 2
    changed = record(2).model_copy(update={"state_digest": "f" * 32})
    with pytest.raises(VersionConflict, match="different content"):
        store.add_version(changed)
    store.add_version(record(3, kind="anchor"))
    store.add_version(record(5))  # gaps are allowed, as in the bucket
    with pytest.raises(VersionConflict, match="out of order: versions must increase"):
        store.add_version(record(4))
    latest, anchor = store.latest_version(), store.latest_anchor()
    assert latest is not None and latest.version == 5
    assert anchor is not None and anchor.version == 3
    assert [r.version for r in store.list_versions(None, 100)] == [0, 1, 2, 3, 5]
    assert [r.version for r in store.list_versions(1, 2)] == [2, 3]
    assert [r.version for r in store.list_versions(3, 2)] == [5]
    assert [r.version for r in store.recent_versions(2)] == [3, 5]
    assert store.get_version(9) is None
    got = store.get_version(1)
    assert got is not None and got == store.list_versions(0, 1)[0]


def test_versions_first_can_start_anywhere(store: CoordinatorStore) -> None:
    store.add_version(record(7, kind="anchor"))
    store.add_version(record(8, anchor=7))
    assert [r.version for r in store.list_versions(None, 10)] == [7, 8]
    assert [r.version for r in store.recent_versions(10)] == [7, 8]


def test_workers_register_heartbeat_rejoin_remove(store: CoordinatorStore) -> None:
    reg = WorkerRegistration(worker_id="w1", engine="vllm", model="m", capacity=4)
    w = store.register_worker(reg, T0)
    assert (w.worker_id, w.capacity, w.rejoins, w.applied_version) == ("w1", 4, 0, None)
    hb = WorkerHeartbeat(applied_version=3, in_flight=2, last_error="boom")
    w2 = store.heartbeat("w1", hb, T0 + 1, lost_after_s=10)
    assert w2 is not None and (w2.applied_version, w2.in_flight, w2.last_error) == (3, 2, "boom")
    assert w2.last_seen == T0 + 1 and w2.registered_at == T0 and w2.rejoins == 0
    w3 = store.heartbeat("w1", WorkerHeartbeat(applied_version=4), T0 + 30, lost_after_s=10)
    assert w3 is not None and w3.rejoins == 1 and w3.last_error is None  # came back after silence
    assert store.heartbeat("nobody", hb, T0, lost_after_s=10) is None
    w4 = store.register_worker(reg.model_copy(update={"capacity": 8}), T0 + 31)
    assert (w4.capacity, w4.rejoins, w4.applied_version, w4.registered_at) == (8, 2, None, T0)
    store.register_worker(reg.model_copy(update={"worker_id": "w0"}), T0)
    assert [w.worker_id for w in store.list_workers()] == ["w0", "w1"]
    assert store.remove_worker("w0") and not store.remove_worker("w0")
    assert store.get_worker("w0") is None
    got = store.get_worker("w1")
    assert got is not None and got.capacity == 8


def test_weights_digest_is_kept_until_the_next_heartbeat_or_registration(
    store: CoordinatorStore,
) -> None:
    reg = WorkerRegistration(worker_id="w1", engine="vllm", model="m", capacity=4)
    store.register_worker(reg, T0)
    d = "0123456789abcdef0123456789abcdef"
    w = store.heartbeat("w1", WorkerHeartbeat(applied_version=2, weights_digest=d), T0 + 1, 10)
    assert w is not None and w.weights_digest == d
    got = store.get_worker("w1")
    assert got is not None and got.weights_digest == d
    assert [x.weights_digest for x in store.list_workers()] == [d]
    w = store.heartbeat("w1", WorkerHeartbeat(applied_version=2), T0 + 2, 10)
    assert w is not None and w.weights_digest is None
    store.heartbeat("w1", WorkerHeartbeat(applied_version=2, weights_digest=d), T0 + 3, 10)
    assert store.register_worker(reg, T0 + 4).weights_digest is None  # a rejoin re-proves


def test_submit_idempotent_and_stale(store: CoordinatorStore) -> None:
    store.register_worker(WorkerRegistration(worker_id="w1", engine="e", model="m", capacity=1), T0)
    first = store.submit(submission("k1", vmin=5), T0, min_version=3, staleness=1)
    assert first.status == "accepted" and first.queue_depth == 1
    dup = store.submit(submission("k1", vmin=5), T0 + 1, min_version=3, staleness=1)
    assert dup.status == "duplicate" and dup.submission_id == first.submission_id
    assert dup.queue_depth == 1
    with pytest.raises(IdempotencyConflict, match="different payload"):
        store.submit(submission("k1", vmin=5, payload_extra=b"x"), T0, min_version=3, staleness=1)
    stale = store.submit(submission("k2", vmin=2), T0, min_version=3, staleness=6)
    assert stale.status == "stale" and stale.submission_id is None and stale.queue_depth == 1
    c = store.counters()
    assert (c.depth, c.submitted_total, c.duplicates_total) == (1, 1, 1)
    assert c.dropped == {"stale_at_submit": 1}
    assert c.oldest_submitted_at == T0
    assert store.staleness_hist() == {1: 1}
    assert store.reward_curve(10) == [(5, 1, 0.5)]
    w = store.get_worker("w1")
    assert w is not None and w.submitted == 1


def test_lease_ack_fifo(store: CoordinatorStore) -> None:
    for i in range(5):
        store.submit(submission(f"k{i}", vmin=1), T0 + i, None, 0)
    a = store.lease(2, 60, T0 + 10, None)
    b = store.lease(2, 60, T0 + 10, None)
    assert a.batch_id and b.batch_id and a.batch_id != b.batch_id
    ids_a = [m.submission_id for m, _ in a.items]
    ids_b = [m.submission_id for m, _ in b.items]
    assert ids_a < ids_b and len(ids_a) == len(ids_b) == 2 and b.queue_depth == 1
    meta, payload = a.items[0]
    assert meta.worker_id == "w1" and meta.group_id == "g-k0" and meta.submitted_at == T0
    assert payload == submission("k0", vmin=1).payload  # bytes come back unchanged
    assert store.ack(a.batch_id, T0 + 11) == 2
    assert store.ack(a.batch_id, T0 + 12) == 2  # repeating a successful ack is harmless
    c = store.counters()
    assert (c.depth, c.leased, c.acked_total) == (1, 2, 2)
    with pytest.raises(UnknownLease):
        store.ack("nope", T0)
    empty = store.lease(10, 60, T0 + 12, None)
    assert len(empty.items) == 1
    assert store.lease(10, 60, T0 + 12, None).batch_id == ""


def test_lease_expiry_returns_items_in_order(store: CoordinatorStore) -> None:
    for i in range(4):
        store.submit(submission(f"k{i}"), T0, None, 0)
    a = store.lease(2, 5, T0, None)
    b = store.lease(1, 5, T0, None)
    # both expire: all their groups are back at the head, oldest first, before k3; each comes
    # back in a lease of its own (its trainer may have died on it), k3 after them
    again = [store.lease(10, 5, T0 + 6, None) for _ in range(4)]
    assert [[m.group_id for m, _ in c.items] for c in again] == [
        ["g-k0"],
        ["g-k1"],
        ["g-k2"],
        ["g-k3"],
    ]
    assert [[m.deliveries for m, _ in c.items] for c in again] == [[2], [2], [2], [1]]
    with pytest.raises(LeaseExpired):
        store.ack(a.batch_id, T0 + 7)
    with pytest.raises(LeaseExpired):
        store.ack(b.batch_id, T0 + 7)
    assert [store.ack(c.batch_id, T0 + 7) for c in again] == [1, 1, 1, 1]
    assert store.counters().leased == 0


def test_ack_after_expiry_refused_and_requeued(store: CoordinatorStore) -> None:
    store.submit(submission("k0"), T0, None, 0)
    a = store.lease(1, 5, T0, None)
    with pytest.raises(LeaseExpired, match="went back to the queue"):
        store.ack(a.batch_id, T0 + 5)
    assert store.counters().depth == 1
    assert store.reclaim_expired(T0 + 100) == 0


def test_extend_keeps_a_lease_alive(store: CoordinatorStore) -> None:
    for i in range(2):
        store.submit(submission(f"k{i}"), T0, None, 0)
    a = store.lease(2, 5, T0, None)
    assert store.extend(a.batch_id, 5, T0 + 4) == T0 + 9
    assert store.lease(10, 5, T0 + 8, None).batch_id == ""  # still held: not re-queued
    assert store.extend(a.batch_id, 5, T0 + 8) == T0 + 13
    assert store.ack(a.batch_id, T0 + 12) == 2
    with pytest.raises(LeaseExpired, match="acked"):
        store.extend(a.batch_id, 5, T0 + 12)
    with pytest.raises(UnknownLease):
        store.extend("nope", 5, T0)
    store.submit(submission("k9"), T0, None, 0)
    b = store.lease(1, 5, T0 + 20, None)
    with pytest.raises(LeaseExpired, match="expired"):
        store.extend(b.batch_id, 5, T0 + 25)  # too late: the group is back in the queue
    assert store.counters().depth == 1 and store.counters().leased == 0
    c = store.lease(1, 5, T0 + 26, None)
    store.nack(c.batch_id, T0 + 27)
    with pytest.raises(LeaseExpired, match="nacked"):
        store.extend(c.batch_id, 5, T0 + 27)


def test_nack_and_reclaim(store: CoordinatorStore) -> None:
    for i in range(3):
        store.submit(submission(f"k{i}"), T0, None, 0)
    a = store.lease(2, 60, T0, None)
    assert store.nack(a.batch_id, T0 + 1) == 2
    with pytest.raises(LeaseExpired):
        store.nack(a.batch_id, T0 + 1)
    b = store.lease(3, 5, T0 + 1, None)
    assert [m.group_id for m, _ in b.items] == ["g-k0", "g-k1", "g-k2"]
    assert store.reclaim_expired(T0 + 3) == 0
    assert store.reclaim_expired(T0 + 7) == 3
    assert store.counters().depth == 3


def test_stale_dropped_at_pull(store: CoordinatorStore) -> None:
    for i, v in enumerate([1, 4, 2, 5]):
        store.submit(submission(f"k{i}", vmin=v), T0, None, 0)
    got = store.lease(10, 60, T0, min_version=3)
    assert [m.version_min for m, _ in got.items] == [4, 5]
    assert got.dropped_stale == 2
    assert store.counters().dropped == {"stale_at_pull": 2}
    store.count_drop("stale_at_pull", 3)
    assert store.counters().dropped == {"stale_at_pull": 5}


def test_nothing_lost_on_restart(store_factory: StoreFactory) -> None:
    s1 = store_factory()
    s1.add_version(record(0))
    s1.register_worker(WorkerRegistration(worker_id="w1", engine="e", model="m", capacity=1), T0)
    for i in range(3):
        s1.submit(submission(f"k{i}"), T0, None, 0)
    leased = s1.lease(1, 5, T0, None)
    s1.close()
    s2 = store_factory()
    latest = s2.latest_version()
    assert latest is not None and latest.version == 0
    assert s2.get_worker("w1") is not None
    assert s2.submit(submission("k1"), T0, None, 0).status == "duplicate"
    first = s2.lease(10, 60, T0 + 10, None)  # the expired lease comes back too (alone)
    after = s2.lease(10, 60, T0 + 10, None)
    assert [m.group_id for m, _ in first.items + after.items] == ["g-k0", "g-k1", "g-k2"]
    with pytest.raises(LeaseExpired):
        s2.ack(leased.batch_id, T0 + 11)


def test_concurrent_submit_and_lease_lose_nothing(store: CoordinatorStore) -> None:
    """Several threads submit (with retries) while others lease and ack: every group is
    delivered exactly once."""
    n_threads, per = 4, 25
    delivered: list[str] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def producer(t: int) -> None:
        try:
            for i in range(per):
                sub = submission(f"t{t}-{i}")
                store.submit(sub, T0, None, 0)
                store.submit(sub, T0, None, 0)  # retry: must not duplicate
        except BaseException as exc:
            errors.append(exc)

    def consumer() -> None:
        try:
            while not done.is_set() or store.counters().depth:
                got = store.lease(7, 60, T0, None)
                if got.batch_id:
                    delivered.extend(m.group_id for m, _ in got.items)
                    store.ack(got.batch_id, T0)
        except BaseException as exc:
            errors.append(exc)

    producers = [threading.Thread(target=producer, args=(t,)) for t in range(n_threads)]
    consumers = [threading.Thread(target=consumer) for _ in range(2)]
    for th in producers + consumers:
        th.start()
    for th in producers:
        th.join()
    done.set()
    for th in consumers:
        th.join()
    assert not errors
    assert sorted(delivered) == sorted(f"g-t{t}-{i}" for t in range(n_threads) for i in range(per))
    c = store.counters()
    assert (c.submitted_total, c.acked_total, c.duplicates_total) == (100, 100, 100)


def _nonce(i: int) -> str:
    return f"{i:064x}"


def issue(
    store: CoordinatorStore, worker_id: str, version: int, now: float, attempts: int = 3
) -> IssuedChallenge | None:
    """A challenge that expires 10 s after ``now``; workers silent for 10 s are not active."""
    return store.issue_challenge(worker_id, version, now, now + 10, attempts, now - 10)


def test_weight_challenges_issued_once_and_taken_once(store: CoordinatorStore) -> None:
    for wid in ("w1", "w2"):
        store.register_worker(
            WorkerRegistration(worker_id=wid, engine="hf", model="m", capacity=1), T0
        )
    pairs = [(_nonce(i), _nonce(100 + i)) for i in range(3)]
    assert store.add_challenges(4, 64, 16, pairs, keep_from=0) == (3, 3)
    assert store.add_challenges(4, 64, 16, pairs[:1], keep_from=0) == (0, 3)  # known nonce
    assert issue(store, "w1", 9, T0) is None  # no pool for v9
    c1 = issue(store, "w1", 4, T0)
    assert c1 is not None and (c1.version, c1.chunk_bytes, c1.chunks) == (4, 64, 16)
    assert issue(store, "w1", 4, T0 + 1) == c1  # outstanding: the same
    c2 = issue(store, "w2", 4, T0)
    assert c2 is not None and c2.nonce != c1.nonce  # never one pair for two workers
    assert store.take_challenge("w2", c1.nonce) is None  # not w2's
    taken = store.take_challenge("w1", c1.nonce)
    assert taken is not None and taken.version == 4 and taken.expires_at == T0 + 10
    assert taken.answer == dict(pairs)[c1.nonce]
    assert store.take_challenge("w1", c1.nonce) is None  # used once
    # an expired outstanding challenge is replaced by the last pair; then the pool is empty
    c3 = issue(store, "w2", 4, T0 + 20)
    assert c3 is not None and c3.nonce not in {c1.nonce, c2.nonce}
    assert store.take_challenge("w2", c2.nonce) is None  # the replaced one is gone
    assert issue(store, "w1", 4, T0 + 20) is None
    # pools of old versions are dropped
    assert store.add_challenges(70, 64, 16, [(_nonce(9), _nonce(10))], keep_from=7) == (1, 1)
    assert store.add_challenges(4, 64, 0, [(_nonce(11), _nonce(12))], keep_from=7)[1] == 1
    assert store.add_challenges(71, 64, 16, [(_nonce(13), _nonce(14))], keep_from=8) == (1, 1)
    assert issue(store, "w1", 4, T0 + 20) is None


def test_weight_challenges_per_worker_cap_reserve_and_stats(store: CoordinatorStore) -> None:
    """One worker id gets at most ``attempts`` challenges per version (across registrations);
    a retry never takes a pair that an active, not yet challenged worker needs; the stats say
    where the pool stands and who waits."""
    for wid in ("w1", "w2", "w3"):
        store.register_worker(
            WorkerRegistration(worker_id=wid, engine="hf", model="m", capacity=1), T0
        )
        store.heartbeat(wid, WorkerHeartbeat(applied_version=5), T0, 10.0)
    st = store.challenge_stats(5, T0 - 10)
    assert (st.posted, st.pool_size, st.challenged, st.active, st.unchallenged) == (
        False,
        0,
        0,
        3,
        3,
    )
    assert issue(store, "w1", 5, T0) is None  # no pool: nobody counts as waiting
    assert store.challenge_stats(5, T0 - 10).waiting_total == 0
    store.add_challenges(5, 64, 16, [(_nonce(i), _nonce(100 + i)) for i in range(4)], keep_from=0)

    def answer(wid: str, ch: IssuedChallenge | None) -> None:
        assert ch is not None and store.take_challenge(wid, ch.nonce) is not None

    answer("w1", issue(store, "w1", 5, T0))  # first: 3 left, 2 workers unchallenged
    answer("w1", issue(store, "w1", 5, T0 + 1))  # a retry from the surplus: 2 left
    assert issue(store, "w1", 5, T0 + 2) is None  # 2 left are w2's and w3's first ones
    st = store.challenge_stats(5, T0 - 10)
    assert (st.posted, st.pool_size, st.challenged, st.active, st.unchallenged) == (
        True,
        2,
        1,
        3,
        2,
    )
    assert (st.waiting, st.waiting_total) == (1, 1)  # w1: unproven, refused for the reserve
    answer("w2", issue(store, "w2", 5, T0 + 3))
    answer("w3", issue(store, "w3", 5, T0 + 3))
    assert issue(store, "w2", 5, T0 + 4) is None  # the pool is used up: w2 waits too
    st = store.challenge_stats(5, T0 - 10)
    assert (st.pool_size, st.challenged, st.unchallenged, st.waiting) == (0, 3, 0, 2)
    store.record_proof("w2", 5, True, T0 + 5)  # a proven worker waits for nothing
    assert store.challenge_stats(5, T0 - 10).waiting == 1
    assert store.challenge_stats(5, T0 + 10).waiting == 0  # nor does a lost one

    # a top-up: w1 gets its third and last challenge at v5, whatever it does next
    store.add_challenges(5, 64, 16, [(_nonce(i), _nonce(100 + i)) for i in range(4, 9)], 0)
    answer("w1", issue(store, "w1", 5, T0 + 6))
    assert issue(store, "w1", 5, T0 + 7) is None
    store.register_worker(
        WorkerRegistration(worker_id="w1", engine="hf", model="m", capacity=1), T0 + 8
    )
    store.heartbeat("w1", WorkerHeartbeat(applied_version=5), T0 + 8, 10.0)
    assert issue(store, "w1", 5, T0 + 8) is None  # a rejoin does not reset the count
    st = store.challenge_stats(5, T0 - 10)
    assert (st.pool_size, st.waiting) == (4, 0)  # out of attempts is not waiting for the pool
    ch = issue(store, "w1", 5, T0 + 8, attempts=4)  # the count is per version and worker id
    assert ch is not None
    store.add_challenges(6, 64, 16, [(_nonce(20), _nonce(21))], keep_from=0)
    assert issue(store, "w1", 6, T0 + 9) is not None  # a new version: a new count
    # dropping a version's pool drops its counts
    store.add_challenges(7, 64, 16, [(_nonce(22), _nonce(23))], keep_from=6)
    st = store.challenge_stats(5, T0 - 10)
    assert (st.posted, st.pool_size, st.challenged) == (False, 0, 0)
    assert issue(store, "w2", 5, T0 + 9) is None


def test_proofs_recorded_and_reset_by_registration(store: CoordinatorStore) -> None:
    reg = WorkerRegistration(worker_id="w1", engine="hf", model="m", capacity=1)
    store.register_worker(reg, T0)
    assert store.record_proof("nobody", 1, True, T0) is None
    w = store.record_proof("w1", 3, False, T0 + 1)
    assert w is not None and (w.failed_version, w.proof_failures, w.proven_version) == (3, 1, None)
    w = store.record_proof("w1", 3, True, T0 + 2)
    assert w is not None and (w.proven_version, w.proven_at, w.proof_failures) == (3, T0 + 2, 1)
    got = store.get_worker("w1")
    assert got is not None and got.proven_version == 3
    assert [x.proven_version for x in store.list_workers()] == [3]
    hb = store.heartbeat("w1", WorkerHeartbeat(applied_version=3), T0 + 3, 10.0)
    assert hb is not None and hb.proven_version == 3  # heartbeats keep proofs
    store.add_challenges(3, 64, 16, [(_nonce(1), _nonce(2))], keep_from=0)
    assert issue(store, "w1", 3, T0) is not None
    w = store.register_worker(reg, T0 + 4)  # a restart: proofs and the outstanding one go
    assert (w.proven_version, w.proven_at, w.failed_version, w.proof_failures) == (
        None,
        None,
        None,
        0,
    )
    assert store.take_challenge("w1", _nonce(1)) is None
    store.remove_worker("w1")
    assert store.record_proof("w1", 3, True, T0) is None


# -- dead letters: a group the trainer cannot train on never loops through the queue ----------


def test_rejected_groups_become_dead_letters_and_count_against_their_worker(
    store: CoordinatorStore,
) -> None:
    for i, worker in enumerate(["w1", "w2", "w1"]):
        store.submit(submission(f"k{i}", worker=worker), T0 + i, None, 0)
    a = store.lease(3, 60, T0 + 10, None)
    ids = [m.submission_id for m, _ in a.items]
    bad = [Rejection(ids[0], "bad_token_id", "token 9 >= vocab 4"), Rejection(ids[1], "x", "y")]
    assert store.ack(a.batch_id, T0 + 11, bad) == 3
    assert store.ack(a.batch_id, T0 + 12, bad) == 3  # a repeated ack changes nothing
    count, dead = store.dead_letters(10)
    assert count == 2 and [d.submission_id for d in dead] == [ids[1], ids[0]]  # newest first
    assert (dead[1].worker_id, dead[1].reason, dead[1].detail) == (
        "w1",
        "bad_token_id",
        "token 9 >= vocab 4",
    )
    assert dead[1].deliveries == 1 and dead[1].dead_at == T0 + 11
    assert dead[1].group_id == "g-k0" and dead[1].submitted_at == T0
    rej = store.worker_rejections()
    assert sorted(rej) == ["w1", "w2"]
    assert (rej["w1"].rejected, rej["w1"].last_reason) == (1, "bad_token_id")
    assert rej["w2"].last_at == T0 + 11
    c = store.counters()
    assert (c.depth, c.leased, c.dead_letters) == (0, 0, 2)
    assert c.rejected == {"bad_token_id": 1, "x": 1}
    assert store.lease(10, 60, T0 + 13, None).batch_id == ""  # never leased again


def test_ack_refuses_a_rejection_outside_its_batch_and_changes_nothing(
    store: CoordinatorStore,
) -> None:
    for i in range(3):
        store.submit(submission(f"k{i}"), T0, None, 0)
    a = store.lease(2, 60, T0, None)
    other = store.lease(1, 60, T0, None)
    mine = a.items[0][0].submission_id
    theirs = other.items[0][0].submission_id
    for wrong in ([Rejection(theirs, "r", "d")], [Rejection(mine, "r", "d")] * 2):
        with pytest.raises(StoreError, match="not a group of batch"):
            store.ack(a.batch_id, T0 + 1, wrong)
    assert store.counters().leased == 3 and store.dead_letters(10)[0] == 0
    assert store.ack(a.batch_id, T0 + 1) == 2  # the lease is still whole


def test_a_group_leased_twice_without_an_ack_is_set_aside(store: CoordinatorStore) -> None:
    for i in range(2):
        store.submit(submission(f"k{i}"), T0, None, 0)
    first = store.lease(1, 5, T0, None)  # the trainer dies holding k0: the lease expires
    n = store.nack(store.lease(1, 5, T0, None).batch_id, T0)  # k1 returned on purpose
    assert n == 1
    second = store.lease(2, 5, T0 + 6, None)  # k0's second delivery: alone
    assert [(m.group_id, m.deliveries) for m, _ in second.items] == [("g-k0", 2)]
    store.nack(second.batch_id, T0 + 7)  # a nack does not count as a delivery...
    third = store.lease(2, 5, T0 + 8, None)
    assert [(m.group_id, m.deliveries) for m, _ in third.items] == [("g-k0", 2)]
    k1 = store.lease(2, 5, T0 + 8, None)
    assert [(m.group_id, m.deliveries) for m, _ in k1.items] == [("g-k1", 1)]
    # ...an expiry does: k0 has now expired twice, k1 once
    fourth = store.lease(2, 5, T0 + 20, None)
    assert [(m.group_id, m.deliveries) for m, _ in fourth.items] == [("g-k1", 2)]
    count, dead = store.dead_letters(10)
    assert count == 1 and dead[0].group_id == "g-k0" and dead[0].reason == "undelivered"
    assert dead[0].deliveries == 2
    assert store.counters().dropped == {"undelivered": 1}
    assert store.worker_rejections() == {}  # not the worker's fault: not counted against it
    assert first.batch_id != second.batch_id


def test_a_dead_letter_can_be_requeued(store_factory: StoreFactory) -> None:
    store = store_factory()
    for i in range(2):
        store.submit(submission(f"k{i}"), T0, None, 0)
    a = store.lease(2, 60, T0, None)
    sid = a.items[0][0].submission_id
    store.ack(a.batch_id, T0 + 1, [Rejection(sid, "sampling_mismatch", "kl 2.3")])
    store.submit(submission("k2"), T0 + 2, None, 0)
    restarted = store_factory()  # dead letters are durable
    assert restarted.dead_letters(10)[0] == 1
    assert restarted.requeue_dead_letter(sid) and not restarted.requeue_dead_letter(sid)
    assert not restarted.requeue_dead_letter(999_999)
    again = restarted.lease(10, 60, T0 + 3, None)
    assert [m.group_id for m, _ in again.items] == ["g-k0", "g-k2"]  # ahead of newer groups
    assert restarted.dead_letters(10) == (0, [])
    assert restarted.worker_rejections()["w1"].rejected == 1  # the record of it stays


def test_rejections_outlive_reregistration_and_removal(store: CoordinatorStore) -> None:
    reg = WorkerRegistration(worker_id="w1", engine="e", model="m", capacity=1)
    store.register_worker(reg, T0)
    store.submit(submission("k0"), T0, None, 0)
    a = store.lease(1, 60, T0, None)
    store.ack(a.batch_id, T0, [Rejection(a.items[0][0].submission_id, "r", "d")])
    store.register_worker(reg, T0 + 1)
    store.remove_worker("w1")
    store.register_worker(reg, T0 + 2)
    assert store.worker_rejections()["w1"].rejected == 1
    assert store.clear_rejections("w1") and not store.clear_rejections("w1")
    assert store.worker_rejections() == {}


def test_lease_stops_at_its_byte_bound(store: CoordinatorStore) -> None:
    for i in range(4):
        store.submit(submission(f"k{i}"), T0, None, 0)
    size = len(submission("k0").payload)
    a = store.lease(10, 60, T0, None, max_bytes=2 * size + 1)
    assert [m.group_id for m, _ in a.items] == ["g-k0", "g-k1"]
    b = store.lease(10, 60, T0, None, max_bytes=1)  # one group always, whatever its size
    assert [m.group_id for m, _ in b.items] == ["g-k2"]
    assert store.counters().depth == 1


def test_dead_letters_are_bounded(store_factory: StoreFactory) -> None:
    store = store_factory(max_dead_letters=2)
    for i in range(3):
        store.submit(submission(f"k{i}"), T0 + i, None, 0)
    a = store.lease(3, 60, T0, None)
    ids = [m.submission_id for m, _ in a.items]
    store.ack(a.batch_id, T0 + 1, [Rejection(sid, "r", "d") for sid in ids])
    count, dead = store.dead_letters(10)
    assert count == 2 and len(dead) == 2
    assert ids[0] not in {d.submission_id for d in dead}  # the oldest went first
    assert store.counters().dropped.get("dead_letter_evicted") == 1
    dup = store.submit(submission("k0"), T0 + 5, None, 0)
    assert dup.status == "duplicate"  # an evicted group's key still marks its retries
