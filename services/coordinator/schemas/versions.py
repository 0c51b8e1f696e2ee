"""Weight versions as the coordinator records them.

A version is described by the weight-sync library's :class:`VersionManifest` (the very record
the trainer wrote to ``manifests/v….json`` in the bucket): its anchors and incoming deltas with
sizes, digests and bases. Order of calls for the trainer: write the objects, the manifest and the
``latest`` pointer to the bucket, *then* ``POST /v1/versions`` with the manifest; so a worker
that learns of version ``v`` here can always fetch it.

Versions are strictly increasing (gaps allowed, as in the bucket); the first must carry an
anchor; every delta's base must be a recorded version whose state digest matches.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from deltarl.services.coordinator.schemas.common import Count, Version, WireModel
from deltarl.services.weightsync.manifest import ObjectRef, VersionManifest

VersionKind = Literal["anchor", "delta"]

__all__ = ["ObjectRef", "VersionKind", "VersionManifest", "VersionPublish", "VersionRecord"]


class VersionPublish(WireModel):
    """``POST /v1/versions`` body (trainer role)."""

    manifest: VersionManifest = Field(
        description="The version's manifest exactly as published in the bucket."
    )


class VersionRecord(WireModel):
    """A recorded version: the manifest plus a summary derived from it at acceptance."""

    version: Version = Field(description="Policy version number.")
    kind: VersionKind = Field(
        description="'anchor' if the manifest carries a full checkpoint, else 'delta'."
    )
    trainer_step: Count | None = Field(description="Optimizer step; None if the trainer gave none.")
    state_digest: str = Field(description="Digest of the full state at this version (hex).")
    previous_version: Version | None = Field(
        description="The version recorded just before this one; None for the first."
    )
    delta_bytes: Count | None = Field(
        description="Size of the smallest delta from previous_version (bytes); None if none."
    )
    anchor_bytes: Count | None = Field(
        description="Size of the smallest anchor of this version (bytes); None if none."
    )
    bytes: Count = Field(
        description="What an up-to-date replica downloads: delta_bytes if a delta from the "
        "previous version exists, else anchor_bytes, else the smallest object."
    )
    full_bytes: Count = Field(description="Raw size of the whole state (bytes).")
    anchor_version: Version | None = Field(
        description="Newest version <= this one that carries an anchor; None if none (cannot "
        "happen for accepted versions: the first must carry one)."
    )
    published_at: float = Field(description="Manifest creation time (Unix s).")
    recorded_at: float = Field(description="Coordinator's wall clock at acceptance (Unix s).")
    manifest: VersionManifest = Field(description="The manifest as published (objects, digests).")
