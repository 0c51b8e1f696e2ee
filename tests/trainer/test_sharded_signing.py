"""An FSDP trainer signs its versions like a single-process one: with ``publish.signing_key_file``
rank 0 signs the manifest and the pointer, and every rank records the SHA-256 of the part it
uploads, so a reader that trusts the key accepts the sharded version and checks every part.
(The ranks' writers only, in one process: no collective is involved.)"""

from __future__ import annotations

from pathlib import Path

from deltarl.buckets.local import LocalBucket
from deltarl.trainer.learn.distributed import DistContext
from deltarl.trainer.publish.sharded import ShardedPublisher
from deltarl.trainer.settings import PublishSettings
from deltarl.weightsync.manifest import sha256_hex, xxh3_hex
from deltarl.weightsync.reader import BucketReader
from deltarl.weightsync.signing import Verifier, generate_key
from deltarl.weightsync.writer import NewObject


def test_rank_0_signs_and_every_rank_hashes_its_part(tmp_path: Path) -> None:
    signer = generate_key(tmp_path / "trainer.key")
    settings = PublishSettings(format="trl-raw", signing_key_file=tmp_path / "trainer.key")
    bucket = LocalBucket(tmp_path / "bucket")
    ranks = [
        ShardedPublisher(bucket, settings, DistContext(rank=r, world_size=2, local_rank=r))
        for r in (0, 1)
    ]
    try:
        writers = [p._writer for p in ranks]
        assert writers[0].signer is not None and writers[1].signer is None
        blobs = [bytes([r + 1]) * 300 for r in (0, 1)]
        parts = tuple(
            w.upload_part(0, "safetensors", blob, [f"w[{r}:{r + 1}]"])
            for r, (w, blob) in enumerate(zip(writers, blobs, strict=True))
        )
        assert [p.sha256 for p in parts] == [sha256_hex(b) for b in blobs]
        writers[0].publish(
            0,
            [NewObject("anchor", "safetensors", parts)],
            state_digest=xxh3_hex(b"state"),
            numel=2,
            full_bytes=4,
        )
        reader = BucketReader(bucket, verifier=Verifier([signer.public_hex]))
        ref = reader.manifest(0).objects[0]
        assert ref.hashed and ref.parts == parts
        assert sorted(data for _, data in reader.fetch_parts(ref)) == blobs
    finally:
        for p in ranks:
            p.close()
