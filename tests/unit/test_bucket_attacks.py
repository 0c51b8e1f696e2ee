"""What someone who can write the bucket, but does not hold the trainer's signing key, can try
against a reader that trusts only signed versions: forged objects with the same xxh3-128, signed
manifests without SHA-256, old signed pointers and manifests put back. Each is refused."""

from __future__ import annotations

import json
import logging
import os
import struct
from pathlib import Path

import pytest
import xxhash

from deltarl.buckets.local import LocalBucket
from deltarl.weightsync.errors import CorruptDeltaError
from deltarl.weightsync.manifest import (
    LATEST_KEY,
    VersionManifest,
    manifest_json,
    manifest_key,
    parts_sha256,
    sha256_hex,
    xxh3_hex,
)
from deltarl.weightsync.reader import BucketReader, RollbackError
from deltarl.weightsync.signing import (
    Signer,
    UnhashedObjectError,
    Verifier,
    generate_key,
)
from deltarl.weightsync.writer import BucketWriter, NewObject

# --- forging xxh3-128 -------------------------------------------------------------------------
#
# For inputs over 240 bytes XXH3 (64 and 128 bits) cuts the input into 1024-byte blocks of 16
# stripes of 64 bytes. Stripe s of a block adds to 8 accumulators, lane i being the stripe's
# 64-bit word d[i] and k[i] the secret's word at 8 s + 8 i:
#     acc[i ^ 1] += d[i];   acc[i] += lo32(d[i] ^ k[i]) * hi32(d[i] ^ k[i])
# and only then are the accumulators scrambled. Any block whose 16 stripes add the same sums
# leaves the hash unchanged. Choosing a word with lo32(d ^ k) = 0 (or hi32 = 0) zeroes its
# product, and two such words, one with free high and one with free low 32 bits, sum to any
# 64-bit value: so two computed stripes (128 bytes) make up for 14 arbitrary ones (896 bytes).

M64 = (1 << 64) - 1
M32 = (1 << 32) - 1
# XXH3's default secret (XXH3_kSecret in xxhash.h), a constant of the algorithm
XXH3_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)


def _words(data: bytes) -> tuple[int, ...]:
    return struct.unpack("<8Q", data)


def _key(stripe: int) -> tuple[int, ...]:
    return _words(XXH3_SECRET[8 * stripe : 8 * stripe + 64])


def _stripe_sums(block: bytes, stripes: range) -> list[int]:
    """What ``stripes`` of a 1024-byte block add to the accumulators."""
    acc = [0] * 8
    for s in stripes:
        d, k = _words(block[64 * s : 64 * s + 64]), _key(s)
        for i in range(8):
            x = d[i] ^ k[i]
            acc[i ^ 1] = (acc[i ^ 1] + d[i]) & M64
            acc[i] = (acc[i] + (x & M32) * (x >> 32)) & M64
    return acc


def forge_xxh3(data: bytes, block: int, payload: bytes) -> bytes:
    """``data`` with its ``block``-th 1024-byte block replaced by 128 computed bytes followed by
    ``payload`` (896 bytes of the forger's choice), with the same length and xxh3-128."""
    start = 1024 * block
    assert len(payload) == 896 and start + 1024 + 64 <= len(data)  # a full block, not the tail
    old = data[start : start + 1024]
    want = _stripe_sums(old, range(16))
    have = _stripe_sums(bytes(128) + payload, range(2, 16))
    target = [(w - h) & M64 for w, h in zip(want, have, strict=True)]
    k0, k1 = _key(0), _key(1)
    a, b = [0] * 8, [0] * 8
    for m in range(8):  # word m of both stripes feeds acc[m ^ 1]
        t = target[m ^ 1]
        low = (t - (k0[m] & M32)) & M32
        carry = ((k0[m] & M32) + low) >> 32
        high = ((t >> 32) - (k1[m] >> 32) - carry) & M32
        a[m] = (high << 32) | (k0[m] & M32)  # lo32(a ^ k0) = 0: no product
        b[m] = (k1[m] & ~M32 & M64) | low  # hi32(b ^ k1) = 0: no product
    forged = struct.pack("<8Q", *a) + struct.pack("<8Q", *b) + payload
    return data[:start] + forged + data[start + 1024 :]


PAYLOAD = b"not the trainer's weights, " * 33 + b"!" * 5  # 896 bytes


def test_the_forgery_keeps_xxh3_128() -> None:
    data = os.urandom(5000)
    forged = forge_xxh3(data, 2, PAYLOAD)
    assert forged != data and PAYLOAD in forged and len(forged) == len(data)
    assert xxhash.xxh3_128_hexdigest(forged) == xxhash.xxh3_128_hexdigest(data)
    assert xxhash.xxh3_64_hexdigest(forged) == xxhash.xxh3_64_hexdigest(data)  # same loop
    assert sha256_hex(forged) != sha256_hex(data)


# --- helpers ----------------------------------------------------------------------------------


def digest(v: int) -> str:
    return xxh3_hex(f"state-{v}".encode())


def anchor(v: int) -> NewObject:
    return NewObject("anchor", "safetensors", os.urandom(4096 + v))


def delta(v: int) -> NewObject:
    return NewObject(
        "delta",
        "deltarl-compact-v1",
        os.urandom(3000),
        base_version=v - 1,
        base_digest=digest(v - 1),
        changed=10,
    )


def publish(writer: BucketWriter, v: int, *objects: NewObject) -> VersionManifest:
    """Version ``v`` made of ``objects`` (default: an anchor for 0, else a delta from v - 1)."""
    objs = list(objects) or [anchor(v) if v == 0 else delta(v)]
    return writer.publish(v, objs, state_digest=digest(v), numel=100, full_bytes=200)


@pytest.fixture
def signer(tmp_path: Path) -> Signer:
    return generate_key(tmp_path / "trainer.key")


@pytest.fixture
def bucket(tmp_path: Path) -> LocalBucket:
    return LocalBucket(tmp_path / "bucket")


def trusting(bucket: LocalBucket, signer: Signer) -> BucketReader:
    return BucketReader(bucket, verifier=Verifier([signer.public_hex]))


# --- objects replaced by forged bytes ---------------------------------------------------------


def test_a_forged_object_with_the_same_xxh3_is_refused(bucket: LocalBucket, signer: Signer) -> None:
    writer = BucketWriter(bucket, anchor_every=0, signer=signer)
    ref = publish(writer, 0).objects[0]
    assert ref.sha256 == sha256_hex(bucket.get_bytes(ref.key))
    real = bucket.get_bytes(ref.key)
    forged = forge_xxh3(real, 1, PAYLOAD)
    assert xxh3_hex(forged) == ref.xxh3_128 and len(forged) == ref.size
    bucket.put_bytes(ref.key, forged, overwrite=True)
    reader = trusting(bucket, signer)
    assert reader.manifest(0).objects[0] == ref  # the signed manifest is untouched
    with pytest.raises(CorruptDeltaError, match=r"SHA-256 .* does not match"):
        reader.fetch(ref)
    with pytest.raises(CorruptDeltaError, match="SHA-256"):
        reader.fetch_to_file(ref, bucket.root.parent / "anchor.safetensors")
    assert not (bucket.root.parent / "anchor.safetensors").exists()
    # what the same manifest without SHA-256 would have let through: size and xxh3 match
    bare = ref.model_copy(update={"sha256": None})
    assert BucketReader(bucket).fetch(bare) == forged


def test_a_forged_part_of_a_sharded_object_is_refused(bucket: LocalBucket, signer: Signer) -> None:
    ranks = BucketWriter(bucket, sha256=True)  # the other ranks: upload only, never sign
    parts = tuple(
        ranks.upload_part(0, "safetensors", os.urandom(3000), [f"w[{i}:{i + 1}]"]) for i in range(3)
    )
    writer = BucketWriter(bucket, anchor_every=0, signer=signer)
    ref = publish(writer, 0, NewObject("anchor", "safetensors", parts)).objects[0]
    assert ref.sha256 == parts_sha256(parts) and all(p.sha256 for p in ref.parts or ())
    victim = parts[1]
    bucket.put_bytes(
        victim.key, forge_xxh3(bucket.get_bytes(victim.key), 0, PAYLOAD), overwrite=True
    )
    with pytest.raises(CorruptDeltaError, match=f"{victim.key}: SHA-256"):
        list(trusting(bucket, signer).fetch_parts(ref))


def test_a_signing_writer_refuses_parts_without_sha256(bucket: LocalBucket, signer: Signer) -> None:
    parts = (BucketWriter(bucket).upload_part(0, "safetensors", b"x" * 100, ["w[0:1]"]),)
    assert parts[0].sha256 is None  # an unsigned writer records no SHA-256
    with pytest.raises(ValueError, match="no sha256"):
        publish(BucketWriter(bucket, signer=signer), 0, NewObject("anchor", "safetensors", parts))
    assert bucket.list("manifests/") == []
    with pytest.raises(ValueError, match="records SHA-256"):
        BucketWriter(bucket, signer=signer, sha256=False)


def test_a_signed_manifest_without_sha256_is_refused_before_any_fetch(
    bucket: LocalBucket, signer: Signer
) -> None:
    """A manifest signed by a trainer older than ObjectRef.sha256: its signature does not bind
    its objects' bytes, so a reader that trusts keys does not use it."""
    publish(BucketWriter(bucket, anchor_every=0), 0)  # unsigned, no SHA-256 ...
    for key in (manifest_key(0), LATEST_KEY):  # ... then signed as an older trainer did
        bucket.put_bytes(key, signer.sign_json(bucket.get_bytes(key)), overwrite=True)
    reader = trusting(bucket, signer)
    assert reader.latest_version() == 0
    with pytest.raises(UnhashedObjectError, match="records no SHA-256"):
        reader.plan(None, 0)
    assert reader.fetched_bytes == 0
    assert BucketReader(bucket).plan(None, 0).total_bytes > 0  # no trusted keys: as before


def test_unsigned_manifests_are_written_as_before(bucket: LocalBucket) -> None:
    """No signer: no SHA-256 and no ``sha256`` member, byte for byte the earlier manifest."""
    m = publish(BucketWriter(bucket, anchor_every=0), 0)
    raw = bucket.get_bytes(manifest_key(0))
    assert b"sha256" not in raw and raw == manifest_json(m)
    assert raw == m.model_dump_json(indent=1, exclude={"objects": {0: {"sha256"}}}).encode()
    doc = json.loads(raw)
    assert "sha256" not in doc["objects"][0]
    assert BucketReader(bucket).manifest(0) == m
    hashed = publish(BucketWriter(bucket, sha256=True), 1)
    assert hashed.objects[0].sha256 == sha256_hex(bucket.get_bytes(hashed.objects[0].key))


# --- older pointers and manifests put back --------------------------------------------------


def test_an_old_signed_pointer_put_back_is_refused(
    bucket: LocalBucket, signer: Signer, caplog: pytest.LogCaptureFixture
) -> None:
    writer = BucketWriter(bucket, anchor_every=0, signer=signer)
    publish(writer, 0)
    publish(writer, 1)
    old_pointer = bucket.get_bytes(LATEST_KEY)  # validly signed, for version 1
    publish(writer, 2)
    reader = trusting(bucket, signer)
    assert reader.latest_version() == 2 and reader.floor == 2
    bucket.put_bytes(LATEST_KEY, old_pointer, overwrite=True)
    with pytest.raises(RollbackError, match="points at version 1, but this reader already "):
        reader.latest()
    with pytest.raises(RollbackError):
        reader.plan(2)
    assert reader.floor == 2 and reader.fetched_bytes == 0
    # the trainer does not believe it either: its next version replaces the old pointer
    with caplog.at_level(logging.WARNING, "deltarl.weightsync"):
        publish(writer, 3)
    assert "points at version 1" in caplog.text
    assert reader.latest_version() == 3 and [s.version for s in reader.plan(2).steps] == [3]


def test_a_pointer_at_the_same_version_with_another_state_is_refused(
    bucket: LocalBucket, signer: Signer
) -> None:
    writer = BucketWriter(bucket, anchor_every=0, signer=signer)
    publish(writer, 0)
    reader = trusting(bucket, signer)
    reader.latest()
    doc = json.loads(bucket.get_bytes(LATEST_KEY))
    doc["state_digest"] = digest(99)
    bucket.put_bytes(LATEST_KEY, json.dumps(signer.sign(doc)).encode(), overwrite=True)
    with pytest.raises(RollbackError, match="with state digest"):
        reader.latest()


def test_a_manifest_of_an_uncommitted_publish_put_back_is_refused(
    bucket: LocalBucket, signer: Signer
) -> None:
    """A publish of version 1 that crashed after writing its (signed) manifest, then version 1
    published again with other weights: the first manifest, put back, is not the committed one."""
    writer = BucketWriter(bucket, anchor_every=0, signer=signer)
    publish(writer, 0)
    real = publish(writer, 1)
    doc = json.loads(manifest_json(real))
    doc["state_digest"] = digest(77)
    for o in doc["objects"]:
        o["result_digest"] = digest(77)
    stale = signer.sign_json(json.dumps(doc).encode())  # what the crashed attempt signed
    early = trusting(bucket, signer)
    assert early.manifest(1).objects == real.objects
    bucket.put_bytes(manifest_key(1), stale, overwrite=True)
    assert early.manifest(1).state_digest == digest(1)  # an accepted manifest is kept
    with pytest.raises(CorruptDeltaError, match=r"the signed latest\.json says"):
        trusting(bucket, signer).manifest(1)


def test_a_signed_manifest_put_at_another_version_is_refused(
    bucket: LocalBucket, signer: Signer
) -> None:
    writer = BucketWriter(bucket, anchor_every=0, signer=signer)
    publish(writer, 0)
    publish(writer, 1)
    bucket.put_bytes(manifest_key(1), bucket.get_bytes(manifest_key(0)), overwrite=True)
    with pytest.raises(CorruptDeltaError, match="describes version 0"):
        trusting(bucket, signer).manifest(1)
