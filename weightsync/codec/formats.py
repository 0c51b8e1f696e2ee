"""One entry point for every delta format: encode by name, decode by sniffing the bytes.

=============  =====================================================================  ==========
name           what it is                                                             needs base
=============  =====================================================================  ==========
``compact``    deltarl's entropy-coded format (default; :mod:`.compact`)               yes
``trl-raw``    TRL sparse safetensors, int32 positions (:mod:`.trl_format`)            no
``trl-gap``    TRL sparse safetensors, ``gap_delta`` positions (:mod:`.trl_format`)    no
=============  =====================================================================  ==========

"needs base": the compact format codes values and positions against the old weights, so encoding
and decoding it need the state at the delta's base version; TRL files carry absolute positions and
values.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Executor
from typing import Literal

import torch

from deltarl.weightsync.codec import compact, trl_format
from deltarl.weightsync.codec.compact_chunks import POSITIONS, ChunkScan
from deltarl.weightsync.codec.context import DeltaContext
from deltarl.weightsync.delta import Delta
from deltarl.weightsync.errors import CorruptDeltaError

DeltaFormat = Literal["compact", "trl-raw", "trl-gap"]
DELTA_FORMATS: tuple[str, ...] = ("compact", "trl-raw", "trl-gap")
FORMAT_TAGS = {
    "compact": f"{compact.FORMAT_NAME}-v{compact.FORMAT_VERSION}",
    "trl-raw": "trl-sparse-raw",
    "trl-gap": "trl-sparse-gap_delta",
}
READ_ONLY_TAGS = (f"{compact.FORMAT_NAME}-v1", f"{compact.FORMAT_NAME}-v2")
"""Delta format tags no longer written but still decoded (objects of an older trainer)."""


AUTO_GAPS_ELEMENTS = 16_000_000_000
"""``positions="auto"`` codes positions as gaps from this many elements of published state on.
Below it the decoder's walk over every element is cheap next to the rest of a sync and
contexts save about a third of the bytes; above it the walk grows to seconds (~0.3 ns per
element of the model on a 16-core host next to a generating vLLM, measured at Qwen3-30B-A3B's
shapes), so the sync is faster with gaps, at ~1.5x the bytes (real SmolLM2 steps: 11.3
against 7.6 bits per changed element)."""


def resolve_positions(positions: str, elements: int) -> str:
    """The compact format's position coding for ``positions`` (``"auto"``, or one of
    :data:`~.compact_chunks.POSITIONS`) and a published state of ``elements`` elements."""
    if positions == "auto":
        return "gaps" if elements >= AUTO_GAPS_ELEMENTS else "contexts"
    if positions not in POSITIONS:
        raise ValueError(f"positions must be 'auto' or one of {POSITIONS}, not {positions!r}")
    return positions


def encode_delta(
    delta: Delta,
    base: Mapping[str, torch.Tensor] | None,
    fmt: str = "compact",
    *,
    threads: int | None = None,
    context: DeltaContext | None = None,
    scans: Mapping[tuple[str, int], ChunkScan] | None = None,
    positions: str = "contexts",
) -> bytes:
    """Serialize ``delta`` in format ``fmt`` (``compact`` needs ``base``, or ``scans``: the
    chunks' context scans computed where the weights live, see :mod:`.device_scan`).
    ``positions``: how the compact format codes changed positions
    (:data:`~.compact_chunks.POSITIONS`; the TRL formats have one way).

    ``context``: make a *chained* compact delta, coded against the moves of the delta that
    produced ``base`` (:class:`~.context.DeltaContext`); only the compact format has one.
    """
    if context is not None and fmt != "compact":
        raise ValueError(f"only the compact format can be chained on a context, not {fmt!r}")
    if fmt == "compact":
        if base is None and scans is None:
            raise ValueError("the compact format needs the base state to encode against")
        return compact.encode_compact(
            delta, base, threads=threads, context=context, scans=scans, positions=positions
        )
    if fmt == "trl-raw":
        return trl_format.encode_trl(delta, "raw")
    if fmt == "trl-gap":
        return trl_format.encode_trl(delta, "gap_delta")
    raise ValueError(f"unknown delta format {fmt!r}; choose one of {', '.join(DELTA_FORMATS)}")


def detect_format(data: bytes | memoryview) -> str:
    """``"compact"`` or ``"trl"`` from the first bytes; :class:`CorruptDeltaError` otherwise."""
    if compact.is_compact(data):
        return "compact"
    head = bytes(data[:9])
    if len(head) == 9 and head[8:9] == b"{":  # safetensors: u64 header length, then JSON
        return "trl"
    raise CorruptDeltaError("not a delta: neither deltarl-compact nor safetensors (TRL) bytes")


def decode_delta(
    data: bytes,
    base: Mapping[str, torch.Tensor],
    *,
    check_base: bool = True,
    base_digests: Mapping[str, str] | None = None,
    threads: int | None = None,
    context: DeltaContext | None = None,
    pinned: bool = False,
    pool: Executor | None = None,
) -> Delta:
    """Decode a delta of any format against ``base`` (the state it will be applied to).

    With ``check_base`` a compact delta refuses a wrong base before decoding; for TRL files the
    base is checked by :func:`~.delta.apply_delta`. ``context``: the context of the delta that
    produced ``base``, needed by a chained compact delta (ignored by every other delta).
    ``pinned``: decode a compact delta's changes into pinned buffers laid out for a GPU;
    ``pool``: threads shared with other decodes (both: see :func:`~.compact.decode_compact`).
    """
    kind = detect_format(data)
    if kind == "compact":
        return compact.decode_compact(
            data,
            base,
            check_base=check_base,
            base_digests=base_digests,
            threads=threads,
            context=context,
            pinned=pinned,
            pool=pool,
        )
    return trl_format.decode_trl(data, like=base)


def describe(data: bytes) -> dict[str, object]:
    """Check a delta's own integrity (checksums, header) without its base, and describe it.

    Returns ``format``, ``base_version``, ``version``, ``result_digest`` (the state digest the
    delta produces, ``None`` for a plain TRL file without digests), and for a compact delta
    ``context`` (what a chained delta is chained on, None for a standalone one) and
    ``positions`` (its chunks by position coding).
    """
    kind = detect_format(data)
    if kind == "compact":
        from deltarl.weightsync.digest import combine_digests

        positions = compact.position_counts(data)  # checks every checksum
        footer = compact.read_footer(data)
        return {
            "format": f"{compact.FORMAT_NAME}-v{footer['format_version']}",
            "positions": positions,
            "base_version": footer.get("base_version"),
            "version": footer.get("version"),
            "context": compact.context_of(footer),
            "result_digest": combine_digests(
                {t["name"]: t["result_digest"] for t in footer["tensors"]}
            ),
        }
    meta = trl_format.trl_metadata(data)
    known = "deltarl.tensors" in meta
    delta = trl_format.decode_trl(data) if known else None
    return {
        "format": "trl-sparse-" + meta.get("encoding", "raw"),
        "base_version": delta.base_version if delta else None,
        "version": delta.version if delta else meta.get("model_version"),
        "result_digest": delta.result_digest if delta else None,
    }


def squash_chain(
    base: Mapping[str, torch.Tensor],
    blobs: list[bytes],
    fmt: str = "compact",
    *,
    threads: int | None = None,
    context: DeltaContext | None = None,
) -> tuple[Delta, bytes]:
    """Squash serialized deltas v -> v+1 -> ... -> v+k into one v -> v+k delta and encode it.

    ``base`` is the state at version v (CPU tensors; left untouched). Each delta is decoded
    against a working copy of the state it applies to, applied and verified, so a broken chain is
    refused with the error of the first bad link. Chained deltas may be mixed in: each link
    gets the context of the one before (the first gets ``context``, that of the delta that
    produced ``base``, if any). The squashed delta is standalone. Memory: one copy of the model
    plus the deltas.
    """
    if not blobs:
        raise ValueError("squash needs at least one delta")
    from deltarl.weightsync.delta import apply_delta, compose
    from deltarl.weightsync.digest import state_digests

    state = {k: v.detach().cpu().clone() for k, v in base.items()}
    digests = state_digests(state)
    deltas = []
    for blob in blobs:
        d = decode_delta(blob, state, base_digests=digests, threads=threads, context=context)
        context = DeltaContext.of(d, state)
        digests = apply_delta(state, d, state_digests=digests)
        deltas.append(d)
    squashed = compose(deltas)
    return squashed, encode_delta(squashed, base, fmt, threads=threads)
