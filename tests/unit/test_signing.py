"""Signed versions: a reader that trusts keys refuses unsigned, foreign-signed and
altered manifests and pointers before fetching any object; rotation; the worker's settings;
``deltarl delta keygen``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from states import make_state
from support import deltarl

from deltarl.buckets.local import LocalBucket
from deltarl.rollout.settings import RolloutSettings
from deltarl.weightsync.anchor import encode_anchor
from deltarl.weightsync.digest import state_digest
from deltarl.weightsync.manifest import LATEST_KEY, manifest_key
from deltarl.weightsync.reader import BucketReader
from deltarl.weightsync.signing import (
    BadSignatureError,
    Signer,
    UnsignedVersionError,
    Verifier,
    generate_key,
)
from deltarl.weightsync.writer import BucketWriter, NewObject


def publish(bucket: LocalBucket, version: int, signer: Signer | None) -> None:
    state = make_state(seed=version)
    numel = sum(t.numel() for t in state.values())
    BucketWriter(bucket, anchor_every=0, signer=signer).publish(
        version,
        [NewObject("anchor", "safetensors", encode_anchor(state, version))],
        state_digest=state_digest(state),
        numel=numel,
        full_bytes=2 * numel,
    )


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Signer, Signer]:
    return generate_key(tmp_path / "old.key"), generate_key(tmp_path / "new.key")


def test_signed_versions_are_read_and_unsigned_ones_refused(tmp_path: Path, keys) -> None:
    old, _ = keys
    bucket = LocalBucket(tmp_path / "b")
    publish(bucket, 0, old)
    reader = BucketReader(bucket, verifier=Verifier([old.public_hex]))
    assert reader.latest().version == 0 and reader.manifest(0).signature["key_id"] == old.key_id
    plain = LocalBucket(tmp_path / "plain")
    publish(plain, 0, None)
    assert BucketReader(plain).latest_version() == 0  # no trusted keys: unsigned is fine
    strict = BucketReader(plain, verifier=Verifier([old.public_hex]))
    with pytest.raises(UnsignedVersionError, match="not signed"):
        strict.latest()
    with pytest.raises(UnsignedVersionError):
        strict.load_manifest(0)


def test_altered_or_foreign_signed_documents_are_refused_before_any_fetch(
    tmp_path: Path, keys
) -> None:
    old, new = keys
    bucket = LocalBucket(tmp_path / "b")
    publish(bucket, 0, old)
    reader = BucketReader(bucket, verifier=Verifier([new.public_hex]))
    with pytest.raises(BadSignatureError, match="does not trust"):
        reader.plan(None, 0)
    assert reader.fetched_bytes == 0
    # an attacker who can write the bucket swaps the state digest and re-points an object
    doc = json.loads(bucket.get_bytes(manifest_key(0)))
    doc["state_digest"] = "0" * 32
    bucket.put_bytes(manifest_key(0), json.dumps(doc).encode(), overwrite=True)
    trusting = BucketReader(bucket, verifier=Verifier([old.public_hex]))
    with pytest.raises(BadSignatureError, match="does not match its content"):
        trusting.load_manifest(0)
    # the pointer re-signed by a key of the attacker's
    ptr = json.loads(bucket.get_bytes(LATEST_KEY))
    bucket.put_bytes(
        LATEST_KEY,
        json.dumps(generate_key(tmp_path / "evil.key").sign(ptr)).encode(),
        overwrite=True,
    )
    with pytest.raises(BadSignatureError, match="does not trust"):
        trusting.latest()


def test_rotation_accepts_both_keys_while_readers_trust_both(tmp_path: Path, keys) -> None:
    old, new = keys
    bucket = LocalBucket(tmp_path / "b")
    publish(bucket, 0, old)
    publish(bucket, 1, new)  # the trainer switched keys
    both = BucketReader(bucket, verifier=Verifier([old.public_hex, new.public_hex]))
    assert both.latest().version == 1
    assert {both.manifest(v).signature["key_id"] for v in (0, 1)} == {old.key_id, new.key_id}
    only_new = BucketReader(bucket, verifier=Verifier([new.public_hex]))
    assert only_new.manifest(1).version == 1
    with pytest.raises(BadSignatureError):
        only_new.load_manifest(0)  # signed by the retired key


def test_signatures_do_not_depend_on_formatting(keys) -> None:
    old, _ = keys
    doc = {"b": 1, "a": [1, 2, {"z": "é"}]}
    signed = old.sign(doc)
    Verifier([old.public_hex]).verify(json.dumps(signed, indent=4).encode(), "doc")
    Verifier([old.public_hex]).verify(json.dumps(signed, separators=(",", ":")).encode(), "doc")
    signed["a"][0] = 2
    with pytest.raises(BadSignatureError):
        Verifier([old.public_hex]).verify(json.dumps(signed).encode(), "doc")


def test_key_files_and_settings(tmp_path: Path, keys, monkeypatch: pytest.MonkeyPatch) -> None:
    old, _ = keys
    assert Signer.from_file(tmp_path / "old.key").public_hex == old.public_hex
    assert (tmp_path / "old.key").stat().st_mode & 0o777 == 0o600
    with pytest.raises(FileExistsError):
        generate_key(tmp_path / "old.key")
    (tmp_path / "bad.key").write_text("abc")
    with pytest.raises(ValueError, match="64 hexadecimal digits"):
        Signer.from_file(tmp_path / "bad.key")
    with pytest.raises(ValueError, match="no trusted public key"):
        Verifier([])
    monkeypatch.setenv("DELTARL_ROLLOUT_TRUSTED_KEYS", f" {old.public_hex} ,")
    verifier = RolloutSettings().verifier()
    assert verifier is not None
    verifier.verify(json.dumps(old.sign({"x": 1})).encode(), "doc")
    monkeypatch.setenv("DELTARL_ROLLOUT_TRUSTED_KEYS", "not-a-key")
    with pytest.raises(ValueError, match="64 hex digits"):
        RolloutSettings()


def test_keygen_command(tmp_path: Path) -> None:
    r = deltarl("delta", "keygen", str(tmp_path / "k"))
    assert r.returncode == 0, r.stderr
    assert Signer.from_file(tmp_path / "k").public_hex == r.stdout.strip()
    r = deltarl("delta", "keygen", str(tmp_path / "k"))
    assert r.returncode == 2 and "refusing to overwrite" in r.stderr
