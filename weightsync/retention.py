"""Garbage collection of a publication bucket that never deletes what a plan may still need.

Torch-free. Policy (:class:`RetentionPolicy`):

* Keep the newest ``keep_anchors`` versions that have an anchor; the oldest of them is the
  *cutoff*. Every published version at or after the cutoff is *retained* with all of its objects
  (manifests are immutable, so a version is kept or deleted whole). Versions before the cutoff
  are deleted, except that the cutoff moves further back (to the previous anchor, and so on)
  while some retained version that is reachable today would become unreachable from nothing
  (e.g. its only incoming delta is a squashed one from before the cutoff). Thus, after a GC,
  every plan (:func:`~.planner.plan_catch_up`) from any retained version or from nothing to any
  retained version (the latest included) still exists, and every plan that uses only objects of
  retained versions still works.
* Objects under ``objects/`` that no manifest references (published or not: a pending manifest
  protects its objects) are *orphans*, e.g. left by a crash mid-publish. They are deleted only
  when older than ``orphan_grace_s``, which must exceed the longest publish (objects are written
  before their manifest).

Order of operations in :func:`collect_garbage`: read ``latest.json``; list and read manifests;
list objects (after the manifests, so that objects of a publish that starts meanwhile are young,
hence in grace); delete the doomed manifests first, then their objects, then old orphans. A reader
therefore never sees a manifest whose objects are gone — except one it read before the GC, whose
``fetch`` then raises ``CorruptDeltaError("... missing ...: plan again")``. Run it from the
publishing process (the trainer), e.g. after each publish; it never touches ``latest.json``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from pydantic import BaseModel, ConfigDict, Field

from deltarl.buckets.base import Bucket
from deltarl.weightsync.manifest import (
    MANIFESTS_PREFIX,
    OBJECTS_PREFIX,
    VersionManifest,
    parse_manifest_key,
)
from deltarl.weightsync.planner import reachable_versions
from deltarl.weightsync.reader import BucketReader

logger = logging.getLogger(__name__)


class RetentionPolicy(BaseModel):
    """How much history a bucket keeps."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    keep_anchors: int = Field(
        default=2,
        ge=1,
        description="Newest anchored versions to keep; every version after the oldest of them "
        "is kept too.",
    )
    orphan_grace_s: float = Field(
        default=3600.0,
        ge=0,
        description="Seconds an unreferenced object is left alone (must exceed one publish).",
    )


@dataclass(slots=True)
class GcReport:
    """What a GC run decided (and, unless ``dry_run``, did)."""

    latest: int | None
    cutoff: int | None  # oldest retained version; None: nothing deleted by version
    retained_versions: list[int] = field(default_factory=list)
    deleted_versions: list[int] = field(default_factory=list)
    deleted_manifests: list[str] = field(default_factory=list)
    deleted_objects: list[str] = field(default_factory=list)  # of deleted versions and orphans
    orphans_in_grace: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    dry_run: bool = False


def choose_cutoff(published: Mapping[int, VersionManifest], keep_anchors: int) -> int | None:
    """Oldest version to retain (see the module docstring), or None to retain everything."""
    anchored = sorted((v for v, m in published.items() if m.has_anchor), reverse=True)
    if len(anchored) <= keep_anchors:
        return None
    reachable_now = reachable_versions(published)
    for cutoff in anchored[keep_anchors - 1 :]:
        retained = {v: m for v, m in published.items() if v >= cutoff}
        if reachable_now & set(retained) <= reachable_versions(retained):
            return cutoff
    return None


def collect_garbage(
    bucket: Bucket,
    policy: RetentionPolicy | None = None,
    *,
    now: datetime | None = None,
    dry_run: bool = False,
) -> GcReport:
    """Delete old versions and old orphans from ``bucket`` per ``policy`` (module docstring)."""
    policy = policy or RetentionPolicy()
    now = now or datetime.now(UTC)
    reader = BucketReader(bucket)
    latest = reader.latest_version()
    # Every manifest, published or pending (a pending one still protects its objects).
    all_manifests: dict[int, VersionManifest] = {}
    manifest_sizes: dict[str, int] = {}
    for info in bucket.list(MANIFESTS_PREFIX):
        v = parse_manifest_key(info.key)
        if v is not None:
            all_manifests[v] = reader.load_manifest(v)
            manifest_sizes[info.key] = info.size
    objects = bucket.list(OBJECTS_PREFIX)  # listed after the manifests (see docstring)

    published = {v: m for v, m in all_manifests.items() if latest is not None and v <= latest}
    cutoff = choose_cutoff(published, policy.keep_anchors)
    doomed = sorted(v for v in published if cutoff is not None and v < cutoff)
    report = GcReport(latest=latest, cutoff=cutoff, dry_run=dry_run)
    report.retained_versions = sorted(v for v in published if v not in doomed)
    report.deleted_versions = doomed
    assert latest is None or latest not in doomed, "GC must never delete the latest version"

    kept = {v: m for v, m in all_manifests.items() if v not in doomed}
    referenced = {k for m in kept.values() for o in m.objects for k in o.keys}
    sizes = {o.key: o.size for o in objects}
    doomed_objects = [
        k
        for v in doomed
        for o in all_manifests[v].objects
        for k in o.keys  # every part of a sharded object
        if k not in referenced and k in sizes
    ]
    doomed_set = set(doomed_objects)
    grace_cut = now.timestamp() - policy.orphan_grace_s
    orphans: list[str] = []
    for info in objects:
        if info.key in referenced or info.key in doomed_set:
            continue
        if info.modified is not None and info.modified.timestamp() <= grace_cut:
            orphans.append(info.key)
        else:  # young, or of unknown age: maybe a publish in progress
            report.orphans_in_grace.append(info.key)
    report.deleted_manifests = [all_manifests[v].key for v in doomed]
    report.deleted_objects = doomed_objects + orphans
    report.freed_bytes = sum(sizes[k] for k in report.deleted_objects) + sum(
        manifest_sizes[k] for k in report.deleted_manifests
    )
    if dry_run:
        return report
    if report.deleted_manifests:
        bucket.delete_many(report.deleted_manifests)  # manifests first: readers stop seeing them
    if report.deleted_objects:
        bucket.delete_many(report.deleted_objects)
    logger.info(
        "gc %s: kept versions %s..%s, deleted %d version(s), %d object(s) (%d orphan(s)), "
        "%d bytes; %d orphan(s) in grace",
        bucket.uri,
        report.retained_versions[0] if report.retained_versions else None,
        latest,
        len(doomed),
        len(report.deleted_objects),
        len(orphans),
        report.freed_bytes,
        len(report.orphans_in_grace),
    )
    return report
