"""The files of a checkpoint: safetensors and JSON, hashed while written or read, fsynced.

:func:`write_safetensors` streams tensors (one at a time, names sorted) through the weight-sync
safetensors helpers and returns the file's :class:`FileRecord` (size, xxh3-128), computed on the
bytes as they are written; :func:`read_safetensors` checks the size first, parses the header, reads
each tensor straight into its own buffer and checks the xxh3-128 of everything it read. Plain
``safetensors`` (``load_file``) reads these files too.
"""

from __future__ import annotations

import io
import itertools
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any, cast

import torch
import xxhash
from pydantic import BaseModel, ConfigDict, Field

from deltarl.weightsync.anchor import build_header, read_exact, read_header, tensor_bytes
from deltarl.weightsync.errors import CorruptDeltaError

__all__ = [
    "CheckpointError",
    "FileRecord",
    "RowSelector",
    "fsync_dir",
    "read_safetensors",
    "write_json",
    "write_safetensors",
]

_CHUNK = 1 << 20

RowSelector = Callable[[str, tuple[int, ...]], "tuple[int, int] | bool"]


class CheckpointError(RuntimeError):
    """A checkpoint is missing, damaged, or does not fit the model/optimizer it is loaded into."""


class FileRecord(BaseModel):
    """Size and xxh3-128 (hex) of one file of a checkpoint."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bytes: int = Field(ge=0, description="File size in bytes.")
    xxh3: str = Field(description="xxh3-128 of the whole file, lowercase hex.")


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_safetensors(path: Path, tensors: Mapping[str, torch.Tensor]) -> FileRecord:
    """Write ``tensors`` (names sorted) as one safetensors file, hashing it on the way; fsync."""
    names = sorted(tensors)
    header = build_header([(n, tensors[n].dtype, tuple(tensors[n].shape)) for n in names], {})
    h = xxhash.xxh3_128()
    size = 0
    with open(path, "wb") as fh:
        chunks = itertools.chain([memoryview(header)], (tensor_bytes(tensors[n]) for n in names))
        for chunk in chunks:  # one tensor at a time (GPU tensors are copied one by one)
            fh.write(chunk)
            h.update(chunk)
            size += len(chunk)
        fh.flush()
        os.fsync(fh.fileno())
    return FileRecord(bytes=size, xxh3=h.hexdigest())


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """Write ``data`` as indented JSON with sorted keys; fsync."""
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1, sort_keys=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())


class _HashingReader(io.RawIOBase):
    """Reads ``stream`` and feeds every byte read to an xxh3-128 hash."""

    def __init__(self, stream: IO[bytes]) -> None:
        self._stream = stream
        self.hash = xxhash.xxh3_128()

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = self._stream.readinto(view)  # type: ignore[attr-defined]
        if n:
            self.hash.update(view[:n])
        return n or 0


def read_safetensors(
    path: Path, record: FileRecord, rows: RowSelector | None = None
) -> dict[str, torch.Tensor]:
    """Read one tensor file of a checkpoint, checking its size, header and xxh3-128.

    ``rows`` (resharding): called with each tensor's name and shape, it returns the rows
    ``(lo, hi)`` of that tensor to keep, True to keep all of it or False to keep none; every
    byte of the file is still read and hashed, and only one tensor is held whole at a time."""
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: the checkpoint is damaged")
    size = path.stat().st_size
    if size != record.bytes:
        raise CheckpointError(
            f"{path} has {size} bytes, {record.bytes} were written: the file is "
            f"{'truncated' if size < record.bytes else 'longer than written'}"
        )
    out: dict[str, torch.Tensor] = {}
    with open(path, "rb") as fh:
        reader = _HashingReader(fh)
        stream = cast(IO[bytes], reader)
        try:
            _, entries = read_header(stream)
            for entry in entries:
                keep = True if rows is None else rows(entry.name, tuple(entry.shape))
                t = torch.empty(entry.shape, dtype=entry.dtype)
                if entry.end > entry.start:
                    buf = t.reshape(-1).view(torch.uint8).numpy().data
                    read_exact(stream, buf, f"tensor {entry.name!r}")
                if keep is True:
                    out[entry.name] = t
                elif keep is not False:
                    lo, hi = keep
                    if not (t.dim() > 0 and 0 <= lo <= hi <= t.shape[0]):
                        raise CheckpointError(
                            f"{path}: tensor {entry.name!r} of shape {list(t.shape)} has no "
                            f"rows {lo}:{hi}"
                        )
                    out[entry.name] = t if (lo, hi) == (0, t.shape[0]) else t[lo:hi].clone()
        except CorruptDeltaError as err:
            raise CheckpointError(f"{path} is not a valid safetensors file: {err}") from None
        while reader.read(_CHUNK):  # trailing bytes (the size check makes this rare)
            pass
    if reader.hash.hexdigest() != record.xxh3:
        raise CheckpointError(
            f"{path}: xxh3-128 {reader.hash.hexdigest()} differs from the {record.xxh3} recorded "
            "when it was written: the file is damaged"
        )
    return out
