"""The write side of a bucket: :class:`BucketWriter`, the trainer's versioned publication.

The read side is :class:`~deltarl.weightsync.reader.BucketReader` (reader.py).

Torch-free: objects arrive already encoded (bytes or a local file) from the codec.

Publication protocol for version ``v`` (:meth:`BucketWriter.publish`), in this order:

1. Check: ``v`` is newer than ``latest.json``; each delta's base version is published and its
   ``base_digest`` equals that version's ``state_digest``; the first version has an anchor; a
   chained delta (``context_version`` set) has an older context than its base and comes with a
   standalone delta from the same base, so no replica ever depends on the chained one alone.
2. Upload every object under a fresh unique key ``objects/v.../<uuid>.<ext>`` (never overwritten).
3. Write the manifest ``manifests/v....json`` (size + xxh3-128 of each object, + SHA-256 when
   signing or asked to; signed when the writer has a key). It may only
   replace a leftover manifest of the same version from a crashed attempt that never reached
   step 5 (``v`` > latest, so no reader ever used it).
4. Delete leftover manifests of crashed attempts between the old latest and ``v``.
5. Re-read ``latest.json`` (refuse if it moved to >= ``v`` meanwhile), then overwrite it with
   ``v``: this single atomic put is the commit point.

An older ``latest.json`` put back by someone else who can write the bucket (a pointer below the
one this writer last read or wrote) is not believed: the writer goes on from the version it
knows and its next pointer replaces the old one (logged as a warning).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from deltarl.buckets.base import Bucket, ObjectExistsError
from deltarl.weightsync.errors import BaseMismatchError
from deltarl.weightsync.manifest import (
    FORMAT_EXTENSIONS,
    LATEST_KEY,
    MANIFESTS_PREFIX,
    LatestPointer,
    ObjectKind,
    ObjectPart,
    ObjectRef,
    VersionManifest,
    manifest_json,
    objects_prefix,
    parse_manifest_key,
    parts_digest,
    parts_sha256,
    sha256_hex,
    xxh3_hex,
)
from deltarl.weightsync.reader import (
    BucketReader,
    VersionNotFoundError,
    file_digest,
    is_digest,
)

if TYPE_CHECKING:  # signing imports cryptography: only where keys are configured
    from deltarl.weightsync.signing import Signer

logger = logging.getLogger(__name__)

_CHUNK = 1 << 22


@dataclass(frozen=True, slots=True)
class NewObject:
    """One encoded object handed to :meth:`BucketWriter.publish` by the codec.

    Example: ``NewObject("delta", "deltarl-compact-v3", blob, base_version=11,
    base_digest=delta.base_digest, changed=delta.changed)``; a chained delta adds
    ``context_version=10`` (it decodes only after the delta 10 -> 11).
    """

    kind: ObjectKind  # "anchor" or "delta"
    format: str  # "deltarl-compact-v3", "trl-sparse-gap_delta", "safetensors", "safetensors+zstd"
    # the encoded bytes, a local file holding them, or the parts of a sharded object, already
    # uploaded by the ranks that hold them (:meth:`BucketWriter.upload_part`)
    source: bytes | Path | tuple[ObjectPart, ...]
    base_version: int | None = None  # delta: version it applies to; anchor: None
    base_digest: str | None = None  # delta: state digest of base_version; anchor: None
    changed: int | None = None  # delta: changed elements; anchor: None
    context_version: int | None = None  # chained delta: base of the delta it is chained on


class BucketWriter:
    """Write side, used by the trainer (one publisher per bucket). See the module docstring.

    ``anchor_every``: :meth:`should_anchor` asks for an anchor when at least this many versions
    passed since the last one (0: only the first version and on demand).
    ``signer``: signs every manifest and latest pointer (signing.py).
    ``sha256``: record the SHA-256 of every object and part (``ObjectRef.sha256``); None: when
    signing, which requires it (without a signature it binds nothing: whoever can replace an
    object can rewrite its manifest). An FSDP rank that only uploads parts passes True when
    rank 0 signs.
    """

    def __init__(
        self,
        bucket: Bucket,
        *,
        anchor_every: int = 10,
        signer: Signer | None = None,
        sha256: bool | None = None,
    ) -> None:
        self.signer = signer
        self.sha256 = signer is not None if sha256 is None else sha256
        if signer is not None and not self.sha256:
            raise ValueError("a signing writer records SHA-256 of its objects (sha256=True)")
        if not isinstance(anchor_every, int) or anchor_every < 0:
            raise ValueError(f"anchor_every must be an int >= 0, got {anchor_every!r}")
        self.bucket = bucket
        # an older latest.json than it read or wrote is not believed: it goes on from its own
        self.reader = BucketReader(bucket, keep_floor=True)
        self.anchor_every = anchor_every
        self._anchor_requested = False
        self._last_anchor: int | None = None
        self._last_anchor_known = False

    def request_anchor(self) -> None:
        """Make :meth:`should_anchor` say yes until a version with an anchor is published."""
        self._anchor_requested = True

    def last_anchor_version(self) -> int | None:
        """Newest published version that has an anchor (read from the bucket once, then tracked)."""
        if not self._last_anchor_known:
            anchored = [v for v, m in self.reader.manifests().items() if m.has_anchor]
            self._last_anchor = max(anchored) if anchored else None
            self._last_anchor_known = True
        return self._last_anchor

    def should_anchor(self, version: int, *, force: bool = False) -> bool:
        """Whether ``version`` should be published with an anchor (the trainer then encodes one).

        Yes when forced, when :meth:`request_anchor` was called, when nothing is anchored yet, or
        when ``anchor_every > 0`` and ``version - last_anchor >= anchor_every``.
        """
        if force or self._anchor_requested:
            return True
        last = self.last_anchor_version()
        if last is None:
            return True
        return self.anchor_every > 0 and version - last >= self.anchor_every

    def _check(
        self, version: int, objects: Sequence[NewObject], state_digest: str, latest: int | None
    ) -> dict[int, VersionManifest]:
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError(f"version must be a non-negative int, got {version!r}")
        if not is_digest(state_digest):
            raise ValueError(
                f"state_digest must be the codec's lowercase hex state digest, got {state_digest!r}"
            )
        if not objects:
            raise ValueError(f"version {version}: publish at least one anchor or delta")
        if latest is not None and version <= latest:
            what = "already published" if version == latest else "older than the latest"
            raise ValueError(
                f"refusing to publish version {version}: {what} ({LATEST_KEY} is at {latest}); "
                "versions must strictly increase"
            )
        if latest is None and not any(o.kind == "anchor" for o in objects):
            raise ValueError(
                f"version {version} is the first in {self.bucket.uri}: it must include an anchor"
            )
        bases: dict[int, VersionManifest] = {}
        for o in objects:
            if o.kind not in ("anchor", "delta"):
                raise ValueError(f"object kind must be 'anchor' or 'delta', got {o.kind!r}")
            if not isinstance(o.source, bytes | Path | tuple):
                raise ValueError(
                    f"source must be bytes, a pathlib.Path or a tuple of ObjectPart, got "
                    f"{type(o.source)}"
                )
            if self.signer is not None and isinstance(o.source, tuple):
                bare = [p.key for p in o.source if p.sha256 is None]
                if bare:
                    raise ValueError(
                        f"version {version}: part {bare[0]} has no sha256, which a signed "
                        "version needs (upload parts with BucketWriter(sha256=True))"
                    )
            if o.kind == "anchor":
                if o.context_version is not None:
                    raise ValueError(f"version {version}: an anchor has no context_version")
                continue
            if o.base_version is None or o.base_digest is None:
                raise ValueError(f"version {version}: a delta needs base_version and base_digest")
            if not is_digest(o.base_digest):
                raise ValueError(
                    f"base_digest must be a lowercase hex digest, got {o.base_digest!r}"
                )
            if o.base_version >= version:
                raise ValueError(
                    f"delta base_version {o.base_version} must be older than version {version}"
                )
            if o.context_version is not None:
                self._check_chained(version, o, objects)
            if o.base_version not in bases:
                try:
                    bases[o.base_version] = self.reader.manifest(o.base_version, latest=latest)
                except VersionNotFoundError as err:
                    raise ValueError(f"delta to version {version}: base {err}") from None
            expected = bases[o.base_version].state_digest
            if o.base_digest != expected:
                raise BaseMismatchError(
                    f"delta {o.base_version} -> {version}: base_digest {o.base_digest} is not the "
                    f"published state digest {expected} of version {o.base_version}"
                )
        return bases

    @staticmethod
    def _check_chained(version: int, o: NewObject, objects: Sequence[NewObject]) -> None:
        ctx, base = o.context_version, o.base_version
        if not isinstance(ctx, int) or isinstance(ctx, bool) or ctx < 0:
            raise ValueError(
                f"delta {base} -> {version}: context_version must be None or a non-negative "
                f"int, got {ctx!r}"
            )
        assert base is not None
        if ctx >= base:
            raise ValueError(
                f"chained delta {base} -> {version}: context_version {ctx} must be older than "
                f"its base_version {base} (it is chained on the delta {ctx} -> {base})"
            )
        if not any(
            s.kind == "delta" and s.base_version == base and s.context_version is None
            for s in objects
        ):
            raise ValueError(
                f"chained delta {base} -> {version} (context {ctx}) needs a standalone delta "
                f"from {base} in the same version: replicas without its context must have "
                "another way from the same base"
            )

    def upload_part(self, version: int, fmt: str, data: bytes, slices: Sequence[str]) -> ObjectPart:
        """Upload one part of a sharded object of ``version`` (any rank; nothing is visible
        until rank 0 publishes the manifest that lists it). ``slices``: the slice keys it holds."""
        key = f"{objects_prefix(version)}{uuid.uuid4().hex}.{FORMAT_EXTENSIONS.get(fmt, 'bin')}"
        part = ObjectPart(
            key=key,
            size=len(data),
            xxh3_128=xxh3_hex(data),
            sha256=sha256_hex(data) if self.sha256 else None,
            slices=tuple(slices),
        )
        self.bucket.put_bytes(key, data)
        return part

    def _upload(self, version: int, state_digest: str, o: NewObject) -> ObjectRef:
        ext = FORMAT_EXTENSIONS.get(o.format, "bin")
        key = f"{objects_prefix(version)}{uuid.uuid4().hex}.{ext}"
        if isinstance(o.source, tuple):  # parts uploaded by their ranks
            parts = o.source
            if not parts:
                raise ValueError(f"version {version}: a sharded object needs at least one part")
            size, digest = sum(p.size for p in parts), parts_digest(parts)
            strong = parts_sha256(parts) if all(p.sha256 is not None for p in parts) else None
            return self._ref(parts[0].key, version, state_digest, o, size, digest, strong, parts)
        if isinstance(o.source, bytes):
            size, digest = len(o.source), xxh3_hex(o.source)
            strong = sha256_hex(o.source) if self.sha256 else None
            ref = self._ref(key, version, state_digest, o, size, digest, strong)  # before I/O
            self.bucket.put_bytes(key, o.source)
        else:
            size, digest, strong = file_digest(o.source, sha256=self.sha256)
            ref = self._ref(key, version, state_digest, o, size, digest, strong)
            # Fresh uuid key, so no create-if-absent needed: lets S3 use multipart for big anchors.
            self.bucket.put_file(key, o.source)
        return ref

    @staticmethod
    def _ref(
        key: str,
        version: int,
        state_digest: str,
        o: NewObject,
        size: int,
        digest: str,
        sha256: str | None = None,
        parts: tuple[ObjectPart, ...] | None = None,
    ) -> ObjectRef:
        return ObjectRef(
            key=key,
            kind=o.kind,
            format=o.format,
            size=size,
            xxh3_128=digest,
            sha256=sha256,
            version=version,
            base_version=o.base_version,
            base_digest=o.base_digest,
            result_digest=state_digest,
            changed=o.changed,
            context_version=o.context_version,
            parts=parts,
        )

    def _signed(self, body: bytes) -> bytes:
        return body if self.signer is None else self.signer.sign_json(body)

    def publish(
        self,
        version: int,
        objects: Sequence[NewObject],
        *,
        state_digest: str,
        numel: int,
        full_bytes: int,
        step: int | None = None,
    ) -> VersionManifest:
        """Publish ``version`` made of ``objects`` (steps 1-5 of the module docstring).

        Returns the manifest once ``latest.json`` points at it. Raises ``ValueError`` (nothing
        written) for out-of-order or duplicate versions, unknown bases and bad arguments,
        :class:`BaseMismatchError` when a delta's base digest is not its base version's.
        """
        latest = self.reader.latest_version()
        self._check(version, objects, state_digest, latest)
        # Validate every field before uploading anything: bad input leaves no orphans.
        prefix = objects_prefix(version)
        preview = [
            self._upload(version, state_digest, o)
            if isinstance(o.source, tuple)  # nothing to upload: its real record
            else self._ref(f"{prefix}{i:032x}.bin", version, state_digest, o, 0, "0" * 32)
            for i, o in enumerate(objects)
        ]
        VersionManifest(
            version=version,
            step=step,
            state_digest=state_digest,
            numel=numel,
            full_bytes=full_bytes,
            objects=tuple(preview),
        )
        # 2. objects
        refs = [self._upload(version, state_digest, o) for o in objects]
        manifest = VersionManifest(
            version=version,
            step=step,
            state_digest=state_digest,
            numel=numel,
            full_bytes=full_bytes,
            objects=tuple(refs),
            created_at=datetime.now(UTC),
        )
        # 3. manifest
        body = self._signed(manifest_json(manifest))
        try:
            self.bucket.put_bytes(manifest.key, body, overwrite=False)
        except ObjectExistsError:
            now = self.reader.latest_version()
            if now is not None and version <= now:
                raise ValueError(
                    f"refusing to publish version {version}: another publisher got there first "
                    f"({LATEST_KEY} is at {now})"
                ) from None
            logger.warning(
                "replacing manifest of version %d left by a crashed publish (never visible)",
                version,
            )
            self.bucket.put_bytes(manifest.key, body, overwrite=True)
        # 4. leftover manifests of crashed attempts that the new pointer would expose
        low = -1 if latest is None else latest
        stale = [
            o.key
            for o in self.bucket.list(MANIFESTS_PREFIX)
            if (v := parse_manifest_key(o.key)) is not None and low < v < version
        ]
        if stale:
            logger.warning("deleting %d manifest(s) of crashed publishes: %s", len(stale), stale)
            self.bucket.delete_many(stale)
        # 5. commit (re-read the pointer first: narrows the window for a misconfigured second
        # publisher; the protocol itself assumes one publisher per bucket)
        now = self.reader.latest_version()
        if now is not None and now >= version:
            raise ValueError(
                f"refusing to move {LATEST_KEY} from {now} back to {version}: another publisher "
                "is writing to this bucket"
            )
        pointer = LatestPointer(
            version=version, manifest_key=manifest.key, state_digest=state_digest
        )
        self.bucket.put_bytes(LATEST_KEY, self._signed(pointer.model_dump_json(indent=1).encode()))
        self.reader.accept(pointer)
        if manifest.has_anchor:
            self._last_anchor, self._last_anchor_known = version, True
            self._anchor_requested = False
        logger.info(
            "published version %d to %s: %s (%d bytes)",
            version,
            self.bucket.uri,
            ", ".join(
                f"{o.kind}:{o.format}" + (f" chained on {o.context_version}" if o.chained else "")
                for o in refs
            ),
            manifest.total_bytes,
        )
        return manifest
