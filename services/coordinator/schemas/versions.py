"""Weight versions as the coordinator records them.

The trainer publishes a version with the weight-sync library's :class:`VersionManifest` (the very
record it wrote to ``manifests/v….json`` in the bucket). Order of calls for the trainer: write
the objects, the manifest and the ``latest`` pointer to the bucket, *then* ``POST /v1/versions``
with the manifest; so a worker that learns of version ``v`` here can always fetch it.

The bucket is the one source of truth for manifests: the coordinator checks the manifest, keeps a
:class:`VersionRecord` (a summary: kind, digests, sizes, anchors, times, the model's limits and
:func:`manifest_digest`) and drops the manifest itself. Workers plan their catch-up from the
bucket's manifests (``weightsync/planner.py``).

Versions are strictly increasing (gaps allowed, as in the bucket); the first must carry an
anchor; every delta's base must be a recorded version whose state digest matches.
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import Field

from deltarl.services.coordinator.schemas.common import Count, Version, WireModel
from deltarl.services.coordinator.schemas.trajectories import ModelLimits
from deltarl.weightsync.manifest import ObjectRef, VersionManifest

VersionKind = Literal["anchor", "delta"]

__all__ = [
    "ChallengePair",
    "ChallengePool",
    "ChallengePoolResult",
    "ChallengePoolStatus",
    "ObjectRef",
    "VersionKind",
    "VersionManifest",
    "VersionPublish",
    "VersionRecord",
    "manifest_digest",
]

MAX_CHALLENGES = 4096  # pairs per request and per version's pool


def manifest_digest(manifest: VersionManifest) -> str:
    """SHA-256 (hex) of the manifest's canonical JSON: ``model_dump(mode="json")`` (no
    signature), keys sorted, no spaces. Equal manifests give equal digests whatever the JSON they
    arrived as; the coordinator compares it to tell a retried publish from a different one."""
    doc = manifest.model_dump(mode="json")
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


class VersionPublish(WireModel):
    """``POST /v1/versions`` body (trainer role)."""

    manifest: VersionManifest = Field(
        description="The version's manifest exactly as published in the bucket."
    )
    limits: ModelLimits | None = Field(
        default=None,
        description="What the trained model takes (vocabulary, context): groups outside them "
        "are refused at submission. None: only the wire's own bounds are checked.",
    )


class VersionRecord(WireModel):
    """A recorded version: a summary of its manifest, derived at acceptance. The manifest itself
    stays in the bucket (``manifests/v….json``), the one source of truth for its objects."""

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
    manifest_digest: str = Field(
        pattern=r"^[0-9a-f]{64}$",
        description="SHA-256 of the published manifest's canonical JSON (manifest_digest()): "
        "a re-publish of this version is accepted only with the same digest.",
    )
    limits: ModelLimits | None = Field(
        default=None,
        description="The model's limits the trainer registered with this version; None: none.",
    )


class ChallengePair(WireModel):
    """A nonce and the answer the trainer computed on its own state (never shown to anyone)."""

    nonce: str = Field(pattern=r"^[0-9a-f]{64}$", description="32 random bytes (hex).")
    answer: str = Field(
        pattern=r"^[0-9a-f]{64}$", description="proof_answer on the trainer's state."
    )


class ChallengePool(WireModel):
    """``POST /v1/versions/{version}/challenges`` body (trainer role): weight challenges for a
    recorded version, each to be issued once to a worker serving it (docs/security.md)."""

    chunk_bytes: int = Field(ge=1, le=1 << 20, description="Bytes per sampled chunk.")
    chunks: int = Field(ge=0, le=65_536, description="Chunks sampled per proof; 0: all.")
    items: list[ChallengePair] = Field(
        min_length=1, max_length=MAX_CHALLENGES, description="Fresh (nonce, answer) pairs."
    )


class ChallengePoolResult(WireModel):
    """Answer to a challenge upload."""

    version: Version = Field(description="The version the pairs are for.")
    added: Count = Field(description="Pairs added (a nonce already known is skipped).")
    pool_size: Count = Field(description="Unused pairs now in this version's pool.")
    target: Count = Field(
        default=0,
        description="Unused pairs the coordinator wants in this version's pool now: one per "
        "active worker not yet challenged at it, plus a spare (8 and a quarter "
        "of the active workers) for retries and joining workers.",
    )
    wanted: Count = Field(
        default=0,
        description="More pairs to post for this version now: max(0, target - pool_size), at "
        f"most {MAX_CHALLENGES} in the pool.",
    )


class ChallengePoolStatus(WireModel):
    """``GET /v1/versions/{version}/challenges``: where a version's weight challenges stand (the
    answers are never shown). An operator sees starvation here: ``workers_waiting`` > 0."""

    version: Version = Field(description="The version.")
    posted: bool = Field(description="The trainer posted challenges for this version.")
    pool_size: Count = Field(description="Pairs not issued yet.")
    target: Count = Field(description="Unused pairs wanted now (see ChallengePoolResult).")
    wanted: Count = Field(
        description="More pairs the trainer should post now (0 before its first post: it may "
        "publish no challenges)."
    )
    workers_active: Count = Field(
        description="Active workers that may still serve this version (applied version at most "
        "this one, or none yet)."
    )
    workers_challenged: Count = Field(
        description="Workers issued at least one challenge at this version."
    )
    workers_unchallenged: Count = Field(
        description="Active workers never issued a challenge at this version yet."
    )
    workers_waiting: Count = Field(
        description="Active workers serving this version, unproven there, that asked for a "
        "challenge the pool could not give (used up): they wait for the trainer's top-up."
    )
