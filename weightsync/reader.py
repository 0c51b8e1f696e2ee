"""The read side of a bucket: :class:`BucketReader` (rollout workers, CLI, planner).

The write side and its publication protocol are :class:`~deltarl.weightsync.writer.BucketWriter`
(writer.py). Torch-free.

What a reader (:class:`BucketReader`) can observe: the published versions are exactly the
manifests whose version is <= ``latest.json``'s. A manifest is written after all of its objects
and before the pointer moves past it, so every published manifest refers to complete objects; a
crash at any step leaves ``latest.json`` and every published version untouched (the partial
version's objects and manifest are invisible; retention removes the orphans after a grace
period). ``latest.json`` never moves backwards as long as there is one publisher per bucket (the
trainer); a second, concurrent publisher of the same version is refused at step 3 on the local
and S3 backends (create-if-absent), best effort on HF.

Guarantees against whoever can write the bucket (docs/security.md):

* Every object fetched is checked against its manifest's size and xxh3-128 (damage) and, when
  the manifest records one, its SHA-256 (forgery), before any byte is returned for decoding. A
  reader with trusted keys (``verifier``) accepts only signed manifests and pointers, and only
  signed manifests whose objects all carry SHA-256: the signature then binds every byte.
* A reader never goes back: once it accepted ``latest.json`` at version ``v`` (its
  :attr:`BucketReader.floor`), a pointer at an older version, or at ``v`` with another state
  digest, is refused (:class:`RollbackError`; the publisher's own reader goes on from its floor
  instead); an old pointer, validly signed, put back by someone who can write the bucket is
  therefore never followed. A manifest, once accepted, is kept. A reader with trusted keys
  also refuses a manifest of the pointer's version whose state digest is not the pointer's
  (a manifest of a crashed, never committed publish put back).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
import uuid
from collections.abc import Collection, Generator
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import TYPE_CHECKING

import xxhash
from pydantic import ValidationError

from deltarl.buckets.base import Bucket, ObjectNotFoundError
from deltarl.weightsync.errors import CorruptDeltaError
from deltarl.weightsync.manifest import (
    LATEST_KEY,
    MANIFESTS_PREFIX,
    LatestPointer,
    ObjectPart,
    ObjectRef,
    VersionManifest,
    manifest_key,
    parse_manifest_key,
    sha256_hex,
    xxh3_hex,
)
from deltarl.weightsync.planner import CatchUpPlan, plan_catch_up

if TYPE_CHECKING:  # signing imports cryptography: only where keys are configured
    from deltarl.weightsync.signing import Verifier

logger = logging.getLogger(__name__)

_CHUNK = 1 << 22


class VersionNotFoundError(ValueError):
    """The version is not published (newer than latest) or no longer kept (garbage-collected)."""


class RollbackError(CorruptDeltaError):
    """``latest.json`` is older than a pointer this reader already accepted (a lower version, or
    the same version with another state digest): an old pointer put back by someone who can
    write the bucket (its signature is still valid), or a store that went back; the reader
    does not follow it."""


def is_digest(value: object) -> bool:
    return isinstance(value, str) and re.fullmatch(r"[0-9a-f]{16,128}", value) is not None


def file_digest(path: Path, *, sha256: bool = False) -> tuple[int, str, str | None]:
    """(size, xxh3-128 hex, SHA-256 hex or None) of a local file, read once in 4 MiB chunks;
    SHA-256 only when ``sha256``."""
    h = xxhash.xxh3_128()
    strong = hashlib.sha256() if sha256 else None
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            if strong is not None:
                strong.update(chunk)
            size += len(chunk)
    return size, h.hexdigest(), None if strong is None else strong.hexdigest()


class BucketReader:
    """Read side: the latest pointer, published manifests, verified object fetches, plans.

    Manifests are immutable once published, so they are cached; :meth:`manifests` re-lists the
    bucket on every call (new versions appear, garbage-collected ones disappear).

    Stores without read-after-write consistency (HF Buckets) may show a new ``latest.json``
    before its manifest: the latest version's manifest is never garbage-collected, so a "not
    found" for it is retried ``latest_retries`` times (0.25 s, doubling) before giving up.

    ``keep_floor``: :meth:`latest_version` answers :attr:`floor` for a pointer older than it
    (logged as a warning) instead of raising :class:`RollbackError`: the publisher's own
    reader (``BucketWriter.reader``), which knows what it wrote and publishes over it.
    """

    def __init__(
        self,
        bucket: Bucket,
        *,
        latest_retries: int = 4,
        verifier: Verifier | None = None,
        keep_floor: bool = False,
    ) -> None:
        self.bucket = bucket
        self.latest_retries = latest_retries
        self.keep_floor = keep_floor
        self.verifier = verifier  # trusted keys: unsigned or badly signed versions are refused
        self._cache: dict[int, VersionManifest] = {}
        self._pointer: LatestPointer | None = None  # the newest pointer accepted
        self.fetched_bytes = 0  # object bytes downloaded by fetch/fetch_to_file, verified or not

    @property
    def floor(self) -> int | None:
        """The newest version this reader accepted ``latest.json`` at: an older pointer is
        refused (:class:`RollbackError`). None: no pointer accepted yet."""
        return None if self._pointer is None else self._pointer.version

    def latest(self) -> LatestPointer | None:
        """The ``latest.json`` pointer, or None before the first publish.

        Raises :class:`RollbackError` for a pointer older than :attr:`floor` (or at it with
        another state digest), and with trusted keys signing errors for one they did not sign.
        """
        try:
            raw = self.bucket.get_bytes(LATEST_KEY)
        except ObjectNotFoundError:
            return None
        what = f"{LATEST_KEY} in {self.bucket.uri}"
        if self.verifier is not None:
            self.verifier.verify(raw, what)
        try:
            ptr = LatestPointer.model_validate_json(raw)
        except ValidationError as err:
            raise CorruptDeltaError(f"{what} is invalid: {err}") from None
        self.accept(ptr, what)
        return ptr

    def accept(self, ptr: LatestPointer, what: str = LATEST_KEY) -> None:
        """Make ``ptr`` the newest accepted pointer (the writer calls it with the pointer it
        wrote); :class:`RollbackError` if it would move :attr:`floor` back."""
        held = self._pointer
        if held is not None and (
            ptr.version < held.version
            or (ptr.version == held.version and ptr.state_digest != held.state_digest)
        ):
            seen = f"version {ptr.version}" + (
                f" with state digest {ptr.state_digest}" if ptr.version == held.version else ""
            )
            raise RollbackError(
                f"{what} points at {seen}, but this reader already accepted version "
                f"{held.version} (state digest {held.state_digest}): an older pointer put back "
                "(replayed), or a store that went back; it is not used"
            )
        self._pointer = ptr

    def latest_version(self) -> int | None:
        """The pointer's version (None before the first publish); an older pointer than
        :attr:`floor` raises :class:`RollbackError`, or with ``keep_floor`` gives the floor."""
        try:
            ptr = self.latest()
        except RollbackError as err:
            if not self.keep_floor:
                raise
            logger.warning("%s; going on from version %s", err, self.floor)
            return self.floor
        return None if ptr is None else ptr.version

    def load_manifest(self, version: int) -> VersionManifest:
        """Read and validate the manifest of ``version``, published or not (no cache)."""
        key = manifest_key(version)
        raw = self.bucket.get_bytes(key)
        if self.verifier is not None:
            self.verifier.verify(raw, f"manifest {key} in {self.bucket.uri}")
        try:
            m = VersionManifest.model_validate_json(raw)
        except ValidationError as err:
            raise CorruptDeltaError(
                f"manifest {key} in {self.bucket.uri} is invalid: {err}"
            ) from None
        if m.version != version:
            raise CorruptDeltaError(f"manifest {key} describes version {m.version}")
        if self.verifier is not None:
            self.verifier.require_hashes(m.objects, f"manifest {key} in {self.bucket.uri}")
            ptr = self._pointer
            if ptr is not None and ptr.version == version and ptr.state_digest != m.state_digest:
                raise CorruptDeltaError(
                    f"manifest {key} in {self.bucket.uri} has state digest {m.state_digest}, "
                    f"the signed {LATEST_KEY} says {ptr.state_digest}: a manifest of a publish "
                    "that was never committed, put back?"
                )
        return m

    def manifest(self, version: int, *, latest: int | None = None) -> VersionManifest:
        """The published manifest of ``version`` (VersionNotFoundError if unpublished or gone)."""
        if version in self._cache:
            return self._cache[version]
        latest = self.latest_version() if latest is None else latest
        if latest is None or version > latest:
            raise VersionNotFoundError(f"version {version} is not published (latest: {latest})")
        delay = 0.25
        for attempt in range(self.latest_retries + 1):
            try:
                m = self.load_manifest(version)
                break
            except ObjectNotFoundError:
                if version != latest or attempt == self.latest_retries:
                    raise VersionNotFoundError(
                        f"version {version} is not in {self.bucket.uri} (garbage-collected, or "
                        "the store is lagging)"
                    ) from None
                logger.info("manifest of latest version %d not visible yet; retrying", version)
                time.sleep(delay)
                delay *= 2
        self._cache[version] = m
        return m

    def manifests(self, *, latest: int | None = None) -> dict[int, VersionManifest]:
        """Every published manifest (version <= latest), by version."""
        latest = self.latest_version() if latest is None else latest
        if latest is None:
            return {}
        listed = {
            v
            for o in self.bucket.list(MANIFESTS_PREFIX)
            if (v := parse_manifest_key(o.key)) is not None and v <= latest
        }
        for v in list(self._cache):
            if v not in listed:
                del self._cache[v]
        out: dict[int, VersionManifest] = {}
        for v in sorted(listed):
            try:
                out[v] = self.manifest(v, latest=latest)
            except VersionNotFoundError:  # deleted between the listing and the read
                continue
        return out

    def plan(
        self,
        current: int | None,
        target: int | None = None,
        *,
        formats: Collection[str] | None = None,
        context: int | None = None,
    ) -> CatchUpPlan:
        """Cheapest plan from ``current`` to ``target`` (default: latest); ``context``: base
        version of the delta the replica applied last (see :mod:`.planner`)."""
        latest = self.latest_version()
        if latest is None:
            raise VersionNotFoundError(f"nothing is published in {self.bucket.uri} yet")
        target = latest if target is None else target
        return plan_catch_up(
            self.manifests(latest=latest), current, target, formats=formats, context=context
        )

    def fetch(self, ref: ObjectRef) -> bytes:
        """The object's bytes, verified: CorruptDeltaError if missing, truncated or tampered
        (size, xxh3-128, and SHA-256 when the manifest records it, all checked before the bytes
        are returned). A sharded object (``ref.parts``) is read with :meth:`fetch_parts`."""
        if ref.parts is not None:
            raise ValueError(f"{ref.key} is sharded: read its parts with fetch_parts")
        return self._fetch_one(ref, ref.key, ref.size, ref.xxh3_128, ref.sha256)

    def fetch_parts(
        self, ref: ObjectRef, threads: int = 8
    ) -> Generator[tuple[ObjectPart, bytes], None, None]:
        """The parts of a sharded object, each verified like :meth:`fetch` (its SHA-256 computed
        in its own thread: parts hash in parallel), fetched ``threads`` at a time and yielded as
        they arrive (any order); CorruptDeltaError for a missing or damaged part."""
        if ref.parts is None:
            raise ValueError(f"{ref.key} is not sharded: read it with fetch")
        with ThreadPoolExecutor(max(1, min(threads, len(ref.parts)))) as pool:
            jobs = {
                pool.submit(self._fetch_one, ref, p.key, p.size, p.xxh3_128, p.sha256): p
                for p in ref.parts
            }
            try:
                for job in as_completed(jobs):
                    yield jobs[job], job.result()
            finally:
                for job in jobs:
                    job.cancel()

    def _fetch_one(
        self, ref: ObjectRef, key: str, size: int, xxh3: str, sha256: str | None
    ) -> bytes:
        try:
            data = self.bucket.get_bytes(key)
        except ObjectNotFoundError:
            raise CorruptDeltaError(
                f"{ref.kind} {key} of version {ref.version} is missing from {self.bucket.uri} "
                "(garbage-collected or never uploaded): plan again"
            ) from None
        self.fetched_bytes += len(data)  # an int += under the GIL: parts may race, bytes add up
        self._check(key, size, xxh3, len(data), xxh3_hex(data))
        if sha256 is not None:  # hashlib releases the GIL: parts hash in parallel
            self._check_sha256(key, sha256, sha256_hex(data))
        return data

    def fetch_to_file(self, ref: ObjectRef, path: str | Path) -> Path:
        """Download to ``path`` and verify; on any mismatch no file is left at ``path``."""
        dest = Path(path)
        tmp = dest.with_name(f".{dest.name}.fetch-{uuid.uuid4().hex}")
        try:
            try:
                self.bucket.download_file(ref.key, tmp)
            except ObjectNotFoundError:
                raise CorruptDeltaError(
                    f"{ref.kind} {ref.key} of version {ref.version} is missing from "
                    f"{self.bucket.uri} (garbage-collected or never uploaded): plan again"
                ) from None
            if ref.parts is not None:
                raise ValueError(f"{ref.key} is sharded: read its parts with fetch_parts")
            size, digest, strong = file_digest(tmp, sha256=ref.sha256 is not None)
            self.fetched_bytes += size
            self._check(ref.key, ref.size, ref.xxh3_128, size, digest)
            if ref.sha256 is not None and strong is not None:
                self._check_sha256(ref.key, ref.sha256, strong)
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        return dest

    @staticmethod
    def _check(key: str, want_size: int, want: str, size: int, digest: str) -> None:
        if size != want_size:
            raise CorruptDeltaError(
                f"{key}: got {size} bytes, the manifest says {want_size} (truncated or replaced)"
            )
        if digest != want:
            raise CorruptDeltaError(
                f"{key}: xxh3-128 {digest} does not match the manifest's {want} "
                "(corrupted or tampered)"
            )

    @staticmethod
    def _check_sha256(key: str, want: str, digest: str) -> None:
        if digest != want:
            raise CorruptDeltaError(
                f"{key}: SHA-256 {digest} does not match the manifest's {want} (replaced: its "
                "xxh3-128 may match, xxh3 is not a cryptographic hash)"
            )
