"""Weight versions as the coordinator records them.

The trainer publishes a version *after* its objects are in the bucket (objects first, then the
coordinator record), so a worker that learns of version ``v`` here can always fetch it.
Versions are consecutive integers: version ``v`` is accepted only when ``v == latest + 1`` (the
first one may be any non-negative integer but must be an anchor).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .common import WireModel

VersionKind = Literal["anchor", "delta"]


class ObjectRef(WireModel):
    """One immutable object in the bucket."""

    key: str = Field(
        min_length=1,
        max_length=1024,
        description="Object key relative to the bucket root, e.g. 'deltas/v000012.dlt'.",
    )
    size_bytes: int = Field(ge=0, description="Size of the object in bytes.")
    digest: str | None = Field(
        default=None,
        max_length=256,
        description="Digest of the object's bytes as '<algo>:<hex>' (e.g. 'xxh3-128:...'); None "
        "if the publisher did not compute one.",
    )


class VersionPublish(WireModel):
    """``POST /v1/versions`` body (trainer role)."""

    version: int = Field(ge=0, description="Policy version number; must be latest + 1.")
    kind: VersionKind = Field(
        description="'anchor': a full checkpoint (base_version None); 'delta': a sparse delta "
        "from base_version."
    )
    base_version: int | None = Field(
        default=None,
        ge=0,
        description="Version the delta applies to (an already published version < version); None "
        "for an anchor.",
    )
    objects: list[ObjectRef] = Field(
        min_length=1,
        max_length=4096,
        description="Objects a replica fetches to apply this version (in apply order).",
    )
    full_bytes: int = Field(
        ge=0,
        description="Bytes of a full (uncompressed) checkpoint of this version, to compare delta "
        "sizes against.",
    )
    state_digest: str = Field(
        min_length=1,
        max_length=256,
        description="Digest of the whole state at this version (weightsync state_digest, hex).",
    )
    base_digest: str | None = Field(
        default=None,
        max_length=256,
        description="Digest of the base state a delta applies to; None for an anchor.",
    )
    trainer_step: int = Field(ge=0, description="Optimizer step that produced these weights.")
    published_at: float = Field(
        ge=0, description="Trainer's wall clock when the objects were written (Unix seconds)."
    )

    @model_validator(mode="after")
    def _kind_matches_base(self) -> VersionPublish:
        if self.kind == "anchor" and self.base_version is not None:
            raise ValueError("an anchor has no base_version (set it to null)")
        if self.kind == "delta":
            if self.base_version is None:
                raise ValueError("a delta needs base_version")
            if self.base_version >= self.version:
                raise ValueError(
                    f"base_version {self.base_version} must be older than version {self.version}"
                )
        return self

    @property
    def total_bytes(self) -> int:
        """Bytes a replica downloads to apply this version: the sum of its objects' sizes."""
        return sum(o.size_bytes for o in self.objects)


class VersionRecord(VersionPublish):
    """A published version as stored (the publish body plus the coordinator's bookkeeping)."""

    recorded_at: float = Field(description="Coordinator's wall clock at acceptance (Unix s).")
    anchor_version: int = Field(
        description="The anchor this version's chain starts from (itself for an anchor)."
    )
    bytes: int = Field(ge=0, description="Sum of object sizes (what a replica downloads).")
