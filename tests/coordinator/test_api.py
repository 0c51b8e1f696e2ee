"""The HTTP API through the typed client against a live server: happy paths and bad input."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import msgpack
import pytest
from pydantic import ValidationError
from support import GENEROUS_S

from deltarl.services.coordinator.client import CoordinatorClient, CoordinatorError
from deltarl.services.coordinator.schemas import (
    VersionRecord,
    WorkerHeartbeat,
    WorkerRegistration,
    encode_group,
    manifest_digest,
)

from .conftest import TRAINER_TOKEN, WORKER_TOKEN, LiveServer
from .helpers import digest, group, manifest


class Clock:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


def clients(s: LiveServer) -> tuple[CoordinatorClient, CoordinatorClient, CoordinatorClient]:
    return (
        CoordinatorClient(s.url, TRAINER_TOKEN, retries=0),
        CoordinatorClient(s.url, WORKER_TOKEN, retries=0),
        CoordinatorClient(s.url, retries=0),
    )


def reg(worker_id: str = "w1") -> WorkerRegistration:
    return WorkerRegistration(worker_id=worker_id, engine="vllm", model="smollm2", capacity=4)


def test_full_cycle(server: LiveServer) -> None:
    trainer, worker, anon = clients(server)
    assert anon.health().status == "healthy"
    assert anon.latest_version() is None
    rec = trainer.publish_version(manifest(0))
    assert (rec.version, rec.kind, rec.anchor_version, rec.bytes) == (0, "anchor", 0, 50_000)
    assert trainer.publish_version(manifest(0)) == rec  # an identical retry is fine
    rec1 = trainer.publish_version(manifest(1))
    assert (rec1.kind, rec1.delta_bytes, rec1.previous_version, rec1.anchor_version) == (
        "delta",
        1000,
        0,
        0,
    )
    ack = worker.register(reg())
    assert ack.latest_version == 1 and ack.worker.state == "active" and ack.max_staleness == 4
    hb = worker.heartbeat("w1", WorkerHeartbeat(applied_version=0, in_flight=2))
    assert hb.worker.lag_versions == 1 and hb.worker.in_flight == 2
    res = worker.submit(group("key-1", vmin=0, vmax=1))
    assert not res.duplicate and res.queue_depth == 1 and res.current_version == 1
    again = worker.submit(group("key-1", vmin=0, vmax=1))
    assert again.duplicate and again.submission_id == res.submission_id
    batch = trainer.lease(8, lease_s=30)
    assert [g.idempotency_key for g in batch.groups] == ["key-1"]
    assert batch.groups[0] == group("key-1", vmin=0, vmax=1)
    assert batch.lease.items[0].worker_id == "w1" and batch.lease.current_version == 1
    assert trainer.ack(batch.lease.batch_id).acked == 1
    empty = trainer.lease(8)
    assert empty.lease.batch_id == "" and empty.groups == []
    st = anon.status()
    assert (st.latest_version, st.latest_anchor, st.trainer_step) == (1, 0, 1)
    assert (st.queue.submitted_total, st.queue.acked_total, st.queue.duplicates_total) == (1, 1, 1)
    assert st.workers[0].worker_id == "w1" and st.staleness_hist == {"1": 1}
    assert [p.version for p in st.versions] == [0, 1] and st.rewards[0].mean_reward == 0.5
    assert [w.worker_id for w in anon.workers()] == ["w1"]
    assert [v.version for v in anon.versions(after=0)] == [1]
    assert anon.get_version(1) == rec1


def test_a_reported_digest_is_only_a_self_report(server: LiveServer) -> None:
    """The state digest is public: a worker reporting it proves nothing, so it
    sets digest_matches, never weights_verified."""
    trainer, worker, anon = clients(server)
    trainer.publish_version(manifest(0))
    trainer.publish_version(manifest(1))
    worker.register(reg())
    copied = anon.get_version(1).state_digest  # anyone can read it
    hb = worker.heartbeat("w1", WorkerHeartbeat(applied_version=1, weights_digest=copied))
    assert hb.worker.digest_matches is True and hb.worker.weights_digest == copied
    assert hb.worker.weights_verified is None and hb.challenge is None  # no challenge pool yet
    hb = worker.heartbeat("w1", WorkerHeartbeat(applied_version=1, weights_digest=digest(0)))
    assert hb.worker.digest_matches is False and anon.workers()[0].digest_matches is False
    hb = worker.heartbeat("w1", WorkerHeartbeat(applied_version=1))
    assert hb.worker.digest_matches is None and hb.worker.weights_digest is None
    with pytest.raises(ValidationError, match="weights_digest"):
        WorkerHeartbeat(applied_version=1, weights_digest="not hex")


def test_auth_roles(server: LiveServer) -> None:
    trainer, worker, anon = clients(server)
    with pytest.raises(CoordinatorError) as e:
        anon.publish_version(manifest(0))
    assert e.value.status_code == 401 and "trainer token" in e.value.message
    with pytest.raises(CoordinatorError) as e:
        worker.publish_version(manifest(0))  # the worker token does not grant the trainer role
    assert e.value.status_code == 403
    with pytest.raises(CoordinatorError) as e:
        trainer.register(reg())
    assert e.value.status_code == 403
    # Authorization: Bearer works too (when not behind the Spaces proxy)
    r = httpx.post(
        server.url + "/v1/versions",
        json={"manifest": manifest(0).model_dump(mode="json")},
        headers={"Authorization": f"Bearer {TRAINER_TOKEN}"},
    )
    assert r.status_code == 201
    assert anon.status().latest_version == 0  # reads are public by default


def test_private_reads(make_server: Callable[..., LiveServer]) -> None:
    s = make_server(public_reads=False, read_token="reader-secret-token")
    trainer, worker, anon = clients(s)
    with pytest.raises(CoordinatorError) as e:
        anon.status()
    assert e.value.status_code == 401
    assert trainer.status().latest_version is None
    assert worker.status().latest_version is None
    assert CoordinatorClient(s.url, "reader-secret-token").status().latest_version is None
    assert anon.health().status == "healthy"  # health stays public


def error_of(r: httpx.Response) -> tuple[int, str, str]:
    body = r.json()["error"]
    return r.status_code, body["code"], body["message"]


def test_bad_input_is_4xx_json_and_data_stays_intact(server: LiveServer) -> None:
    trainer, worker, anon = clients(server)
    t = {"X-Deltarl-Token": TRAINER_TOKEN}
    w = {"X-Deltarl-Token": WORKER_TOKEN}
    url = server.url
    trainer.publish_version(manifest(0))
    trainer.publish_version(manifest(1))
    worker.register(reg())
    worker.submit(group("ok-1", vmin=1))

    cases = [
        # malformed JSON
        (
            httpx.post(
                url + "/v1/versions",
                content=b"{nope",
                headers={**t, "Content-Type": "application/json"},
            ),
            422,
            "validation_error",
            "not valid JSON",
        ),
        # wrong types
        (
            httpx.post(
                url + "/v1/workers", json={**reg().model_dump(), "capacity": "many"}, headers=w
            ),
            422,
            "validation_error",
            "capacity",
        ),
        # unknown fields
        (
            httpx.post(url + "/v1/workers", json={**reg().model_dump(), "gpu": 1}, headers=w),
            422,
            "validation_error",
            "gpu",
        ),
        # unknown version / worker / batch
        (httpx.get(url + "/v1/versions/99"), 404, "unknown_version", "never recorded"),
        (
            httpx.post(url + "/v1/workers/ghost/heartbeat", json={}, headers=w),
            404,
            "unknown_worker",
            "register",
        ),
        (httpx.post(url + "/v1/batches/nope/ack", headers=t), 404, "unknown_batch", "nope"),
        (httpx.get(url + "/v1/nothing-here"), 404, "not_found", "Not Found"),
        # duplicate with other content, out of order
        (
            httpx.post(
                url + "/v1/versions",
                json={"manifest": manifest(1, anchor=True).model_dump(mode="json")},
                headers=t,
            ),
            409,
            "version_conflict",
            "different manifest",
        ),
        (
            httpx.post(
                url + "/v1/versions",
                json={"manifest": manifest(5, base=4).model_dump(mode="json")},
                headers=t,
            ),
            404,
            "unknown_version",
            "never recorded",
        ),
        # heartbeat from the future
        (
            httpx.post(url + "/v1/workers/w1/heartbeat", json={"applied_version": 7}, headers=w),
            409,
            "future_version",
            "newer than the latest",
        ),
        # trajectories: wrong media type, garbage, future version, unknown worker
        (
            httpx.post(url + "/v1/trajectories", json={"a": 1}, headers=w),
            415,
            "unsupported_media_type",
            "msgpack",
        ),
        (
            httpx.post(
                url + "/v1/trajectories",
                content=b"\xc1garbage",
                headers={**w, "Content-Type": "application/msgpack"},
            ),
            422,
            "bad_payload",
            "not valid msgpack",
        ),
        (
            httpx.post(
                url + "/v1/trajectories",
                content=encode_group(group("f-1", vmin=2)),
                headers={**w, "Content-Type": "application/msgpack"},
            ),
            409,
            "future_version",
            "newer than the latest",
        ),
        (
            httpx.post(
                url + "/v1/trajectories",
                content=encode_group(group("u-1", worker="ghost")),
                headers={**w, "Content-Type": "application/msgpack"},
            ),
            404,
            "unknown_worker",
            "not registered",
        ),
        # bad lease arguments
        (
            httpx.post(url + "/v1/batches/lease", json={"max_groups": 0}, headers=t),
            422,
            "validation_error",
            "max_groups",
        ),
        (
            httpx.post(url + "/v1/batches/lease", json={"max_groups": 5000}, headers=t),
            422,
            "bad_batch_size",
            "1..1024",
        ),
    ]
    for r, status, code, message in cases:
        got = error_of(r)
        assert got[:2] == (status, code), (got, r.request.url)
        assert message in got[2], got
    # an out-of-order publish (older than the latest) is refused
    trainer.publish_version(manifest(3, base=1))
    with pytest.raises(CoordinatorError) as e:
        trainer.publish_version(manifest(2))
    assert (e.value.status_code, e.value.code) == (409, "version_out_of_order")
    # a delta whose base digest does not match the recorded base state
    bad = manifest(4).model_dump(mode="json")
    bad["objects"][0]["base_digest"] = "e" * 32
    r = httpx.post(url + "/v1/versions", json={"manifest": bad}, headers=t)
    assert error_of(r)[:2] == (409, "base_digest_mismatch")
    # reused idempotency key with another payload
    with pytest.raises(CoordinatorError) as e:
        worker.submit(group("ok-1", vmin=1, reward=0.9))
    assert (e.value.status_code, e.value.code) == (409, "idempotency_conflict")
    # accepted data intact
    st = anon.status()
    assert st.latest_version == 3 and st.queue.depth == 1 and st.queue.submitted_total == 1
    batch = trainer.lease(10)
    assert [g.idempotency_key for g in batch.groups] == ["ok-1"]


def test_oversize_bodies_refused(make_server: Callable[..., LiveServer]) -> None:
    s = make_server(max_body_bytes=4096, max_json_bytes=2048)
    trainer, worker, _ = clients(s)
    trainer.publish_version(manifest(0))
    worker.register(reg())
    big = group("big-1", n=1)
    big.trajectories[0].tokens = list(range(2000))
    big.trajectories[0].logprobs = [0.0] * 2000
    big.trajectories[0].mask = [0] * 2000
    with pytest.raises(CoordinatorError) as e:
        worker.submit(big)
    assert (e.value.status_code, e.value.code) == (413, "body_too_large")
    r = httpx.post(
        s.url + "/v1/workers",
        content=json.dumps({"worker_id": "x" * 10, "pad": "y" * 5000}),
        headers={"X-Deltarl-Token": WORKER_TOKEN, "Content-Type": "application/json"},
    )
    assert error_of(r)[:2] == (413, "body_too_large")

    def chunks() -> bytes:  # no Content-Length: the limit is enforced while streaming
        return encode_group(big)

    r = httpx.post(
        s.url + "/v1/trajectories",
        content=iter([chunks()[:3000], chunks()[3000:]]),
        headers={"X-Deltarl-Token": WORKER_TOKEN, "Content-Type": "application/msgpack"},
    )
    assert error_of(r)[:2] == (413, "body_too_large")
    assert worker.submit(group("small-1")).queue_depth == 1


def test_staleness_at_submit_and_pull(server: LiveServer) -> None:
    trainer, worker, anon = clients(server)
    trainer.publish_version(manifest(0))
    worker.register(reg())
    worker.submit(group("old-1", vmin=0))
    for v in range(1, 6):
        trainer.publish_version(manifest(v))
    # latest 5, max_staleness 4: version 0 is now too old
    with pytest.raises(CoordinatorError) as e:
        worker.submit(group("old-2", vmin=0))
    assert (e.value.status_code, e.value.code) == (409, "stale_version")
    assert "max_staleness=4" in e.value.message and e.value.detail["min_version"] == 1
    worker.submit(group("new-1", vmin=1, vmax=5))
    batch = trainer.lease(10)
    assert [g.idempotency_key for g in batch.groups] == ["new-1"]
    assert batch.lease.dropped_stale == 1
    assert anon.status().queue.dropped == {"stale_at_submit": 1, "stale_at_pull": 1}
    worker.heartbeat("w1", WorkerHeartbeat(applied_version=3))
    metrics = anon.metrics_text()
    for line in (
        'deltarl_coordinator_dropped_groups_total{reason="stale_at_pull"} 1.0',
        'deltarl_coordinator_dropped_groups_total{reason="stale_at_submit"} 1.0',
        "deltarl_coordinator_latest_version 5.0",
        "deltarl_coordinator_queue_depth 0.0",
        "deltarl_coordinator_submitted_groups_total 2.0",
        'deltarl_coordinator_worker_lag_versions{worker="w1"} 2.0',
        'deltarl_coordinator_workers{state="active"} 1.0',
        'deltarl_coordinator_latest_version_bytes{kind="delta"} 1000.0',
        'deltarl_coordinator_version_bytes_count{kind="delta"} 5.0',
        'deltarl_coordinator_request_seconds_count{method="POST",route="/v1/trajectories",'
        'status="409"} 1.0',
        "deltarl_coordinator_queue_wait_seconds_count 1.0",
    ):
        assert line in metrics, line


def test_workers_lost_and_rejoin(make_server: Callable[..., LiveServer]) -> None:
    clock = Clock()
    s = make_server(clock=clock, lost_after_s=5)
    trainer, worker, anon = clients(s)
    trainer.publish_version(manifest(0))
    worker.register(reg("w1"))
    worker.register(reg("w2"))
    clock.t += 3
    worker.heartbeat("w2", WorkerHeartbeat(applied_version=0))
    clock.t += 3
    states = {w.worker_id: w.state for w in anon.workers()}
    assert states == {"w1": "lost", "w2": "active"}
    st = anon.status()
    assert (st.workers_active, st.workers_lost) == (1, 1)
    back = worker.heartbeat("w1", WorkerHeartbeat(applied_version=0))
    assert back.worker.state == "active" and back.worker.rejoins == 1
    worker.remove_worker("w2")
    assert [w.worker_id for w in anon.workers()] == ["w1"]
    with pytest.raises(CoordinatorError) as e:
        worker.heartbeat("w2", WorkerHeartbeat())
    assert e.value.code == "unknown_worker"
    again = worker.register(reg("w2"))  # elastic: join again at any time
    assert again.worker.state == "active"


def test_lag_seconds(make_server: Callable[..., LiveServer]) -> None:
    clock = Clock()
    s = make_server(clock=clock)
    trainer, worker, _ = clients(s)
    trainer.publish_version(manifest(0))
    worker.register(reg())
    clock.t += 10
    trainer.publish_version(manifest(1))
    clock.t += 4
    hb = worker.heartbeat("w1", WorkerHeartbeat(applied_version=0))
    assert hb.worker.lag_versions == 1 and hb.worker.lag_seconds == pytest.approx(4)
    hb = worker.heartbeat("w1", WorkerHeartbeat(applied_version=1))
    assert hb.worker.lag_versions == 0 and hb.worker.lag_seconds == 0


def test_lease_expiry_and_nack(make_server: Callable[..., LiveServer]) -> None:
    clock = Clock()
    s = make_server(clock=clock)
    trainer, worker, _ = clients(s)
    trainer.publish_version(manifest(0))
    worker.register(reg())
    for i in range(3):
        worker.submit(group(f"k{i}"))
    first = trainer.lease(2, lease_s=10)
    clock.t += 11
    with pytest.raises(CoordinatorError) as e:
        trainer.ack(first.lease.batch_id)
    assert (e.value.status_code, e.value.code) == (409, "lease_expired")
    # the expired groups come back first, each alone (a trainer may have died on it)
    back = [trainer.lease(3, lease_s=10) for _ in range(2)]
    assert [[g.idempotency_key for g in b.groups] for b in back] == [["k0"], ["k1"]]
    assert [b.lease.items[0].deliveries for b in back] == [2, 2]
    second = trainer.lease(3, lease_s=10)
    assert [g.idempotency_key for g in second.groups] == ["k2"]
    for b in back:
        assert trainer.nack(b.lease.batch_id).acked == 1
    assert trainer.nack(second.lease.batch_id).acked == 1
    got = [trainer.lease(3, lease_s=10) for _ in range(3)]
    assert [len(b.groups) for b in got] == [1, 1, 1]  # a nack keeps them delivered once
    assert sum(trainer.ack(b.lease.batch_id).acked for b in got) == 3


def test_extend_keeps_a_lease_past_its_first_expiry(make_server: Callable[..., LiveServer]) -> None:
    clock = Clock()
    s = make_server(clock=clock)
    trainer, worker, _ = clients(s)
    trainer.publish_version(manifest(0))
    worker.register(reg())
    worker.submit(group("k0"))
    held = trainer.lease(1, lease_s=10)
    bid = held.lease.batch_id
    clock.t += 8
    ext = trainer.extend(bid, lease_s=10)
    assert ext.batch_id == bid and ext.expires_at == pytest.approx(clock.t + 10)
    clock.t += 8  # past the first expiry, within the extension
    assert trainer.lease(1).groups == []
    assert trainer.ack(bid).acked == 1
    for bad, status, code in ((bid, 409, "lease_expired"), ("nope", 404, "unknown_batch")):
        with pytest.raises(CoordinatorError) as e:
            trainer.extend(bad)
        assert (e.value.status_code, e.value.code) == (status, code)
    with pytest.raises(CoordinatorError) as e:
        trainer.extend(bid, lease_s=1e9)
    assert e.value.status_code == 422


def test_long_poll_lease(server: LiveServer) -> None:
    import threading
    import time

    trainer, worker, _ = clients(server)
    trainer.publish_version(manifest(0))
    worker.register(reg())
    threading.Timer(0.3, lambda: worker.submit(group("late-1"))).start()
    t0 = time.monotonic()
    batch = trainer.lease(4, wait_s=60)
    assert [g.idempotency_key for g in batch.groups] == ["late-1"]
    # it waited for the submit, and the submit (not the end of the 60 s wait) answered it
    assert 0.2 < time.monotonic() - t0 < GENEROUS_S


def test_admission(server: LiveServer) -> None:
    trainer, worker, _ = clients(server)
    worker.register(reg())
    assert worker.admission("w1", 5).reason == "no_version"
    trainer.publish_version(manifest(0))
    a = worker.admission("w1", 5, applied_version=0)
    assert (a.grant, a.reason, a.target_queue_groups) == (5, "ok", 256)
    worker.heartbeat("w1", WorkerHeartbeat(applied_version=0, in_flight=254))
    a = worker.admission("w1", 5, applied_version=0)
    assert (a.grant, a.in_flight) == (2, 254)
    worker.submit(group("q1"))
    worker.submit(group("q2"))
    a = worker.admission("w1", 5, applied_version=0)
    assert (a.grant, a.reason, a.queue_depth) == (0, "queue_full", 2)
    for v in range(1, 5):
        trainer.publish_version(manifest(v))
    a = worker.admission("w1", 5, applied_version=0)
    assert (a.grant, a.reason) == (0, "update_weights")


@pytest.mark.parametrize(("max_staleness", "refused_from"), [(0, 1), (1, 1), (2, 2)])
def test_admission_refuses_a_worker_whose_groups_would_arrive_stale(
    make_server: Callable[..., LiveServer], max_staleness: int, refused_from: int
) -> None:
    """A worker at the newest version is always admitted (on-policy runs, max_staleness = 0,
    included); one lagging max(1, max_staleness) versions or more must catch up first."""
    trainer, worker, _ = clients(make_server(max_staleness=max_staleness))
    worker.register(reg())
    for v in range(4):
        trainer.publish_version(manifest(v))
    for lag in range(4):
        a = worker.admission("w1", 2, applied_version=3 - lag)
        want = (0, "update_weights") if lag >= refused_from else (2, "ok")
        assert (a.grant, a.reason) == want, lag


def test_a_version_is_recorded_as_a_summary_and_the_manifest_stays_in_the_bucket(
    server: LiveServer,
) -> None:
    """The record holds the manifest's digest, never the manifest; a re-publish that differs
    only where the summary does not look (an object's checksum) is still refused."""
    trainer, _, anon = clients(server)
    m0 = manifest(0)
    trainer.publish_version(m0)
    body = httpx.get(server.url + "/v1/versions/0").json()
    assert "manifest" not in body and body["manifest_digest"] == manifest_digest(m0)
    assert anon.latest_version() == VersionRecord.model_validate(body)
    m1 = manifest(1)
    trainer.publish_version(m1)
    other = m1.objects[0].model_copy(update={"xxh3_128": "2" * 32})  # same size, same bases
    with pytest.raises(CoordinatorError) as e:
        trainer.publish_version(m1.model_copy(update={"objects": (other,)}))
    assert (e.value.status_code, e.value.code) == (409, "version_conflict")
    other_json = json.dumps(m1.model_dump(mode="json"), sort_keys=True, indent=3)
    r = httpx.post(  # the same manifest written as other JSON: an identical retry
        server.url + "/v1/versions",
        content='{"manifest": ' + other_json + "}",
        headers={"X-Deltarl-Token": TRAINER_TOKEN, "Content-Type": "application/json"},
    )
    assert r.status_code == 200 and r.json()["manifest_digest"] == manifest_digest(m1)


def test_openapi_lists_every_route(server: LiveServer) -> None:
    spec = httpx.get(server.url + "/openapi.json").json()
    assert {
        "/health",
        "/metrics",
        "/v1/versions",
        "/v1/versions/latest",
        "/v1/versions/events",
        "/v1/versions/{version}",
        "/v1/workers",
        "/v1/workers/{worker_id}",
        "/v1/workers/{worker_id}/heartbeat",
        "/v1/trajectories",
        "/v1/batches/lease",
        "/v1/batches/{batch_id}/ack",
        "/v1/batches/{batch_id}/nack",
        "/v1/batches/{batch_id}/extend",
        "/v1/admission",
        "/v1/status",
    } <= set(spec["paths"])
    assert "/v1/plan" not in spec["paths"]  # workers plan from the bucket's manifests


def test_msgpack_batch_has_raw_arrays(server: LiveServer) -> None:
    trainer, worker, _ = clients(server)
    trainer.publish_version(manifest(0))
    worker.register(reg())
    worker.submit(group("raw-1"))
    r = httpx.post(
        server.url + "/v1/batches/lease",
        json={"max_groups": 1},
        headers={"X-Deltarl-Token": TRAINER_TOKEN},
    )
    assert r.headers["content-type"] == "application/msgpack"
    body = msgpack.unpackb(r.content)
    inner = msgpack.unpackb(body["payloads"][0])
    assert isinstance(inner["trajectories"][0]["logprobs"], bytes)
