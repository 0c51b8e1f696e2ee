"""The read side of a bucket: :class:`BucketReader` (rollout workers, CLI, planner).

The write side and its publication protocol are :class:`~deltarl.services.weightsync.writer.BucketWriter`
(writer.py). Torch-free.

What a reader (:class:`BucketReader`) can observe: the published versions are exactly the
manifests whose version is <= ``latest.json``'s. A manifest is written after all of its objects
and before the pointer moves past it, so every published manifest refers to complete objects; a
crash at any step leaves ``latest.json`` and every published version untouched (the partial
version's objects and manifest are invisible; retention removes the orphans after a grace
period). ``latest.json`` never moves backwards as long as there is one publisher per bucket (the
trainer); a second, concurrent publisher of the same version is refused at step 3 on the local
and S3 backends (create-if-absent), best effort on HF.
"""

from __future__ import annotations

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

from deltarl.services.buckets.base import Bucket, ObjectNotFoundError
from deltarl.services.weightsync.errors import CorruptDeltaError
from deltarl.services.weightsync.manifest import (
    LATEST_KEY,
    MANIFESTS_PREFIX,
    LatestPointer,
    ObjectPart,
    ObjectRef,
    VersionManifest,
    manifest_key,
    parse_manifest_key,
    xxh3_hex,
)
from deltarl.services.weightsync.planner import CatchUpPlan, plan_catch_up

if TYPE_CHECKING:  # signing imports cryptography: only where keys are configured
    from deltarl.services.weightsync.signing import Verifier

logger = logging.getLogger(__name__)

_CHUNK = 1 << 22


class VersionNotFoundError(ValueError):
    """The version is not published (newer than latest) or no longer kept (garbage-collected)."""


def is_digest(value: object) -> bool:
    return isinstance(value, str) and re.fullmatch(r"[0-9a-f]{16,128}", value) is not None


def file_digest(path: Path) -> tuple[int, str]:
    """(size, xxh3-128 hex) of a local file, read in 4 MiB chunks."""
    h = xxhash.xxh3_128()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


class BucketReader:
    """Read side: the latest pointer, published manifests, verified object fetches, plans.

    Manifests are immutable once published, so they are cached; :meth:`manifests` re-lists the
    bucket on every call (new versions appear, garbage-collected ones disappear).

    Stores without read-after-write consistency (HF Buckets) may show a new ``latest.json``
    before its manifest: the latest version's manifest is never garbage-collected, so a "not
    found" for it is retried ``latest_retries`` times (0.25 s, doubling) before giving up.
    """

    def __init__(
        self, bucket: Bucket, *, latest_retries: int = 4, verifier: Verifier | None = None
    ) -> None:
        self.bucket = bucket
        self.latest_retries = latest_retries
        self.verifier = verifier  # trusted keys: unsigned or badly signed versions are refused
        self._cache: dict[int, VersionManifest] = {}
        self.fetched_bytes = 0  # object bytes downloaded by fetch/fetch_to_file, verified or not

    def latest(self) -> LatestPointer | None:
        """The ``latest.json`` pointer, or None before the first publish."""
        try:
            raw = self.bucket.get_bytes(LATEST_KEY)
        except ObjectNotFoundError:
            return None
        if self.verifier is not None:
            self.verifier.verify(raw, f"{LATEST_KEY} in {self.bucket.uri}")
        try:
            return LatestPointer.model_validate_json(raw)
        except ValidationError as err:
            raise CorruptDeltaError(
                f"{LATEST_KEY} in {self.bucket.uri} is invalid: {err}"
            ) from None

    def latest_version(self) -> int | None:
        ptr = self.latest()
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
        """The object's bytes, verified: CorruptDeltaError if missing, truncated or tampered.
        A sharded object (``ref.parts``) is read with :meth:`fetch_parts` instead."""
        if ref.parts is not None:
            raise ValueError(f"{ref.key} is sharded: read its parts with fetch_parts")
        return self._fetch_one(ref, ref.key, ref.size, ref.xxh3_128)

    def fetch_parts(
        self, ref: ObjectRef, threads: int = 8
    ) -> Generator[tuple[ObjectPart, bytes], None, None]:
        """The parts of a sharded object, each verified, fetched ``threads`` at a time and
        yielded as they arrive (any order); CorruptDeltaError for a missing or damaged part."""
        if ref.parts is None:
            raise ValueError(f"{ref.key} is not sharded: read it with fetch")
        with ThreadPoolExecutor(max(1, min(threads, len(ref.parts)))) as pool:
            jobs = {
                pool.submit(self._fetch_one, ref, p.key, p.size, p.xxh3_128): p for p in ref.parts
            }
            try:
                for job in as_completed(jobs):
                    yield jobs[job], job.result()
            finally:
                for job in jobs:
                    job.cancel()

    def _fetch_one(self, ref: ObjectRef, key: str, size: int, xxh3: str) -> bytes:
        try:
            data = self.bucket.get_bytes(key)
        except ObjectNotFoundError:
            raise CorruptDeltaError(
                f"{ref.kind} {key} of version {ref.version} is missing from {self.bucket.uri} "
                "(garbage-collected or never uploaded): plan again"
            ) from None
        self.fetched_bytes += len(data)  # an int += under the GIL: parts may race, bytes add up
        self._check(key, size, xxh3, len(data), xxh3_hex(data))
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
            size, digest = file_digest(tmp)
            self.fetched_bytes += size
            self._check(ref.key, ref.size, ref.xxh3_128, size, digest)
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
