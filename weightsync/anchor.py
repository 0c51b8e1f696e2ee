"""Anchors: full checkpoints as plain safetensors, optionally zstd-compressed, with digests.

An anchor lets a replica (re)start from nothing: it holds every tensor of one version. It is a
standard safetensors file, so plain ``safetensors`` (``load_file``, ``safe_open``) reads an
uncompressed anchor; the compressed variant is that same file as one zstd frame
(``.safetensors.zst``), written and read as a stream so that neither side holds two copies of the
model. The byte layout is documented in ``docs/formats.md``.

The safetensors string metadata (``__metadata__``) carries:

=============================  ====================================================================
key                            value
=============================  ====================================================================
``deltarl.kind``               ``"anchor"``
``deltarl.format_version``     ``"1"``
``deltarl.version``            policy version, decimal
``deltarl.state_digest``       :func:`~.digest.combine_digests` of the tensor digests
``deltarl.tensor_digests``     JSON object ``{name: tensor_digest}`` (every tensor)
``deltarl.checksum``           xxh3-128 of the other ``deltarl.*`` keys (canonical JSON), so that
                               an edited version or digest list is caught
``format``, ``version``,       the keys TRL's delta weight sync writes in its anchors
``sparse``, ``model_version``,  (``sparse="False"``), so that a TRL receiver can load ours
``num_changed_params``, ...
=============================  ====================================================================

Reading verifies the checksum, that the tensor names match the digest list, every tensor digest
and the state digest; any failure, a truncated stream or a malformed header is a
:class:`~.errors.CorruptDeltaError` raised before the state is returned.
"""

from __future__ import annotations

import io
import json
import logging
import math
import struct
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO, cast

import torch
import xxhash
import zstandard

from deltarl.weightsync.codec.bits import dtype_name
from deltarl.weightsync.digest import combine_digests, state_digests
from deltarl.weightsync.errors import CorruptDeltaError

logger = logging.getLogger(__name__)

ANCHOR_KIND = "anchor"
FORMAT_VERSION = "1"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
MAX_HEADER_BYTES = 100_000_000  # the limit safetensors itself enforces

# safetensors dtype tag <-> torch dtype (the subset torch and safetensors share)
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
}
ST_TAGS: dict[torch.dtype, str] = {v: k for k, v in ST_DTYPES.items()}


@dataclass(frozen=True, slots=True)
class AnchorInfo:
    """What an anchor holds, besides its tensors.

    Example::

        AnchorInfo(version=20, state_digest="5f1c...", tensor_digests={"lm_head.weight": "9a0b..."},
                   nbytes=269_060_352)
    """

    version: int
    state_digest: str
    tensor_digests: dict[str, str]
    nbytes: int  # bytes written (compressed size when compressed)


# ---------------------------------------------------------------------------------------------
# safetensors header helpers (shared with trl_format)


def _check_little_endian() -> None:
    if sys.byteorder != "little":
        raise RuntimeError("safetensors is little-endian; big-endian hosts are not supported")


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw little-endian bytes of a CPU copy of ``t`` in C order (no copy if already so)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data


def build_header(
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: Mapping[str, str]
) -> bytes:
    """The 8-byte length + JSON header of a safetensors file whose tensors follow in ``specs`` order.

    The JSON is padded with spaces to a multiple of 8 bytes (as ``safetensors`` does), so that
    the data section starts 8-byte aligned.
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, dtype, shape in specs:
        if dtype not in ST_TAGS:
            raise ValueError(f"{name}: dtype {dtype_name(dtype)} cannot be stored in safetensors")
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {
            "dtype": ST_TAGS[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor entry of a parsed safetensors header."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset within the data section
    end: int


def parse_header(raw: bytes, data_size: int | None) -> tuple[dict[str, str], list[TensorEntry]]:
    """Validate a safetensors JSON header; return its string metadata and its entries by offset.

    Checks what ``safetensors`` checks: known dtypes, sizes that match shapes, offsets that tile the
    data section from 0 without gaps or overlaps, and (when ``data_size`` is known) end exactly
    at its end.
    """
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptDeltaError(f"safetensors header is not valid JSON ({e})") from None
    except RecursionError:
        raise CorruptDeltaError("safetensors header is nested too deeply") from None
    if not isinstance(header, dict):
        raise CorruptDeltaError("safetensors header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptDeltaError("safetensors __metadata__ must map strings to strings")
    entries: list[TensorEntry] = []
    for name, info in header.items():
        try:
            dtype = ST_DTYPES[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            start, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CorruptDeltaError(f"safetensors header entry {name!r} is malformed") from None
        if any(s < 0 for s in shape):
            raise CorruptDeltaError(f"{name}: negative dimension in shape {list(shape)}")
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if end - start != size:
            raise CorruptDeltaError(
                f"{name}: {end - start} data bytes for {info['dtype']}{list(shape)}"
            )
        entries.append(TensorEntry(name, dtype, shape, start, end))
    entries.sort(key=lambda x: (x.start, x.end))
    pos = 0
    for x in entries:
        if x.start != pos:
            raise CorruptDeltaError(f"{x.name}: data offsets leave a gap or overlap at byte {pos}")
        pos = x.end
    if data_size is not None and pos != data_size:
        raise CorruptDeltaError(
            f"safetensors data section is {data_size} bytes but the header describes {pos} "
            f"({'truncated' if data_size < pos else 'trailing bytes'})"
        )
    return meta, entries


def read_exact(stream: IO[bytes], buf: memoryview, what: str) -> None:
    """Fill ``buf`` from ``stream`` or raise :class:`CorruptDeltaError` (truncated input)."""
    got = 0
    while got < len(buf):
        try:
            n = stream.readinto(buf[got:])  # type: ignore[attr-defined]
        except zstandard.ZstdError as e:
            raise CorruptDeltaError(f"zstd stream is corrupt while reading {what} ({e})") from None
        if not n:
            raise CorruptDeltaError(
                f"input is truncated: {what} needs {len(buf)} bytes, only {got} were left"
            )
        got += n


def read_header(stream: IO[bytes]) -> tuple[dict[str, str], list[TensorEntry]]:
    """Read and validate the length prefix and JSON header from the start of ``stream``."""
    prefix = bytearray(8)
    read_exact(stream, memoryview(prefix), "the safetensors length prefix")
    (n,) = struct.unpack("<Q", prefix)
    if n > MAX_HEADER_BYTES:
        raise CorruptDeltaError(
            f"safetensors header length {n} is implausible (not a safetensors file?)"
        )
    raw = bytearray(n)
    read_exact(stream, memoryview(raw), "the safetensors header")
    return parse_header(bytes(raw), None)


# ---------------------------------------------------------------------------------------------
# metadata


def _checksum(meta: Mapping[str, str]) -> str:
    own = {k: v for k, v in meta.items() if k.startswith("deltarl.") and k != "deltarl.checksum"}
    return xxhash.xxh3_128_hexdigest(
        json.dumps(own, sort_keys=True, separators=(",", ":")).encode()
    )


def anchor_metadata(
    state: Mapping[str, torch.Tensor], version: int, digests: Mapping[str, str]
) -> dict[str, str]:
    """String metadata of an anchor: deltarl keys (with checksum) plus TRL-compatible keys."""
    total = sum(t.numel() for t in state.values())
    meta = {
        # TRL's PatchMetadata keys (anchor = sparse "False"); TRL ignores the deltarl.* ones
        "format": "sparse_weight_patch",
        "version": "1",
        "sparse": "False",
        "model_version": str(version),
        "num_changed_params": str(len(state)),
        "total_changed_elements": str(total),
        "total_elements": str(total),
        "sparsity": "0.0",
        "deltarl.kind": ANCHOR_KIND,
        "deltarl.format_version": FORMAT_VERSION,
        "deltarl.version": str(version),
        "deltarl.state_digest": combine_digests(digests),
        "deltarl.tensor_digests": json.dumps(dict(sorted(digests.items())), separators=(",", ":")),
    }
    meta["deltarl.checksum"] = _checksum(meta)
    return meta


def _parse_anchor_meta(meta: Mapping[str, str], names: set[str]) -> tuple[int, str, dict[str, str]]:
    if meta.get("deltarl.kind") != ANCHOR_KIND:
        raise CorruptDeltaError(
            "not a deltarl anchor (no deltarl.kind=anchor in the safetensors metadata); a plain "
            "safetensors checkpoint can be read with require_digests=False"
        )
    if meta.get("deltarl.format_version") != FORMAT_VERSION:
        raise CorruptDeltaError(
            f"unsupported anchor format version {meta.get('deltarl.format_version')!r}"
        )
    if meta.get("deltarl.checksum") != _checksum(meta):
        raise CorruptDeltaError(
            "anchor metadata checksum mismatch: the header was modified or corrupted"
        )
    try:
        version = int(meta["deltarl.version"])
        digests = json.loads(meta["deltarl.tensor_digests"])
        state_digest = meta["deltarl.state_digest"]
    except (KeyError, ValueError, RecursionError) as e:
        raise CorruptDeltaError(f"anchor metadata is incomplete or malformed ({e})") from None
    if not isinstance(digests, dict) or set(digests) != names:
        raise CorruptDeltaError("anchor tensors do not match its digest list")
    if combine_digests(digests) != state_digest:
        raise CorruptDeltaError("anchor state digest does not match its tensor digests")
    return version, state_digest, digests


# ---------------------------------------------------------------------------------------------
# write


@contextmanager
def _open_for_write(dest: str | Path | BinaryIO) -> Iterator[BinaryIO]:
    if isinstance(dest, str | Path):
        with open(dest, "wb") as fh:
            yield fh
    else:
        yield dest


def write_anchor(
    dest: str | Path | BinaryIO,
    state: Mapping[str, torch.Tensor],
    version: int,
    compress: bool = False,
    *,
    digests: Mapping[str, str] | None = None,
    level: int = 3,
    threads: int = 0,
) -> AnchorInfo:
    """Stream an anchor of ``state`` to a path or binary file object, one tensor at a time.

    Memory stays at about one tensor beyond the model (GPU tensors are copied to CPU one by one).
    ``digests`` (tensor digests of ``state``, e.g. remembered from the last publish) save hashing
    it again. ``compress`` writes one zstd frame (``level``, ``threads`` as in ``zstandard``) whose
    header records the uncompressed size; name such files ``*.safetensors.zst``.
    """
    _check_little_endian()
    if version < 0:
        raise ValueError(f"anchor version must be >= 0, got {version}")
    names = sorted(state)
    digests = dict(digests) if digests is not None else state_digests({n: state[n] for n in names})
    if set(digests) != set(names):
        raise ValueError("digests must name exactly the tensors of state")
    specs = [(n, state[n].dtype, tuple(state[n].shape)) for n in names]
    header = build_header(specs, anchor_metadata(state, version, digests))
    total = len(header) + sum(t.numel() * t.element_size() for t in state.values())
    with _open_for_write(dest) as fh:
        start = fh.tell() if fh.seekable() else 0
        out: IO[bytes] = fh
        writer = None
        if compress:
            cctx = zstandard.ZstdCompressor(level=level, threads=threads, write_checksum=True)
            writer = cctx.stream_writer(fh, size=total, closefd=False)
            out = cast(IO[bytes], writer)
        out.write(header)
        for n in names:
            out.write(tensor_bytes(state[n]))
        if writer is not None:
            writer.close()  # ends the frame (writes its checksum); fh stays open
        nbytes = fh.tell() - start if fh.seekable() else total
    logger.debug(
        "wrote anchor v%d: %d tensors, %d bytes (compress=%s)",
        version,
        len(names),
        nbytes,
        compress,
    )
    return AnchorInfo(version, combine_digests(digests), digests, nbytes)


def encode_anchor(
    state: Mapping[str, torch.Tensor],
    version: int,
    compress: bool = False,
    *,
    digests: Mapping[str, str] | None = None,
    level: int = 3,
) -> bytes:
    """Anchor of ``state`` as bytes (see :func:`write_anchor` to stream a large model to a file)."""
    buf = io.BytesIO()
    write_anchor(buf, state, version, compress, digests=digests, level=level)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------
# read


def _read_stream(
    stream: IO[bytes], verify: bool, require_digests: bool
) -> tuple[dict[str, torch.Tensor], int | None, dict[str, str]]:
    meta, entries = read_header(stream)
    state: dict[str, torch.Tensor] = {}
    for entry in entries:
        t = torch.empty(entry.shape, dtype=entry.dtype)
        if entry.end > entry.start:
            buf = t.reshape(-1).view(torch.uint8).numpy().data
            read_exact(stream, buf, f"tensor {entry.name!r}")
        state[entry.name] = t
    try:
        trailing = stream.read(1)
    except zstandard.ZstdError as e:
        raise CorruptDeltaError(f"zstd stream is corrupt after the last tensor ({e})") from None
    if trailing:
        raise CorruptDeltaError("anchor has trailing bytes after its last tensor")
    if "deltarl.kind" not in meta and not require_digests:
        model_version = meta.get("model_version")
        version = int(model_version) if model_version and model_version.isdigit() else None
        return state, version, state_digests(state)
    anchor_version, _, digests = _parse_anchor_meta(meta, set(state))
    if verify:
        got = state_digests(state)
        bad = [n for n in sorted(state) if got[n] != digests[n]]
        if bad:
            raise CorruptDeltaError(
                f"anchor v{anchor_version}: {len(bad)} tensor(s) do not match their digest, e.g. {bad[:3]}"
            )
    return state, anchor_version, digests


def read_anchor(
    src: str | Path | BinaryIO, *, verify: bool = True, require_digests: bool = True
) -> tuple[dict[str, torch.Tensor], int | None, dict[str, str]]:
    """Read an anchor (compressed or not: detected from the zstd magic) from a path or file object.

    Streams: each tensor is read straight into its own buffer. Returns ``(state, version,
    tensor_digests)``. ``verify=False`` skips re-hashing the tensors (the metadata is still
    checked). ``require_digests=False`` also accepts a plain safetensors file without deltarl
    metadata (e.g. a TRL anchor): its version is TRL's ``model_version`` if present, else
    ``None``, and its digests are computed locally, which proves nothing about the writer.
    """
    _check_little_endian()
    fh: BinaryIO = open(src, "rb") if isinstance(src, str | Path) else src  # noqa: SIM115
    try:
        magic = fh.read(4)
        rest = cast(IO[bytes], _Prepend(magic, fh))
        if magic == ZSTD_MAGIC:
            rest = cast(IO[bytes], _ZstdReader(rest))
        return _read_stream(rest, verify, require_digests)
    finally:
        if isinstance(src, str | Path):
            fh.close()


def decode_anchor(
    data: bytes, *, verify: bool = True, require_digests: bool = True
) -> tuple[dict[str, torch.Tensor], int | None, dict[str, str]]:
    """Decode an anchor produced by :func:`encode_anchor`; see :func:`read_anchor`."""
    return read_anchor(io.BytesIO(data), verify=verify, require_digests=require_digests)


class _Prepend(io.RawIOBase):
    """A readable stream: ``head`` bytes followed by the rest of ``stream``."""

    def __init__(self, head: bytes, stream: IO[bytes]) -> None:
        self._head = head
        self._stream = stream

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        if self._head:
            n = min(len(view), len(self._head))
            view[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        return self._stream.readinto(view)  # type: ignore[attr-defined]


class _ZstdReader(io.RawIOBase):
    """Decompresses one zstd frame from ``source``; a frame cut short or followed by bytes is corrupt.

    (``zstandard``'s own ``stream_reader`` returns EOF quietly on a truncated frame, and only
    checks the frame's content checksum if the frame is read to its end.)
    """

    CHUNK = 1 << 16

    def __init__(self, source: IO[bytes]) -> None:
        self._source = source
        self._dobj = zstandard.ZstdDecompressor().decompressobj()
        self._buf = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        while not self._buf:
            if self._dobj.eof:
                if self._dobj.unused_data or self._source.read(1):
                    raise CorruptDeltaError("anchor has trailing bytes after its zstd frame")
                return 0
            chunk = self._source.read(self.CHUNK)
            if not chunk:
                raise CorruptDeltaError("input is truncated: the zstd frame ends early")
            try:
                self._buf = memoryview(self._dobj.decompress(chunk))
            except zstandard.ZstdError as e:
                raise CorruptDeltaError(f"zstd stream is corrupt ({e})") from None
        n = min(len(view), len(self._buf))
        view[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n
