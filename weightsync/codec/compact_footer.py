"""The footer of a compact delta, read defensively: bounded decompression, bounded nesting, typed
fields (docs/formats.md describes the bytes).

A footer comes from a bucket that an attacker may write, so before anything trusts it:

* its zstd frame is decompressed through a reader that stops at a limit (never the frame's own
  declared content size): at most :data:`FOOTER_RATIO` x its compressed length plus 64 KiB, and
  never more than :data:`MAX_FOOTER` (a real SmolLM2 footer: ~30 KB compressed 5x);
* JSON nesting deeper than Python's recursion limit is a :class:`CorruptDeltaError`, not a
  ``RecursionError``;
* every field is type- and range-checked by :class:`Footer` (versions are non-negative 63-bit
  integers, dtypes one of the codec's float formats, shapes of at most
  :data:`MAX_TENSOR_ELEMENTS` elements, chunk entries six non-negative integers, ...).
"""

from __future__ import annotations

import io
import json
from typing import Annotated, Any, Literal

import zstandard
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from deltarl.weightsync.errors import CorruptDeltaError

FORMAT_NAME = "deltarl-compact"
FORMAT_VERSION = 3
"""Written by the encoder. 3: a chunk codes its positions by context rank or as plain gaps
(:data:`~.compact_chunks.POSITIONS`), said by its header's first varint. 2: each chunk header
also counts the elements of the contexts it lists (the decoder's pass that counted them from the
base is gone). 1 and 2 are still decoded."""
READ_VERSIONS = (1, 2, 3)
MAX_FOOTER = 256 << 20  # bytes of a decompressed footer or index, whatever the object claims
FOOTER_RATIO = 64  # a footer's JSON never expands more than this from its zstd frame
MAX_TENSOR_ELEMENTS = 1 << 36  # 64 G elements: far beyond any tensor a delta patches
MAX_U64 = (1 << 64) - 1
DIGEST_PATTERN = r"^([0-9a-f]{1,128}|unknown)$"  # hex, or delta.UNKNOWN_DIGEST

Version = Annotated[int, Field(strict=True, ge=0, lt=1 << 63)]
Count = Annotated[int, Field(strict=True, ge=0, lt=1 << 63)]
U64 = Annotated[int, Field(strict=True, ge=0, le=MAX_U64)]


class _Checked(BaseModel):
    # unknown keys are ignored (a newer writer may add some); known ones must be right
    model_config = ConfigDict(extra="ignore", frozen=True)


class FooterTensor(_Checked):
    """One patched tensor of a compact delta."""

    name: str = Field(strict=True, min_length=1, max_length=4096)
    dtype: Literal["bfloat16", "float16", "float32", "float8_e4m3fn"]
    shape: list[Count] = Field(max_length=16)
    changed: Count
    result_digest: str = Field(strict=True, pattern=DIGEST_PATTERN)
    chunks: list[tuple[Count, Count, Count, Count, Count, Count]]

    @field_validator("shape")
    @classmethod
    def _bounded(cls, shape: list[int]) -> list[int]:
        numel = 1
        for s in shape:
            numel *= s
            if numel > MAX_TENSOR_ELEMENTS:
                raise ValueError(f"shape {shape} has more than {MAX_TENSOR_ELEMENTS} elements")
        return shape


class Footer(_Checked):
    """The fields of a compact delta's footer that the decoder relies on."""

    format: Literal["deltarl-compact"]
    format_version: Literal[1, 2, 3]
    base_version: Version | None
    version: Version | None
    prob_bits: Count
    index: tuple[Count, Count, Count, U64]  # offset, packed length, raw length, xxh3-64
    body_xxh3: U64
    base_digest: str = Field(strict=True, pattern=DIGEST_PATTERN)
    context: dict[str, Any] | None = None  # checked by compact.context_of
    tensors: list[FooterTensor]

    @field_validator("tensors")
    @classmethod
    def _unique(cls, tensors: list[FooterTensor]) -> list[FooterTensor]:
        names = [t.name for t in tensors]
        if len(set(names)) != len(names):
            raise ValueError("a tensor is listed twice")
        return tensors


def bounded_decompress(packed: bytes | memoryview, limit: int, what: str) -> bytes:
    """Decompress one zstd frame, refusing more than ``limit`` bytes of output (memory stays
    bounded by the limit, whatever the frame declares)."""
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(bytes(packed))) as reader:
            out = reader.read(limit + 1)
    except zstandard.ZstdError as e:
        raise CorruptDeltaError(f"{what} unreadable: {e}") from e
    if len(out) > limit:
        raise CorruptDeltaError(f"{what} expands past {limit} bytes: refused (compression bomb?)")
    return out


def parse_footer(packed: bytes | memoryview) -> dict[str, Any]:
    """The checked footer of a compact delta from its zstd frame (:class:`CorruptDeltaError`
    says what is wrong)."""
    limit = min(MAX_FOOTER, FOOTER_RATIO * len(packed) + (64 << 10))
    raw = bounded_decompress(packed, limit, "deltarl-compact footer")
    try:
        footer = json.loads(raw)
    except RecursionError:
        raise CorruptDeltaError("deltarl-compact footer is nested too deeply") from None
    except ValueError as e:
        raise CorruptDeltaError(f"deltarl-compact footer unreadable: {e}") from e
    if not isinstance(footer, dict):
        raise CorruptDeltaError("deltarl-compact footer is not a JSON object")
    if footer.get("format") != FORMAT_NAME:
        raise CorruptDeltaError("deltarl-compact footer has the wrong format tag")
    if footer.get("format_version") not in READ_VERSIONS:
        raise CorruptDeltaError(
            f"unsupported deltarl-compact version {footer.get('format_version')!r}"
        )
    try:
        Footer.model_validate(footer)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise CorruptDeltaError(
            f"deltarl-compact footer field {where}: {err['msg']}"
            + (f" ({len(e.errors())} problems)" if len(e.errors()) > 1 else "")
        ) from None
    return footer
