"""The bucket interface: a flat namespace of immutable-by-convention objects addressed by key.

Every backend (:mod:`.local`, :mod:`.s3`, :mod:`.hf`) implements :class:`Bucket`; callers never
touch a backend's client. Keys are validated by :func:`validate_key` before any I/O, so a key can
never escape the bucket's root or prefix (no ``..``, no absolute path, no backslash, a small
charset). This module imports neither torch nor any cloud SDK.

Consistency model assumed by the publication protocol (:mod:`deltarl.weightsync.writer`):
a ``put`` of one object is atomic (a reader sees the old object, no object, or the whole new one,
never a prefix of it); nothing is assumed about the order in which other readers observe two
different puts, which is why objects are written under fresh unique names before the small records
that point to them.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

MAX_KEY_LENGTH = 1024
_SEGMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+=-]*")
_PREFIX_CHARS = re.compile(r"[A-Za-z0-9._+=/-]*")


class BucketError(Exception):
    """Base class of bucket errors that are not plain bad input."""


class ObjectNotFoundError(BucketError, FileNotFoundError):
    """The key does not exist in the bucket."""


class ObjectExistsError(BucketError, FileExistsError):
    """A put with ``overwrite=False`` found the key already present; nothing was written."""


def validate_key(key: str) -> str:
    """Return ``key`` if it is a safe object key, else raise ``ValueError`` saying what is wrong.

    A key is one or more ``/``-separated segments; each segment starts with a letter, digit or
    ``_`` and continues with letters, digits and ``. _ + = -``. So ``..``, ``.``, hidden names
    (also used for the local backend's temp files), empty segments (``a//b``), a leading or
    trailing ``/``, backslashes, spaces and non-ASCII characters are all refused. At most
    :data:`MAX_KEY_LENGTH` characters.
    """
    if not isinstance(key, str):
        raise ValueError(f"object key must be a str, got {type(key).__name__}")
    if not key:
        raise ValueError("object key must not be empty")
    if len(key) > MAX_KEY_LENGTH:
        raise ValueError(f"object key is {len(key)} characters long, the limit is {MAX_KEY_LENGTH}")
    if "\\" in key:
        raise ValueError(f"object key {key!r} contains a backslash: use '/' as the separator")
    if key.startswith("/"):
        raise ValueError(f"object key {key!r} is absolute: keys are relative to the bucket root")
    for segment in key.split("/"):
        if segment in ("", ".", ".."):
            raise ValueError(
                f"object key {key!r} has an empty, '.' or '..' segment: path traversal is refused"
            )
        if not _SEGMENT.fullmatch(segment):
            raise ValueError(
                f"object key {key!r}: segment {segment!r} must start with a letter, digit or '_' "
                "and contain only letters, digits and '._+=-'"
            )
    return key


def validate_prefix(prefix: str) -> str:
    """Return ``prefix`` if it is a safe listing prefix (``""`` lists everything).

    A prefix is matched as a plain string against keys (like S3), so ``"manifests/v0000"`` is
    valid; it may end with ``/``. It uses the key charset and may not contain ``.``/``..``
    segments, empty segments, a leading ``/`` or backslashes.
    """
    if not isinstance(prefix, str):
        raise ValueError(f"prefix must be a str, got {type(prefix).__name__}")
    if prefix == "":
        return prefix
    if "\\" in prefix or prefix.startswith("/") or not _PREFIX_CHARS.fullmatch(prefix):
        raise ValueError(
            f"prefix {prefix!r} must be relative and use only letters, digits and '._+=-/'"
        )
    segments = prefix.split("/")
    if segments[-1] == "":  # trailing slash: a directory-like prefix
        segments = segments[:-1]
    if any(s in ("", ".", "..") for s in segments):
        raise ValueError(f"prefix {prefix!r} has an empty, '.' or '..' segment")
    return prefix


def join_key(root: str, key: str) -> str:
    """``root/key`` for a backend whose objects live under a (validated) root prefix."""
    return f"{root}/{key}" if root else key


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What a bucket knows about one object.

    Example: ``ObjectInfo(key="manifests/v000000000007.json", size=912, modified=datetime(...))``.
    """

    key: str  # relative to the bucket's root/prefix, '/'-separated
    size: int  # bytes
    modified: datetime | None  # time of the last write (UTC, timezone-aware); None if unknown


class Bucket(ABC):
    """A flat key -> bytes store. Implementations validate every key with :func:`validate_key`.

    Guarantees every backend gives: a successful ``put_*`` stored the whole object (readers never
    see a partial one); ``put_*(..., overwrite=False)`` raises :class:`ObjectExistsError` instead
    of replacing an existing object (atomically on the local and S3 backends, check-then-write on
    the HF backend); ``get_bytes``/``download_file`` raise :class:`ObjectNotFoundError` for a
    missing key; ``download_file`` never leaves a partial file at the destination.
    """

    #: A printable description of the location (never contains credentials).
    uri: str

    @abstractmethod
    def put_bytes(self, key: str, data: bytes, *, overwrite: bool = True) -> ObjectInfo:
        """Store ``data`` under ``key``."""

    @abstractmethod
    def put_file(self, key: str, path: str | Path, *, overwrite: bool = True) -> ObjectInfo:
        """Upload the local file at ``path`` to ``key``."""

    @abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """The whole object (raises :class:`ObjectNotFoundError`)."""

    @abstractmethod
    def download_file(self, key: str, path: str | Path) -> Path:
        """Download ``key`` to ``path`` (via a temp file next to it, then an atomic rename)."""

    @abstractmethod
    def head(self, key: str) -> ObjectInfo | None:
        """Size and modification time of ``key``, or None if it does not exist."""

    @abstractmethod
    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (string match), sorted by key."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``; deleting a missing key is not an error."""

    def delete_many(self, keys: Iterable[str]) -> None:
        """Remove several keys (backends may batch). Missing keys are not an error."""
        for key in keys:
            self.delete(key)

    def exists(self, key: str) -> bool:
        return self.head(key) is not None

    def size(self, key: str) -> int:
        """Size in bytes of ``key`` (raises :class:`ObjectNotFoundError`)."""
        info = self.head(key)
        if info is None:
            raise ObjectNotFoundError(f"{key!r} does not exist in {self.uri}")
        return info.size

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"
