"""The publication protocol on a real directory: ordering, crashes mid-publish, corruption."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import pytest

from deltarl.buckets import Bucket, ObjectInfo
from deltarl.buckets.local import LocalBucket
from deltarl.weightsync.errors import BaseMismatchError, CorruptDeltaError
from deltarl.weightsync.manifest import (
    LATEST_KEY,
    LatestPointer,
    VersionManifest,
    manifest_key,
    xxh3_hex,
)
from deltarl.weightsync.reader import BucketReader, VersionNotFoundError
from deltarl.weightsync.writer import BucketWriter, NewObject


def digest(v: int) -> str:
    return xxh3_hex(f"state-{v}".encode())


def anchor_obj(v: int, size: int = 400) -> NewObject:
    return NewObject("anchor", "safetensors", bytes([v % 251]) * size)


def delta_obj(base: int, v: int, size: int = 20) -> NewObject:
    return NewObject(
        "delta",
        "deltarl-compact-v1",
        bytes([(v * 7) % 251]) * size,
        base_version=base,
        base_digest=digest(base),
        changed=size // 2,
    )


def chained_obj(base: int, v: int, context: int, size: int = 15) -> NewObject:
    return NewObject(
        "delta",
        "deltarl-compact-v1",
        bytes([(v * 11) % 251]) * size,
        base_version=base,
        base_digest=digest(base),
        changed=10,
        context_version=context,
    )


def publish(pub: BucketWriter, v: int, *objs: NewObject) -> VersionManifest:
    return pub.publish(v, list(objs), state_digest=digest(v), numel=200, full_bytes=400, step=v)


class CrashingBucket(LocalBucket):
    """A directory bucket that raises on the n-th put whose key matches ``pattern``."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.pattern: str | None = None
        self.nth = 1

    def crash_on(self, pattern: str | None, nth: int = 1) -> None:
        self.pattern, self.nth = pattern, nth

    def _maybe_crash(self, key: str) -> None:
        if self.pattern is not None and re.fullmatch(self.pattern, key):
            self.nth -= 1
            if self.nth == 0:
                self.pattern = None
                raise RuntimeError(f"simulated crash before writing {key}")

    def put_bytes(self, key: str, data: bytes, *, overwrite: bool = True) -> ObjectInfo:
        self._maybe_crash(key)
        return super().put_bytes(key, data, overwrite=overwrite)

    def delete_many(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        self._maybe_crash("delete:" + ",".join(keys))
        super().delete_many(keys)


@pytest.fixture
def bucket(tmp_path: Path) -> CrashingBucket:
    return CrashingBucket(tmp_path / "bucket")


def assert_readable(bucket: Bucket, latest: int) -> None:
    """Every published version is complete: plans from anywhere work and every object verifies."""
    reader = BucketReader(bucket)
    assert reader.latest_version() == latest
    manifests = reader.manifests()
    assert max(manifests) == latest
    for m in manifests.values():
        for ref in m.objects:
            reader.fetch(ref)
    for current in [None, *manifests]:
        plan = reader.plan(current)
        assert plan.target == latest
        for ref in plan.steps:
            reader.fetch(ref)


def test_publish_and_read(bucket: CrashingBucket) -> None:
    pub, reader = BucketWriter(bucket), BucketReader(bucket)
    assert reader.latest() is None and reader.manifests() == {}
    m0 = publish(pub, 0, anchor_obj(0))
    m1 = publish(pub, 1, delta_obj(0, 1))
    m2 = publish(pub, 2, delta_obj(1, 2), delta_obj(0, 2, size=30), anchor_obj(2))
    ptr = reader.latest()
    assert ptr == LatestPointer.model_validate_json(bucket.get_bytes(LATEST_KEY))
    assert ptr is not None and ptr.version == 2 and ptr.state_digest == digest(2)
    assert reader.manifests() == {0: m0, 1: m1, 2: m2}
    assert len(m2.deltas) == 2 and m2.has_anchor and m2.step == 2
    ref = m1.deltas[0]
    assert re.fullmatch(r"objects/v000000000001/[0-9a-f]{32}\.dlt", ref.key)
    assert ref.size == 20 and ref.xxh3_128 == xxh3_hex(bytes([7]) * 20)
    assert reader.fetch(ref) == bytes([7]) * 20
    assert reader.plan(0).keys == [m2.deltas[1].key]  # squashed 0->2 (30 B) beats 20 + 20
    manifest_json = json.loads(bucket.get_bytes(manifest_key(1)))
    assert manifest_json["objects"][0]["base_version"] == 0
    assert_readable(bucket, 2)


def test_publish_from_a_file(bucket: CrashingBucket, tmp_path: Path) -> None:
    src = tmp_path / "anchor.safetensors"
    src.write_bytes(b"S" * 5000)
    pub = BucketWriter(bucket)
    m = pub.publish(
        3, [NewObject("anchor", "safetensors", src)], state_digest=digest(3), numel=1, full_bytes=2
    )
    out = BucketReader(bucket).fetch_to_file(m.anchors[0], tmp_path / "out" / "a.safetensors")
    assert out.read_bytes() == src.read_bytes()


def test_out_of_order_and_duplicates_refused(bucket: CrashingBucket) -> None:
    pub = BucketWriter(bucket)
    publish(pub, 0, anchor_obj(0))
    publish(pub, 5, delta_obj(0, 5))
    before = [o.key for o in bucket.list()]
    with pytest.raises(ValueError, match="already published"):
        publish(pub, 5, delta_obj(0, 5))
    with pytest.raises(ValueError, match="older than the latest"):
        publish(pub, 3, anchor_obj(3))
    with pytest.raises(ValueError, match="older than the latest"):
        BucketWriter(bucket).publish(
            4, [anchor_obj(4)], state_digest=digest(4), numel=1, full_bytes=2
        )
    assert [o.key for o in bucket.list()] == before  # nothing written
    assert BucketReader(bucket).latest_version() == 5


def test_bad_input_writes_nothing(bucket: CrashingBucket) -> None:
    pub = BucketWriter(bucket)
    with pytest.raises(ValueError, match="must include an anchor"):
        publish(pub, 0, delta_obj(0, 0))
    publish(pub, 0, anchor_obj(0))
    before = [o.key for o in bucket.list()]
    cases: list[tuple[int, list[NewObject], str]] = [
        (1, [], "at least one"),
        (1, [delta_obj(7, 1)], "base"),
        (1, [NewObject("delta", "deltarl-compact-v1", b"x", base_version=0)], "base_digest"),
        (
            1,
            [NewObject("delta", "Bad Format!", b"x", base_version=0, base_digest=digest(0))],
            "format",
        ),
        (1, [NewObject("anchor", "safetensors", "not-bytes")], "bytes"),  # type: ignore[arg-type]
        (-1, [anchor_obj(1)], "non-negative"),
    ]
    for v, objs, msg in cases:
        with pytest.raises(ValueError, match=msg):
            pub.publish(v, objs, state_digest=digest(v), numel=1, full_bytes=2)
    with pytest.raises(ValueError, match="state_digest"):
        pub.publish(1, [anchor_obj(1)], state_digest="not-hex", numel=1, full_bytes=2)
    with pytest.raises(BaseMismatchError, match="not the published state digest"):
        pub.publish(
            1,
            [NewObject("delta", "deltarl-compact-v1", b"x", base_version=0, base_digest=digest(9))],
            state_digest=digest(1),
            numel=1,
            full_bytes=2,
        )
    assert [o.key for o in bucket.list()] == before


def test_chained_delta_reaches_the_manifest(bucket: CrashingBucket) -> None:
    pub = BucketWriter(bucket, anchor_every=0)
    publish(pub, 0, anchor_obj(0))
    publish(pub, 1, delta_obj(0, 1))
    m = publish(pub, 2, delta_obj(1, 2), chained_obj(1, 2, context=0))
    for manifest in (m, BucketReader(bucket).manifest(2)):
        standalone, chained = manifest.deltas
        assert standalone.context_version is None and not standalone.chained
        assert chained.context_version == 0 and chained.chained
        assert chained.base_version == 1 and chained.size == 15
    # chained on a squashed delta, next to its standalone twin: fine too
    m = publish(pub, 5, delta_obj(2, 5), chained_obj(2, 5, context=0))
    assert [o.context_version for o in m.deltas] == [None, 0]


def test_chained_delta_checks(bucket: CrashingBucket) -> None:
    pub = BucketWriter(bucket)
    publish(pub, 0, anchor_obj(0))
    publish(pub, 1, delta_obj(0, 1))
    before = [o.key for o in bucket.list()]
    cases: list[tuple[list[NewObject], str]] = [
        ([chained_obj(1, 2, context=0)], "needs a standalone delta from 1"),
        ([delta_obj(0, 2), chained_obj(1, 2, context=0)], "needs a standalone delta from 1"),
        ([delta_obj(1, 2), chained_obj(1, 2, context=1)], "must be older than its base_version"),
        ([delta_obj(1, 2), chained_obj(1, 2, context=5)], "must be older than its base_version"),
        ([delta_obj(1, 2), chained_obj(1, 2, context=-1)], "non-negative"),
        (
            [NewObject("anchor", "safetensors", b"x" * 4, context_version=0)],
            "anchor has no context_version",
        ),
    ]
    for objs, msg in cases:
        with pytest.raises(ValueError, match=msg):
            publish(pub, 2, *objs)
    assert [o.key for o in bucket.list()] == before  # nothing written
    assert BucketReader(bucket).latest_version() == 1


CRASH_POINTS = [
    ("first object", r"objects/v000000000002/.*", 1),
    ("second object", r"objects/v000000000002/.*", 2),
    ("manifest", r"manifests/v000000000002\.json", 1),
    ("pointer", LATEST_KEY, 1),
]


@pytest.mark.parametrize(("name", "pattern", "nth"), CRASH_POINTS, ids=[c[0] for c in CRASH_POINTS])
def test_crash_mid_publish_leaves_previous_version_readable(
    bucket: CrashingBucket, name: str, pattern: str, nth: int
) -> None:
    pub = BucketWriter(bucket)
    publish(pub, 0, anchor_obj(0))
    publish(pub, 1, delta_obj(0, 1))
    bucket.crash_on(pattern, nth)
    with pytest.raises(RuntimeError, match="simulated crash"):
        publish(pub, 2, delta_obj(1, 2), anchor_obj(2))
    assert_readable(bucket, 1)
    reader = BucketReader(bucket)
    with pytest.raises(VersionNotFoundError):
        reader.manifest(2)
    # The trainer restarts and publishes version 2 again: it succeeds and is complete.
    publish(BucketWriter(bucket), 2, delta_obj(1, 2), anchor_obj(2))
    assert_readable(bucket, 2)


def test_crash_before_pointer_then_skip_a_version(bucket: CrashingBucket) -> None:
    """A leftover manifest of a crashed attempt is never exposed by a later pointer."""
    pub = BucketWriter(bucket)
    publish(pub, 0, anchor_obj(0))
    bucket.crash_on(LATEST_KEY)
    with pytest.raises(RuntimeError):
        publish(pub, 1, delta_obj(0, 1))
    assert bucket.exists(manifest_key(1))  # pending, invisible
    publish(pub, 2, delta_obj(0, 2))
    assert not bucket.exists(manifest_key(1))
    assert sorted(BucketReader(bucket).manifests()) == [0, 2]
    assert_readable(bucket, 2)


def test_crash_while_deleting_leftovers(bucket: CrashingBucket) -> None:
    pub = BucketWriter(bucket)
    publish(pub, 0, anchor_obj(0))
    bucket.crash_on(LATEST_KEY)
    with pytest.raises(RuntimeError):
        publish(pub, 1, delta_obj(0, 1))
    bucket.crash_on(r"delete:.*")
    with pytest.raises(RuntimeError):
        publish(pub, 2, delta_obj(0, 2))
    assert_readable(bucket, 0)
    publish(pub, 3, delta_obj(0, 3))
    assert sorted(BucketReader(bucket).manifests()) == [0, 3]


def test_fetch_detects_corruption_truncation_and_loss(
    bucket: CrashingBucket, tmp_path: Path
) -> None:
    pub, reader = BucketWriter(bucket), BucketReader(bucket)
    m0 = publish(pub, 0, anchor_obj(0, size=1000))
    ref = m0.anchors[0]
    path = bucket.root / ref.key
    good = path.read_bytes()

    path.write_bytes(good[:-1])
    with pytest.raises(CorruptDeltaError, match="got 999 bytes"):
        reader.fetch(ref)
    with pytest.raises(CorruptDeltaError, match="999 bytes"):
        reader.fetch_to_file(ref, tmp_path / "a.bin")
    assert not (tmp_path / "a.bin").exists() and list(tmp_path.glob(".a.bin*")) == []

    path.write_bytes(good[:500] + bytes([good[500] ^ 1]) + good[501:])
    with pytest.raises(CorruptDeltaError, match="xxh3-128"):
        reader.fetch(ref)
    with pytest.raises(CorruptDeltaError, match="xxh3-128"):
        reader.fetch_to_file(ref, tmp_path / "a.bin")
    assert not (tmp_path / "a.bin").exists()

    path.unlink()
    with pytest.raises(CorruptDeltaError, match="missing"):
        reader.fetch(ref)
    with pytest.raises(CorruptDeltaError, match="missing"):
        reader.fetch_to_file(ref, tmp_path / "a.bin")


def test_corrupt_records_are_reported(bucket: CrashingBucket) -> None:
    pub = BucketWriter(bucket)
    publish(pub, 0, anchor_obj(0))
    bucket.put_bytes(manifest_key(0), b'{"version": 0, "objects": [')
    with pytest.raises(CorruptDeltaError, match=r"manifest manifests/v000000000000\.json"):
        BucketReader(bucket).manifests()
    bucket.put_bytes(LATEST_KEY, b"garbage")
    with pytest.raises(CorruptDeltaError, match=r"latest\.json"):
        BucketReader(bucket).latest()


def test_should_anchor_policy(bucket: CrashingBucket) -> None:
    pub = BucketWriter(bucket, anchor_every=3)
    assert pub.should_anchor(0)  # nothing anchored yet
    publish(pub, 0, anchor_obj(0))
    assert [pub.should_anchor(v) for v in (1, 2, 3, 4)] == [False, False, True, True]
    assert pub.should_anchor(1, force=True)
    publish(pub, 1, delta_obj(0, 1))
    pub.request_anchor()
    assert pub.should_anchor(2)
    publish(pub, 2, delta_obj(1, 2))  # no anchor published: the request stays
    assert pub.should_anchor(3)
    publish(pub, 3, delta_obj(2, 3), anchor_obj(3))
    assert not pub.should_anchor(4) and pub.should_anchor(6)
    # A fresh publisher (trainer restart) finds the last anchor in the bucket.
    assert BucketWriter(bucket, anchor_every=3).last_anchor_version() == 3
    never = BucketWriter(bucket, anchor_every=0)
    assert not never.should_anchor(1000)
    with pytest.raises(ValueError, match="anchor_every"):
        BucketWriter(bucket, anchor_every=-1)


def test_end_to_end_with_the_codec(bucket: CrashingBucket) -> None:
    """Trainer publishes real codec output; a replica from nothing and one at v0 catch up."""
    torch = pytest.importorskip("torch")
    from deltarl.weightsync.anchor import decode_anchor, encode_anchor
    from deltarl.weightsync.codec.formats import FORMAT_TAGS, decode_delta, encode_delta
    from deltarl.weightsync.delta import apply_delta, compute_delta
    from deltarl.weightsync.digest import state_digest

    gen = torch.Generator().manual_seed(0)
    states = [{"w": torch.randn(64, 32, generator=gen).to(torch.bfloat16)}]
    for _ in range(3):
        new = {k: t.clone() for k, t in states[-1].items()}
        flat = new["w"].view(-1)
        idx = torch.randint(0, flat.numel(), (40,), generator=gen)
        flat[idx] = (flat[idx].float() * 1.01).to(torch.bfloat16)
        states.append(new)
    pub = BucketWriter(bucket, anchor_every=0)
    for v, state in enumerate(states):
        objs = [NewObject("anchor", "safetensors", encode_anchor(state, v))] if v == 0 else []
        for base in {v - 1, 0} - {-1, v}:
            d = compute_delta(states[base], state, base, v)
            blob = encode_delta(d, states[base], "trl-gap")
            objs.append(
                NewObject("delta", FORMAT_TAGS["trl-gap"], blob, base, d.base_digest, d.changed)
            )
        pub.publish(v, objs, state_digest=state_digest(state), numel=2048, full_bytes=4096)

    reader = BucketReader(bucket)
    for current in (None, 0):
        replica = None if current is None else {k: t.clone() for k, t in states[0].items()}
        plan = reader.plan(current)
        assert plan.target == 3 and len(plan.steps) == (2 if current is None else 1)
        for ref in plan.steps:
            data = reader.fetch(ref)
            if ref.kind == "anchor":
                replica = decode_anchor(data)[0]
            else:
                assert replica is not None
                apply_delta(replica, decode_delta(data, replica))
        assert replica is not None and state_digest(replica) == plan.steps[-1].result_digest


def test_reader_waits_for_a_lagging_latest_manifest(
    bucket: CrashingBucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store may show latest.json before the manifest it names (no read-after-write)."""
    publish(BucketWriter(bucket), 0, anchor_obj(0))
    real_get, misses = bucket.get_bytes, [2]

    def lagging_get(key: str) -> bytes:
        if key == manifest_key(0) and misses[0] > 0:
            misses[0] -= 1
            from deltarl.buckets import ObjectNotFoundError

            raise ObjectNotFoundError(key)
        return real_get(key)

    monkeypatch.setattr(bucket, "get_bytes", lagging_get)
    monkeypatch.setattr("time.sleep", lambda s: None)
    assert BucketReader(bucket).manifest(0).version == 0 and misses == [0]
    misses[0] = 10
    with pytest.raises(VersionNotFoundError, match="lagging"):
        BucketReader(bucket, latest_retries=2).manifest(0)
