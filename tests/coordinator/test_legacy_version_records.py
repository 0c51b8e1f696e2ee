"""A store written by coordinators that kept each version's whole manifest in its record still
opens: those records read as summaries carrying the manifest's digest, a retried publish of such
a version is told apart from a different one, and new versions chain onto them."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from deltarl.services.coordinator.client import CoordinatorClient, CoordinatorError
from deltarl.services.coordinator.schemas import VersionManifest, VersionRecord, manifest_digest
from deltarl.services.coordinator.store.base import load_version_record
from deltarl.services.coordinator.versions import summarize

from .conftest import TRAINER_TOKEN, LiveServer, RedisServer
from .helpers import manifest


def legacy_body(m: VersionManifest, previous: VersionRecord | None) -> str:
    """A record as the older coordinators stored it: the summary with the manifest inside and
    no manifest_digest."""
    doc = summarize(m, previous, 1.0).model_dump(mode="json", exclude={"manifest_digest"})
    return json.dumps({**doc, "manifest": m.model_dump(mode="json")})


def legacy_records() -> list[tuple[int, str, str]]:
    """``(version, kind, body)`` of versions 0 (anchor) and 1 (delta)."""
    r0 = summarize(manifest(0), None, 1.0)
    return [
        (0, "anchor", legacy_body(manifest(0), None)),
        (1, "delta", legacy_body(manifest(1), r0)),
    ]


def write_sqlite(path: Path) -> None:
    db = sqlite3.connect(path)
    db.execute(
        "CREATE TABLE versions (version INTEGER PRIMARY KEY, kind TEXT NOT NULL, body TEXT NOT NULL)"
    )
    db.executemany("INSERT INTO versions VALUES (?, ?, ?)", legacy_records())
    db.commit()
    db.close()


def write_redis(url: str, prefix: str) -> None:
    import redis

    r = redis.Redis.from_url(url)
    for version, kind, body in legacy_records():
        r.hset(f"{prefix}:v", str(version), body)
        r.zadd(f"{prefix}:v:idx", {str(version): version})
        r.set(f"{prefix}:v:latest", str(version))
        if kind == "anchor":
            r.set(f"{prefix}:v:anchor", str(version))
    r.close()


def test_a_legacy_record_reads_as_its_summary() -> None:
    _, _, body = legacy_records()[1]
    assert '"manifest"' in body
    got = load_version_record(body)
    want = summarize(manifest(1), summarize(manifest(0), None, 1.0), 1.0)
    assert got == want and got.manifest_digest == manifest_digest(manifest(1))
    assert load_version_record(want.model_dump_json().encode()) == want  # today's records


@pytest.mark.parametrize("backend", ["sqlite", "redis"])
def test_a_store_with_manifests_in_its_records_still_opens(
    backend: str,
    tmp_path: Path,
    make_server: Callable[..., LiveServer],
    request: pytest.FixtureRequest,
) -> None:
    if backend == "sqlite":
        write_sqlite(tmp_path / "coord.sqlite3")  # the path the test server opens
        server = make_server()
    else:
        redis_server: RedisServer = request.getfixturevalue("redis_server")
        prefix = f"legacy{time.time_ns()}"
        write_redis(redis_server.url, prefix)
        server = make_server(store="redis", redis_url=redis_server.url, redis_prefix=prefix)
    trainer = CoordinatorClient(server.url, TRAINER_TOKEN, retries=0)
    body = httpx.get(server.url + "/v1/versions/1").json()
    assert "manifest" not in body and body["manifest_digest"] == manifest_digest(manifest(1))
    assert [v.version for v in trainer.versions()] == [0, 1]
    # a retried publish of a version the older coordinator recorded: accepted, nothing new
    r = httpx.post(
        server.url + "/v1/versions",
        json={"manifest": manifest(1).model_dump(mode="json")},
        headers={"X-Deltarl-Token": TRAINER_TOKEN},
    )
    assert r.status_code == 200, r.text
    # a different manifest for it (one object's checksum): refused
    m1 = manifest(1)
    other = m1.objects[0].model_copy(update={"xxh3_128": "2" * 32})
    with pytest.raises(CoordinatorError) as e:
        trainer.publish_version(m1.model_copy(update={"objects": (other,)}))
    assert e.value.code == "version_conflict"
    # new versions chain onto the old records, their deltas checked against those digests
    m3 = manifest(3, base=1)
    wrong = m3.objects[0].model_copy(update={"base_digest": "e" * 32})
    with pytest.raises(CoordinatorError) as e:
        trainer.publish_version(m3.model_copy(update={"objects": (wrong,)}))
    assert e.value.code == "base_digest_mismatch"
    rec2 = trainer.publish_version(manifest(2))
    assert (rec2.version, rec2.previous_version, rec2.anchor_version) == (2, 1, 0)
