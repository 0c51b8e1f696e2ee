"""The embedded default backend: a directory on a local or shared filesystem.

Writes go to a hidden temp file in the destination directory (``.<name>.tmp-<uuid>``, never a
valid key, so never listed), are fsynced, then renamed into place: ``os.replace`` for an
overwrite, ``os.link`` for ``overwrite=False`` (atomic create-if-absent, refused if the key
exists; on filesystems without hard links it falls back to check-then-rename). A reader
therefore sees either no object or a whole one. Temp files of a crashed writer stay hidden and
are harmless.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import uuid
from datetime import UTC, datetime
from pathlib import Path

from deltarl.buckets.base import (
    Bucket,
    ObjectExistsError,
    ObjectInfo,
    ObjectNotFoundError,
    validate_key,
    validate_prefix,
)

logger = logging.getLogger(__name__)


def _tmp_path(dest: Path) -> Path:
    return dest.with_name(f".{dest.name}.tmp-{uuid.uuid4().hex}")


class LocalBucket(Bucket):
    """Objects are files under ``root``; key ``a/b.json`` is the file ``root/a/b.json``."""

    def __init__(self, root: str | Path, *, create: bool = True) -> None:
        self.root = Path(root).expanduser().resolve()
        if create:
            self.root.mkdir(parents=True, exist_ok=True)
        elif not self.root.is_dir():
            raise ValueError(f"bucket directory {self.root} does not exist")
        self.uri = self.root.as_uri()

    def _path(self, key: str) -> Path:
        path = self.root / validate_key(key)
        # Defence in depth against symlinks inside the bucket pointing outside it.
        if not path.resolve().is_relative_to(self.root):
            raise ValueError(f"object key {key!r} resolves outside the bucket {self.root}")
        return path

    def _info(self, key: str, path: Path) -> ObjectInfo:
        st = path.stat()
        return ObjectInfo(key, st.st_size, datetime.fromtimestamp(st.st_mtime, UTC))

    def _commit(self, tmp: Path, dest: Path, key: str, overwrite: bool) -> None:
        try:
            if overwrite:
                os.replace(tmp, dest)
            else:
                try:
                    os.link(tmp, dest)
                except FileExistsError:
                    raise ObjectExistsError(f"{key!r} already exists in {self.uri}") from None
                except OSError:  # no hard links (some FUSE/SMB mounts): check, then rename
                    if dest.exists():
                        raise ObjectExistsError(f"{key!r} already exists in {self.uri}") from None
                    os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)

    def put_bytes(self, key: str, data: bytes, *, overwrite: bool = True) -> ObjectInfo:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = _tmp_path(dest)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self._commit(tmp, dest, key, overwrite)
        return self._info(key, dest)

    def put_file(self, key: str, path: str | Path, *, overwrite: bool = True) -> ObjectInfo:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = _tmp_path(dest)
        with open(path, "rb") as src, open(tmp, "wb") as f:
            shutil.copyfileobj(src, f, 1 << 22)
            f.flush()
            os.fsync(f.fileno())
        self._commit(tmp, dest, key, overwrite)
        return self._info(key, dest)

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            raise ObjectNotFoundError(f"{key!r} does not exist in {self.uri}") from None

    def download_file(self, key: str, path: str | Path) -> Path:
        src = self._path(key)
        dest = Path(path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = _tmp_path(dest)
        try:
            shutil.copyfile(src, tmp)
            os.replace(tmp, dest)
        except (FileNotFoundError, IsADirectoryError):
            raise ObjectNotFoundError(f"{key!r} does not exist in {self.uri}") from None
        finally:
            tmp.unlink(missing_ok=True)
        return dest

    def head(self, key: str) -> ObjectInfo | None:
        path = self._path(key)
        if not path.is_file():
            return None
        try:
            return self._info(key, path)
        except FileNotFoundError:  # deleted between the check and the stat
            return None

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        validate_prefix(prefix)
        # Walk only the deepest directory the prefix names, then match the rest as a string.
        start = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
        if not start.is_dir():
            return []
        out: list[ObjectInfo] = []
        for dirpath, dirnames, filenames in os.walk(start):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            base = Path(dirpath)
            for name in filenames:
                if name.startswith("."):
                    continue  # temp files of in-flight or crashed writes
                key = (base / name).relative_to(self.root).as_posix()
                if not key.startswith(prefix):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    out.append(self._info(key, base / name))
        out.sort(key=lambda o: o.key)
        return out

    def delete(self, key: str) -> None:
        path = self._path(key)
        path.unlink(missing_ok=True)
        # Prune directories left empty (objects/v.../), never the root itself.
        parent = path.parent
        while parent != self.root and parent.is_relative_to(self.root):
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent
