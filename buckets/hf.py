"""Hugging Face Buckets (``hf://buckets/<namespace>/<name>/<prefix>``) through huggingface_hub.

Uses the public ``HfApi`` bucket methods of huggingface_hub >= 1.5 (read from 2.4.0's source):
``batch_bucket_files(bucket_id, add=[(bytes | path, dest)], delete=[...])`` to write and delete,
``download_bucket_files(bucket_id, files=[(remote, local)], raise_on_missing_files=True)`` to read,
``list_bucket_tree(bucket_id, prefix, recursive=True)`` to list, ``get_bucket_paths_info`` for
``head``, and ``bucket_info``/``create_bucket`` in :meth:`HfBucket.ensure_exists`.

HF Buckets are non-versioned, mutable and document no read-after-write guarantee; the bucket
API has no conditional write, so ``overwrite=False`` is a check-then-write here (not atomic: two
concurrent writers of one key can both succeed). The publication protocol only needs it for
manifests, which a single trainer writes.

**Not run against the real Hub**: the Hub is unreachable where this was written. The code path
is unit-tested with a recording fake of ``HfApi`` whose calls are bound against the real
methods' signatures. ``dry_run=True`` swaps in :class:`DryRunHfApi`, an in-memory stand-in that
logs every call it would have sent and needs no network and no token.
"""

from __future__ import annotations

import logging
import os
import tempfile
import uuid
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from deltarl.buckets.base import (
    Bucket,
    ObjectExistsError,
    ObjectInfo,
    ObjectNotFoundError,
    join_key,
    validate_key,
    validate_prefix,
)

logger = logging.getLogger(__name__)

HF_URI_PREFIX = "hf://buckets/"


def parse_hf_uri(uri: str) -> tuple[str, str]:
    """``hf://buckets/ns/name/a/b`` -> ``("ns/name", "a/b")`` (ValueError if malformed)."""
    if not uri.startswith(HF_URI_PREFIX):
        raise ValueError(f"{uri!r} is not an HF bucket URI: expected hf://buckets/<ns>/<name>/...")
    parts = uri[len(HF_URI_PREFIX) :].strip("/").split("/", 2)
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise ValueError(f"{uri!r} needs a namespace and a bucket name: hf://buckets/<ns>/<name>")
    for part in parts[:2]:
        validate_key(part)
    prefix = validate_key(parts[2]) if len(parts) == 3 and parts[2] else ""
    return f"{parts[0]}/{parts[1]}", prefix


def _bucket_file_class() -> Any:
    from huggingface_hub import BucketFile

    return BucketFile


def _entry_not_found() -> type[Exception]:
    from huggingface_hub.errors import EntryNotFoundError

    return EntryNotFoundError


class HfBucket(Bucket):
    """Objects under ``prefix`` in the HF bucket ``bucket_id`` through an ``HfApi``-like ``api``."""

    def __init__(self, bucket_id: str, prefix: str, api: Any, *, dry_run: bool = False) -> None:
        self.bucket_id = bucket_id
        self.prefix = validate_key(prefix) if prefix else ""
        self.api = api
        self.dry_run = dry_run
        self.uri = f"{HF_URI_PREFIX}{bucket_id}" + (f"/{self.prefix}" if self.prefix else "")
        if dry_run:
            self.uri += " (dry run)"

    def _full(self, key: str) -> str:
        return join_key(self.prefix, validate_key(key))

    def ensure_exists(self, *, create: bool = False, private: bool = True) -> None:
        """Check the bucket exists (``bucket_info``); create it if asked (``create_bucket``)."""
        from huggingface_hub.errors import BucketNotFoundError

        try:
            self.api.bucket_info(self.bucket_id)
        except BucketNotFoundError:
            if not create:
                raise ValueError(
                    f"HF bucket {self.bucket_id} does not exist (or the token cannot see it); "
                    "create it or set DELTARL_HF_CREATE_BUCKET=1"
                ) from None
            logger.info("creating HF bucket %s (private=%s)", self.bucket_id, private)
            self.api.create_bucket(self.bucket_id, private=private, exist_ok=True)

    def _check_absent(self, key: str, overwrite: bool) -> None:
        if not overwrite and self.head(key) is not None:
            raise ObjectExistsError(f"{key!r} already exists in {self.uri}")

    def put_bytes(self, key: str, data: bytes, *, overwrite: bool = True) -> ObjectInfo:
        full = self._full(key)
        self._check_absent(key, overwrite)
        self.api.batch_bucket_files(self.bucket_id, add=[(bytes(data), full)])
        return ObjectInfo(key, len(data), None)

    def put_file(self, key: str, path: str | Path, *, overwrite: bool = True) -> ObjectInfo:
        full = self._full(key)
        self._check_absent(key, overwrite)
        size = os.path.getsize(path)
        self.api.batch_bucket_files(self.bucket_id, add=[(str(path), full)])
        return ObjectInfo(key, size, None)

    def download_file(self, key: str, path: str | Path) -> Path:
        full = self._full(key)
        dest = Path(path).absolute()
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.tmp-{uuid.uuid4().hex}")
        try:
            self.api.download_bucket_files(
                self.bucket_id, files=[(full, str(tmp))], raise_on_missing_files=True
            )
            if not tmp.is_file():  # a fake or an old client that skips missing files
                raise ObjectNotFoundError(f"{key!r} does not exist in {self.uri}")
            os.replace(tmp, dest)
        except _entry_not_found():
            raise ObjectNotFoundError(f"{key!r} does not exist in {self.uri}") from None
        finally:
            tmp.unlink(missing_ok=True)
        return dest

    def get_bytes(self, key: str) -> bytes:
        with tempfile.TemporaryDirectory(prefix="deltarl-hf-") as tmpdir:
            path = self.download_file(key, Path(tmpdir) / "object")
            return path.read_bytes()

    @staticmethod
    def _when(item: Any) -> datetime | None:
        # The server's upload time only: ``mtime`` is the uploader's file mtime, which can be far
        # older than the upload and would make a fresh object look like an old orphan to the GC.
        when = getattr(item, "uploaded_at", None)
        return when if isinstance(when, datetime) else None

    def head(self, key: str) -> ObjectInfo | None:
        full = self._full(key)
        for info in self.api.get_bucket_paths_info(self.bucket_id, [full]):
            if info.path == full:
                return ObjectInfo(key, int(info.size), self._when(info))
        return None

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        validate_prefix(prefix)
        full_prefix = join_key(self.prefix, prefix)
        # The tree endpoint takes a folder: ask for the deepest folder, filter the rest here.
        folder = full_prefix.rsplit("/", 1)[0] if "/" in full_prefix else ""
        file_cls = _bucket_file_class()
        out: list[ObjectInfo] = []
        for item in self.api.list_bucket_tree(
            self.bucket_id, prefix=folder or None, recursive=True
        ):
            if not isinstance(item, file_cls) or not item.path.startswith(full_prefix):
                continue
            rel = item.path[len(self.prefix) + 1 :] if self.prefix else item.path
            try:
                validate_key(rel)
            except ValueError:
                logger.warning("skipping object with an unsafe key %r in %s", rel, self.uri)
                continue
            out.append(ObjectInfo(rel, int(item.size), self._when(item)))
        out.sort(key=lambda o: o.key)
        return out

    def delete(self, key: str) -> None:
        self.delete_many([key])

    def delete_many(self, keys: Iterable[str]) -> None:
        full = [self._full(k) for k in keys]
        if full:
            self.api.batch_bucket_files(self.bucket_id, delete=full)


class DryRunHfApi:
    """In-memory stand-in for the five ``HfApi`` bucket methods :class:`HfBucket` calls.

    Nothing leaves the process: each call is logged (paths and sizes, never data or tokens) and
    recorded in :attr:`calls`, and the "bucket" is a dict, so a whole publish/fetch cycle can be
    rehearsed against an ``hf://`` URI offline.
    """

    def __init__(self) -> None:
        self.files: dict[str, dict[str, bytes]] = {}
        self.mtimes: dict[tuple[str, str], datetime] = {}
        self.calls: list[tuple[str, str]] = []

    def _record(self, method: str, detail: str) -> None:
        self.calls.append((method, detail))
        logger.info("[dry run] HfApi.%s(%s)", method, detail)

    def bucket_info(self, bucket_id: str, **_: Any) -> dict[str, Any]:
        self._record("bucket_info", bucket_id)
        return {"id": bucket_id, "total_files": len(self.files.get(bucket_id, {}))}

    def create_bucket(self, bucket_id: str, **_: Any) -> None:
        self._record("create_bucket", bucket_id)
        self.files.setdefault(bucket_id, {})

    def batch_bucket_files(
        self,
        bucket_id: str,
        *,
        add: list[tuple[str | Path | bytes, str]] | None = None,
        delete: list[str] | None = None,
        **_: Any,
    ) -> None:
        store = self.files.setdefault(bucket_id, {})
        for source, dest in add or []:
            data = source if isinstance(source, bytes) else Path(source).read_bytes()
            self._record("batch_bucket_files", f"{bucket_id}: add {dest} ({len(data)} B)")
            store[dest] = data
            self.mtimes[(bucket_id, dest)] = datetime.now(UTC)
        for path in delete or []:
            self._record("batch_bucket_files", f"{bucket_id}: delete {path}")
            store.pop(path, None)

    def download_bucket_files(
        self,
        bucket_id: str,
        files: list[tuple[str, str | Path]],
        *,
        raise_on_missing_files: bool = False,
        **_: Any,
    ) -> None:
        store = self.files.get(bucket_id, {})
        for remote, local in files:
            self._record("download_bucket_files", f"{bucket_id}: {remote}")
            if remote not in store:
                if raise_on_missing_files:
                    raise _entry_not_found()(f"{remote} not found in bucket {bucket_id}")
                continue
            Path(local).write_bytes(store[remote])

    def _file(self, bucket_id: str, path: str) -> Any:
        when = self.mtimes[(bucket_id, path)].strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        size = len(self.files[bucket_id][path])
        return _bucket_file_class()(
            type="file", path=path, size=size, xetHash="0" * 64, mtime=when, uploadedAt=when
        )

    def get_bucket_paths_info(self, bucket_id: str, paths: Iterable[str], **_: Any) -> list[Any]:
        store = self.files.get(bucket_id, {})
        wanted = list(paths)
        self._record("get_bucket_paths_info", f"{bucket_id}: {len(wanted)} path(s)")
        return [self._file(bucket_id, p) for p in wanted if p in store]

    def list_bucket_tree(
        self, bucket_id: str, prefix: str | None = None, *, recursive: bool | None = None, **_: Any
    ) -> list[Any]:
        self._record("list_bucket_tree", f"{bucket_id}: prefix={prefix!r} recursive={recursive}")
        store = self.files.get(bucket_id, {})
        root = f"{prefix}/" if prefix else ""
        return [self._file(bucket_id, p) for p in sorted(store) if p.startswith(root)]
