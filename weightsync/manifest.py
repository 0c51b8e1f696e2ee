"""Wire records of versioned publication: per-version manifests and the ``latest`` pointer.

Torch-free (pydantic + xxhash only): the trainer, the rollout workers, the coordinator and the
planner all read these. Bucket layout (all keys relative to the bucket's root/prefix)::

    objects/v000000000123/<uuid32>.<ext>   immutable payloads (anchors, deltas), unique names
    manifests/v000000000123.json           one VersionManifest per version, written once
    latest.json                            LatestPointer, moved forward only

A version's *state* is the full set of model weights after trainer step ``step``; its
``state_digest`` is the codec's combined digest of that state (``digest.state_digest``, xxh3-128
hex). An object either rebuilds the state from nothing (``anchor``) or turns the state of
``base_version`` into it (``delta``); a delta whose base is older than the previous version is a
"squashed" one that lets lagging replicas skip versions.

Integrity: every :class:`ObjectRef` records its object's size and xxh3-128 (damage); a signing
writer also records its SHA-256 (``sha256``, and each part's), which is what ties the bytes to
the signed manifest (xxh3 is not a cryptographic hash). :func:`manifest_json` leaves unrecorded
``sha256`` members out, so an unsigned manifest reads and writes as before the field existed.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any, Literal

import xxhash
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, field_validator, model_validator

from deltarl.buckets.base import validate_key

MANIFEST_SCHEMA_VERSION = 1
LATEST_KEY = "latest.json"
MANIFESTS_PREFIX = "manifests/"
OBJECTS_PREFIX = "objects/"
VERSION_DIGITS = 12
#: Versions have at most VERSION_DIGITS digits (their keys are zero-padded to that width).
MAX_VERSION = 10**VERSION_DIGITS - 1
#: The largest integer of any wire record (sizes, counts, steps): a signed 64-bit integer, what
#: the coordinator's stores (SQLite INTEGER, Redis) and every reader's arithmetic hold.
INT64_MAX = (1 << 63) - 1

ObjectKind = Literal["anchor", "delta"]

_HEX_DIGEST = r"^[0-9a-f]{16,128}$"
_SHA256 = r"^[0-9a-f]{64}$"
_FORMAT = r"^[a-z0-9][a-z0-9.+_-]{0,63}$"
_MANIFEST_KEY = re.compile(rf"^manifests/v(\d{{{VERSION_DIGITS}}})\.json$")

#: Known format tags (``codec.FORMAT_TAGS`` for deltas) -> file extension of their objects;
#: unknown formats get ``.bin``.
FORMAT_EXTENSIONS: dict[str, str] = {
    "deltarl-compact-v1": "dlt",
    "deltarl-compact-v2": "dlt",
    "deltarl-compact-v3": "dlt",
    "trl-sparse-raw": "safetensors",
    "trl-sparse-gap_delta": "safetensors",
    "safetensors": "safetensors",
    "safetensors+zstd": "safetensors.zst",
}


def xxh3_hex(data: bytes | bytearray | memoryview) -> str:
    """xxh3-128 of ``data`` as 32 lowercase hex characters (the ``ObjectRef.xxh3_128`` form)."""
    return xxhash.xxh3_128_hexdigest(data)


def sha256_hex(data: bytes | bytearray | memoryview) -> str:
    """SHA-256 of ``data`` as 64 lowercase hex characters (the ``ObjectRef.sha256`` form)."""
    return hashlib.sha256(data).hexdigest()


def version_tag(version: int) -> str:
    """``123 -> "v000000000123"`` (zero-padded so that keys sort by version)."""
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ValueError(f"version must be a non-negative int, got {version!r}")
    if version >= 10**VERSION_DIGITS:
        raise ValueError(f"version {version} has more than {VERSION_DIGITS} digits")
    return f"v{version:0{VERSION_DIGITS}d}"


def manifest_key(version: int) -> str:
    """Key of the manifest of ``version``: ``manifests/v000000000123.json``."""
    return f"{MANIFESTS_PREFIX}{version_tag(version)}.json"


def parse_manifest_key(key: str) -> int | None:
    """Version of a manifest key, or None if ``key`` is not one."""
    m = _MANIFEST_KEY.match(key)
    return int(m.group(1)) if m else None


def objects_prefix(version: int) -> str:
    """Prefix under which the objects of ``version`` are stored: ``objects/v000000000123/``."""
    return f"{OBJECTS_PREFIX}{version_tag(version)}/"


def _object_key(key: str) -> str:
    validate_key(key)
    if not key.startswith(OBJECTS_PREFIX):
        raise ValueError(f"object key {key!r} must live under {OBJECTS_PREFIX!r}")
    return key


class ObjectPart(BaseModel):
    """One stored piece of a *sharded* object (FSDP2 trainer: one per rank that holds rows).

    A part is an ordinary anchor or delta of the codec whose tensors are row ranges of the
    state's tensors, named by :func:`slice_key` (``"model.embed_tokens.weight[0:4096]"``); its
    positions are local to those rows, so the usual decode and apply code reads it against row
    views of the full tensors. Example::

        ObjectPart(key="objects/v000000000012/91ab...04.dlt", size=402_118, xxh3_128="77c0...",
                   slices=("lm_head.weight[0:75968]", "model.norm.weight[0:1792]"))
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str = Field(description="Object key of this part in the bucket.")
    size: int = Field(ge=0, le=INT64_MAX, description="Exact size of the part in bytes.")
    xxh3_128: str = Field(
        pattern=r"^[0-9a-f]{32}$", description="xxh3-128 of the part's bytes, lowercase hex."
    )
    sha256: str | None = Field(
        default=None,
        pattern=_SHA256,
        description="SHA-256 of the part's bytes, lowercase hex (see ObjectRef.sha256). None: "
        "not recorded.",
    )
    slices: tuple[str, ...] = Field(
        description="Row ranges the part carries, as slice keys 'name[lo:hi]' (rows lo..hi-1 "
        "of tensor 'name'); the parts of an object together cover the sharded layout."
    )

    _key = field_validator("key")(lambda key: _object_key(key))

    @field_validator("slices")
    @classmethod
    def _slices(cls, slices: tuple[str, ...]) -> tuple[str, ...]:
        for s in slices:
            parse_slice_key(s)
        return slices


_SLICE_KEY = re.compile(r"^(.+)\[(\d+):(\d+)\]$")


def slice_key(name: str, lo: int, hi: int) -> str:
    """Name of rows ``lo..hi-1`` of tensor ``name`` in a sharded version: ``"w[0:128]"``."""
    return f"{name}[{lo}:{hi}]"


def parse_slice_key(key: str) -> tuple[str, int, int]:
    """``"w[0:128]" -> ("w", 0, 128)``; ValueError if ``key`` is not a slice key."""
    m = _SLICE_KEY.match(key)
    if m is None or int(m.group(2)) >= int(m.group(3)):
        raise ValueError(f"{key!r} is not a slice key 'name[lo:hi]' with lo < hi")
    return m.group(1), int(m.group(2)), int(m.group(3))


def parts_digest(parts: Iterable[ObjectPart]) -> str:
    """The ``xxh3_128`` of a sharded :class:`ObjectRef`: xxh3 over its parts' digests, in order."""
    return xxh3_hex("".join(f"{p.key}\0{p.xxh3_128}\n" for p in parts).encode())


def parts_sha256(parts: Iterable[ObjectPart]) -> str:
    """The ``sha256`` of a sharded :class:`ObjectRef`: SHA-256 over ``"<key>\\0<sha256>\\n"`` of
    every part, in order (ValueError if a part has none)."""
    lines = []
    for p in parts:
        if p.sha256 is None:
            raise ValueError(f"part {p.key} has no sha256")
        lines.append(f"{p.key}\0{p.sha256}\n")
    return sha256_hex("".join(lines).encode())


class ObjectRef(BaseModel):
    """One immutable object of a version, with what a reader needs to verify and plan with it.

    Example::

        ObjectRef(key="objects/v000000000012/3f2a...e1.dlt", kind="delta",
                  format="deltarl-compact-v2", size=1_830_112, xxh3_128="9c1f...", version=12,
                  base_version=11, base_digest="aa01...", result_digest="5b7e...", changed=161_802)
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str = Field(description="Object key in the bucket (validated; unique per publish).")
    kind: ObjectKind = Field(
        description="'anchor': the full state, loadable from nothing; 'delta': base -> version."
    )
    format: str = Field(
        pattern=_FORMAT,
        description="Encoding of the bytes: a delta format tag of the codec ('deltarl-compact-v2', "
        "'trl-sparse-raw', 'trl-sparse-gap_delta') or an anchor format ('safetensors', "
        "'safetensors+zstd'); readers filter plans by the formats they decode.",
    )
    size: int = Field(ge=0, le=INT64_MAX, description="Exact size of the object in bytes.")
    xxh3_128: str = Field(
        pattern=r"^[0-9a-f]{32}$", description="xxh3-128 of the object's bytes, lowercase hex."
    )
    sha256: str | None = Field(
        default=None,
        pattern=_SHA256,
        description="SHA-256 of the object's bytes, lowercase hex (sharded: parts_sha256(parts), "
        "and every part carries its own). xxh3 catches damage but not a forger, so this is what "
        "binds a signed manifest to the bytes of its objects: a signing trainer writes it, a "
        "reader checks it before decoding whenever present, and a reader that trusts keys "
        "refuses a signed manifest whose objects lack it. None: not recorded (an unsigned "
        "publisher).",
    )
    version: int = Field(
        ge=0, le=MAX_VERSION, description="The version whose state this object produces."
    )
    base_version: int | None = Field(
        default=None,
        ge=0,
        le=MAX_VERSION,
        description="Delta: the version it applies to (< version; < version-1 for a squashed "
        "delta). Anchor: None.",
    )
    base_digest: str | None = Field(
        default=None,
        pattern=_HEX_DIGEST,
        description="Delta: state digest of base_version, checked before apply. Anchor: None.",
    )
    result_digest: str = Field(
        pattern=_HEX_DIGEST,
        description="State digest after loading/applying this object (= the version's).",
    )
    changed: int | None = Field(
        default=None,
        ge=0,
        le=INT64_MAX,
        description="Delta: number of elements whose bits differ from base. Anchor: None.",
    )
    context_version: int | None = Field(
        default=None,
        ge=0,
        le=MAX_VERSION,
        description="Chained delta: it decodes only for a replica whose last applied delta was "
        "context_version -> base_version (it codes values against that delta's moves). None: "
        "a standalone delta, usable from any replica at base_version.",
    )

    parts: tuple[ObjectPart, ...] | None = Field(
        default=None,
        description="Sharded object (FSDP2 trainer): its pieces, fetched in parallel; then key "
        "is the first part's, size the sum of the parts' sizes and xxh3_128 parts_digest(parts); "
        "its digests are over the slice keys of the parts (see docs/weightsync.md). None: one "
        "object at key.",
    )

    _key = field_validator("key")(lambda key: _object_key(key))

    @model_validator(mode="after")
    def _kind_fields(self) -> ObjectRef:
        if self.parts is not None:
            if not self.parts or self.parts[0].key != self.key:
                raise ValueError(f"sharded {self.key}: key must be its first part's key")
            if self.size != sum(p.size for p in self.parts):
                raise ValueError(f"sharded {self.key}: size must be the sum of its parts' sizes")
            if self.xxh3_128 != parts_digest(self.parts):
                raise ValueError(f"sharded {self.key}: xxh3_128 must be parts_digest(parts)")
            if self.sha256 is not None and (
                any(p.sha256 is None for p in self.parts) or self.sha256 != parts_sha256(self.parts)
            ):
                raise ValueError(
                    f"sharded {self.key}: sha256 must be parts_sha256(parts), and every part "
                    "must carry its own"
                )
            if self.context_version is not None:
                raise ValueError(f"sharded {self.key}: chained deltas are not sharded")
        if self.kind == "delta":
            if self.base_version is None or self.base_digest is None:
                raise ValueError(f"delta {self.key}: base_version and base_digest are required")
            if self.base_version >= self.version:
                raise ValueError(
                    f"delta {self.key}: base_version {self.base_version} must be older than "
                    f"version {self.version}"
                )
            if self.context_version is not None and self.context_version >= self.base_version:
                raise ValueError(
                    f"delta {self.key}: context_version {self.context_version} must be older "
                    f"than base_version {self.base_version}"
                )
        elif (
            self.base_version is not None
            or self.base_digest is not None
            or self.context_version is not None
        ):
            raise ValueError(
                f"anchor {self.key}: base_version, base_digest and context_version must be None"
            )
        return self

    @property
    def chained(self) -> bool:
        return self.context_version is not None

    @property
    def hashed(self) -> bool:
        """Whether SHA-256 binds the object's bytes (for a sharded one: every part's)."""
        return self.sha256 is not None

    @property
    def keys(self) -> tuple[str, ...]:
        """Every bucket key this object occupies (its parts' keys, or its own)."""
        return (self.key,) if self.parts is None else tuple(p.key for p in self.parts)

    @property
    def layout(self) -> tuple[str, ...] | None:
        """Sorted slice keys of a sharded object; None for an ordinary one."""
        if self.parts is None:
            return None
        return tuple(sorted(s for p in self.parts for s in p.slices))


class VersionManifest(BaseModel):
    """Everything published for one version; written once, after all of its objects.

    A version has at least one object: any number of anchors (e.g. one per format) and any number
    of incoming deltas (normally from the previous version, optionally squashed ones from older
    versions). All objects produce the same state, so they share ``state_digest``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1] = Field(default=1, description="Layout version of this record.")
    version: int = Field(
        ge=0, le=MAX_VERSION, description="Policy version (strictly increasing, gaps allowed)."
    )
    step: int | None = Field(
        default=None,
        ge=0,
        le=INT64_MAX,
        description="Trainer optimizer step of this state; None if unknown.",
    )
    created_at: AwareDatetime = Field(
        default_factory=lambda: datetime.now(UTC),
        description="When the publisher wrote the manifest (UTC).",
    )
    state_digest: str = Field(
        pattern=_HEX_DIGEST, description="Digest of the full state at this version (codec's)."
    )
    numel: int = Field(ge=0, le=INT64_MAX, description="Number of elements in the whole state.")
    full_bytes: int = Field(
        ge=0,
        le=INT64_MAX,
        description="Raw size of the whole state in bytes (e.g. 2 * numel for bf16).",
    )
    objects: tuple[ObjectRef, ...] = Field(
        min_length=1, description="Anchors and incoming deltas, in publication order."
    )
    signature: dict[str, str] | None = Field(
        default=None,
        exclude=True,  # read from signed files, never written back: unsigned files stay as before
        description="Ed25519 signature of the rest of this document by the trainer's key "
        "(signing.py: key_id, ed25519); None: unsigned.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> VersionManifest:
        keys = [k for o in self.objects for k in o.keys]
        if len(set(keys)) != len(keys):
            raise ValueError(f"version {self.version}: duplicate object keys")
        if len({o.layout for o in self.objects}) > 1:
            raise ValueError(
                f"version {self.version}: its objects disagree on the sharded layout (all are "
                "sharded alike or none is)"
            )
        prefix = objects_prefix(self.version)
        for o in self.objects:
            if any(not k.startswith(prefix) for k in o.keys):
                raise ValueError(f"object {o.key}: a part lies outside {prefix!r}")
            if o.version != self.version:
                raise ValueError(f"object {o.key} is for version {o.version}, not {self.version}")
            if o.result_digest != self.state_digest:
                raise ValueError(f"object {o.key}: result_digest differs from the state_digest")
            if not o.key.startswith(prefix):
                raise ValueError(f"object {o.key} must live under {prefix!r}")
        return self

    @property
    def key(self) -> str:
        return manifest_key(self.version)

    @property
    def anchors(self) -> tuple[ObjectRef, ...]:
        return tuple(o for o in self.objects if o.kind == "anchor")

    @property
    def deltas(self) -> tuple[ObjectRef, ...]:
        return tuple(o for o in self.objects if o.kind == "delta")

    @property
    def layout(self) -> tuple[str, ...] | None:
        """The version's sharded layout (sorted slice keys); None: an unsharded version."""
        return self.objects[0].layout

    @property
    def has_anchor(self) -> bool:
        return any(o.kind == "anchor" for o in self.objects)

    @property
    def total_bytes(self) -> int:
        return sum(o.size for o in self.objects)


class LatestPointer(BaseModel):
    """Content of ``latest.json``: the newest fully published version. Moves forward only."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1] = Field(default=1, description="Layout version of this record.")
    version: int = Field(ge=0, le=MAX_VERSION, description="Newest published version.")
    manifest_key: str = Field(description="Key of that version's manifest.")
    state_digest: str = Field(pattern=_HEX_DIGEST, description="Its state digest.")
    updated_at: AwareDatetime = Field(
        default_factory=lambda: datetime.now(UTC), description="When the pointer was written."
    )
    signature: dict[str, str] | None = Field(
        default=None,
        exclude=True,  # read from signed files, never written back: unsigned files stay as before
        description="Ed25519 signature of the rest of this document by the trainer's key "
        "(signing.py: key_id, ed25519); None: unsigned.",
    )

    @model_validator(mode="after")
    def _key_matches(self) -> LatestPointer:
        if parse_manifest_key(self.manifest_key) != self.version:
            raise ValueError(f"manifest_key {self.manifest_key!r} is not version {self.version}'s")
        return self


def manifest_json(manifest: VersionManifest) -> bytes:
    """The manifest as a writer publishes it (JSON, indent 1). ``sha256`` members appear only
    where recorded, so a manifest without them is byte for byte what writers wrote before that
    field existed (and what readers without it accept)."""
    exclude: dict[int, Any] = {}
    for i, o in enumerate(manifest.objects):
        skip: dict[str, Any] = {"sha256": True} if o.sha256 is None else {}
        bare = {j: {"sha256": True} for j, p in enumerate(o.parts or ()) if p.sha256 is None}
        if bare:
            skip["parts"] = bare
        if skip:
            exclude[i] = skip
    return manifest.model_dump_json(
        indent=1, exclude={"objects": exclude} if exclude else None
    ).encode()


def index_manifests(manifests: Iterable[VersionManifest]) -> dict[int, VersionManifest]:
    """``{version: manifest}``; ValueError if a version appears twice."""
    out: dict[int, VersionManifest] = {}
    for m in manifests:
        if m.version in out:
            raise ValueError(f"two manifests for version {m.version}")
        out[m.version] = m
    return out
