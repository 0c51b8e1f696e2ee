"""The ``deltarl-compact`` delta format: entropy-coded positions and values, old weights as side
information.

Why it is small (see docs/formats.md for the byte layout):

* **Positions.** Whether a bf16 element changes depends mostly on its ULP, i.e. on the exponent of
  its *old* value, which the receiver already has. Each tensor chunk is split into contexts by old
  exponent; inside a context the changed elements are coded as Rice-coded gaps between their ranks
  among that context's elements, with the Rice parameter derived from the context's change rate.
  Contexts where more than half the elements changed code the unchanged ones instead.
* **Values.** What is coded is the difference of the new and old bit patterns (in ULPs, wrapped to
  the integer width), not the raw value: mostly +-1. Small differences are one symbol; larger ones
  a symbol for their bit length and leading bits plus raw low bits (``entropy.py``). Symbols are
  rANS-coded, each context with either the table shared by its exponent across the whole delta
  or a table of its own where that is cheaper, the table included.

Chunks of at most ``chunk_elems`` elements are analysed and coded independently on all cores
(numba kernels release the GIL), so memory stays bounded by a chunk of the model plus the delta.

Integrity: the trailer carries an xxh3-64 of the footer, the footer an xxh3-64 of every chunk and
of the index, the base state's digest and every tensor's result digest. :func:`decode_compact` refuses a wrong base before decoding
and any damaged byte with :class:`CorruptDeltaError`. The magic, the chunk bodies, the index, the
footer and the trailer tile the object exactly: a byte outside them (a file joined to another,
bytes spliced in before the footer) is refused too.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import struct
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import xxhash
import zstandard

from deltarl.weightsync.change_buffers import change_arrays
from deltarl.weightsync.codec import kernels
from deltarl.weightsync.codec.bits import bits_numpy, float_format
from deltarl.weightsync.codec.compact_chunks import (
    POSITIONS,
    ChunkAnalysis,
    ChunkHeader,
    ChunkRef,
    ChunkScan,
    Prediction,
    analyse_chunk,
    analyse_scan_by_gaps,
    choose_own_tables,
    code_chunk,
    decode_chunk,
    decode_gap_batch,
    n_keys,
    plan_gap_chunks,
    read_header,
    shared_tables,
)
from deltarl.weightsync.codec.compact_footer import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_FOOTER,
    bounded_decompress,
    parse_footer,
)
from deltarl.weightsync.codec.context import (
    RHO16_DEFAULT,
    ContextMismatchError,
    DeltaContext,
)
from deltarl.weightsync.codec.entropy import (
    ALPHABET,
    VarintReader,
    cumulative,
    read_table,
    table_bytes,
    varints,
)
from deltarl.weightsync.delta import (
    UNKNOWN_DIGEST,
    Delta,
    TensorPatch,
    check_compatible,
    compute_delta,
)
from deltarl.weightsync.digest import combine_digests, state_digests
from deltarl.weightsync.errors import BaseMismatchError, CorruptDeltaError

MAGIC = b"DRLDLT01"
TRAILER_MAGIC = b"DRLDEND1"
TRAILER = struct.Struct("<QQ8s")  # footer length, xxh3-64 of footer, end magic
DEFAULT_CHUNK_ELEMS = 1 << 24
# the decoder cuts the chunks coded by gaps into this many runs per thread (runs of about as
# many changes; a few per thread, so that one slow run does not leave the others idle)
GAP_RUNS_PER_THREAD = 4
# index and footer: level 19 took ~0.2 s per object (serial, every publication) to save < 1 KB
ZSTD_LEVEL = 3


def default_threads() -> int:
    return max(1, min(32, os.cpu_count() or 1))


# ---------------------------------------------------------------------------------------------
# encoder


def _chunks(patches: Mapping[str, TensorPatch], chunk_elems: int) -> list[tuple[str, int, int]]:
    jobs = []
    for name in sorted(patches):
        p = patches[name]
        if not p.changed:
            continue
        n = p.numel
        for start in range(0, n, chunk_elems):
            count = min(chunk_elems, n - start)
            lo, hi = np.searchsorted(p.index, [start, start + count])
            if hi > lo:
                jobs.append((name, start, count))
    return jobs


def encode_compact(
    delta: Delta,
    base: Mapping[str, torch.Tensor] | None,
    *,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    threads: int | None = None,
    context: DeltaContext | None = None,
    rho16: int = RHO16_DEFAULT,
    scans: Mapping[tuple[str, int], ChunkScan] | None = None,
    positions: str = "contexts",
) -> bytes:
    """Serialize ``delta`` in the compact format, using ``base`` (the state at the delta's base
    version; GPU tensors are copied to CPU one at a time) as side information.

    With ``context`` (the :class:`~.context.DeltaContext` of the delta that produced ``base``)
    the delta is *chained*: values are coded against an extrapolation of each element's
    previous move, and only a receiver holding the same context can decode it.

    ``scans``: the context scan of every chunk with changes, by (tensor, chunk start), computed
    elsewhere with the same ``chunk_elems`` (:func:`~.device_scan.changes_and_scans`, on the
    GPU holding the weights); then ``base`` is not read and may be None. Standalone only. The
    bytes are the same as with ``base``.

    ``positions``: ``"contexts"`` (the fewest bytes; the decoder walks every element of a
    changed chunk) or ``"gaps"`` (a decoder that reads only the changed elements; more bytes):
    :data:`~.compact_chunks.POSITIONS`.

    Phase A analyses every chunk in parallel (contexts, ranks, symbols); then the value tables are
    chosen for the whole delta (shared per old exponent, or a context's own where that is cheaper
    including the table); phase B codes every chunk in parallel.
    """
    if base is not None:
        check_compatible(base, delta.patches)
    elif scans is None:
        raise ValueError("the compact encoder needs the base state or the chunks' scans")
    if chunk_elems < 1:
        raise ValueError("chunk_elems must be positive")
    if positions not in POSITIONS:
        raise ValueError(f"positions must be one of {POSITIONS}, not {positions!r}")
    threads = threads or default_threads()
    if context is not None:
        _check_context_dtypes(context, delta)
        if not 0 <= rho16 <= 32:
            raise ValueError(f"rho16 must be in [0, 32], got {rho16}")
    chained = context is not None
    jobs = _chunks(delta.patches, chunk_elems)
    if scans is not None:
        if chained:
            raise ValueError("precomputed scans are for standalone deltas, not chained ones")
        missing = [(n, s) for n, s, _ in jobs if (n, s) not in scans]
        if missing:
            raise ValueError(f"no scan of chunk(s) {missing[:3]} (chunk_elems {chunk_elems})")
    olds: dict[str, np.ndarray] = {}
    for name in {j[0] for j in jobs} if scans is None else ():
        assert base is not None
        t = base[name]
        if t.device.type != "cpu":
            t = t.cpu()
        olds[name] = bits_numpy(t.contiguous())

    def analyse(job: tuple[str, int, int]) -> ChunkAnalysis:
        name, start, count = job
        p = delta.patches[name]
        lo, hi = np.searchsorted(p.index, [start, start + count])
        fmt = float_format(p.dtype)
        value = p.value[lo:hi]
        scan, old, prev = None, None, None
        if scans is not None:
            scan = scans[(name, start)]
            if scan.count != count:
                raise ValueError(
                    f"scan of {name}[{start}:] covers {scan.count} elements, not {count}"
                )
            if positions == "gaps":  # one compiled call, chunk-local indices made there
                return analyse_scan_by_gaps(name, start, p.index[lo:hi], value, fmt, scan)
        else:
            old = olds[name][start : start + count]
            prev = _prediction(context, name, start, count, rho16)
        index = p.index[lo:hi] - start
        return analyse_chunk(
            name, start, old, index, value, fmt, prev, scan=scan, positions=positions
        )

    with ThreadPoolExecutor(threads) as pool:
        analyses = list(pool.map(analyse, jobs))
        table_of_key, shared = shared_tables(analyses, use_own=False, chained=chained)
        # each chunk's choice on the pool: a few numpy passes over its counts, ~0.1 ms a chunk
        # on one core, ~50 ms serial for a Qwen3-30B-A3B rank's ~460 chunks
        list(pool.map(lambda a: choose_own_tables(a, table_of_key, shared), analyses))
        if any(a.own is not None and a.own.any() for a in analyses):
            table_of_key, shared = shared_tables(analyses, use_own=True, chained=chained)
        freq32 = shared.astype(np.int32)
        shared32 = (freq32, cumulative(freq32))
        coded = list(pool.map(lambda a: code_chunk(a, table_of_key, shared, shared32), analyses))

    # the shared tables, then which value context uses which: (key gap, table) pairs
    used = np.flatnonzero(table_of_key >= 0)
    index = bytearray(varints([int(shared.shape[0])]))
    for f in shared:
        index += table_bytes(f)
    index += varints([int(used.size)])
    prev_key = -1
    for b in used.tolist():
        index += varints([b - prev_key - 1, int(table_of_key[b])])
        prev_key = b
    chunk_meta: dict[str, list[list[int]]] = {}
    changed: dict[str, int] = {}
    for a in analyses:
        changed[a.tensor] = changed.get(a.tensor, 0) + int(a.symbols.size)
    # chunks follow each other in footer order (tensors by name, chunks by start), so their
    # body and header offsets are running sums of the lengths listed there
    out = bytearray(MAGIC)
    for a, (head, body, lengths) in zip(analyses, coded, strict=True):
        # [start, count, header bytes, rice, rans, extra bytes]
        chunk_meta.setdefault(a.tensor, []).append([a.start, a.count, len(head), *lengths])
        index += head
        out += body
    body_digest = xxhash.xxh3_64_intdigest(memoryview(out)[len(MAGIC) :])
    packed_index = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(bytes(index))
    index_meta = [len(out), len(packed_index), len(index), xxhash.xxh3_64_intdigest(packed_index)]
    out += packed_index
    footer = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "base_version": delta.base_version,
        "version": delta.version,
        "prob_bits": kernels.PROB_BITS,
        "index": index_meta,
        "body_xxh3": body_digest,  # xxh3-64 of every chunk body, end to end
        # one digest for the whole base (per-tensor base digests follow from it, see decode)
        "base_digest": delta.base_digest,
        **({"context": {**context.describe(), "rho16": rho16}} if context is not None else {}),
        "tensors": [
            {
                "name": p.name,
                "dtype": p.dtype,
                "shape": list(p.shape),
                "changed": changed.get(p.name, 0),
                "result_digest": p.result_digest,
                "chunks": chunk_meta.get(p.name, []),
            }
            for p in (delta.patches[n] for n in sorted(delta.patches))
        ],
    }
    raw = json.dumps(footer, separators=(",", ":")).encode()
    packed = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw)
    out += packed
    out += TRAILER.pack(len(packed), xxhash.xxh3_64_intdigest(packed), TRAILER_MAGIC)
    return bytes(out)


def _prediction(
    context: DeltaContext | None, name: str, start: int, count: int, rho16: int
) -> Prediction | None:
    if context is None:
        return None
    index, before = context.chunk(name, start, count)
    return Prediction(index, before, rho16)


def _check_context_dtypes(context: DeltaContext, delta: Delta) -> None:
    for name, dtype in context.dtypes.items():
        p = delta.patches.get(name)
        if p is None or p.dtype != dtype:
            raise ContextMismatchError(
                f"context delta {context.base_version} -> {context.version} has tensor {name!r} "
                f"({dtype}), which this delta "
                + ("does not have" if p is None else f"holds as {p.dtype}")
            )


def context_of(footer: Mapping[str, Any]) -> dict[str, Any] | None:
    """The context a compact delta's footer names (None: a standalone delta)."""
    ctx = footer.get("context")
    if ctx is None:
        return None
    if not isinstance(ctx, dict) or not isinstance(ctx.get("digest"), str):
        raise CorruptDeltaError("deltarl-compact footer: malformed context record")
    rho16 = ctx.get("rho16")
    if not isinstance(rho16, int) or isinstance(rho16, bool) or not 0 <= rho16 <= 32:
        raise CorruptDeltaError(f"deltarl-compact footer: bad extrapolation factor {rho16!r}")
    return ctx


def _v(version: object) -> str:
    return "?" if version is None else str(version)


def check_context(footer: Mapping[str, Any], context: DeltaContext | None) -> int | None:
    """Refuse (:class:`ContextMismatchError`) a chained delta without its context; return the
    extrapolation factor (None for a standalone delta, which ignores ``context``)."""
    need = context_of(footer)
    if need is None:
        return None
    what = f"delta {_v(footer.get('base_version'))} -> {_v(footer.get('version'))}"
    wanted = f"delta {_v(need.get('base_version'))} -> {_v(need.get('version'))}"
    if context is None:
        raise ContextMismatchError(
            f"{what} is chained on {wanted}: it decodes only with that delta's context, and "
            "none was given (use the standalone delta); nothing was decoded"
        )
    if context.digest != need["digest"]:
        raise ContextMismatchError(
            f"{what} is chained on {wanted}, but the context given is of delta "
            f"{_v(context.base_version)} -> {_v(context.version)} (digest {context.digest[:12]}, not "
            f"{need['digest'][:12]}); nothing was decoded"
        )
    return int(need["rho16"])


# ---------------------------------------------------------------------------------------------
# decoder


def is_compact(data: bytes | memoryview) -> bool:
    return bytes(data[: len(MAGIC)]) == MAGIC


def read_footer(data: bytes | memoryview) -> dict[str, Any]:
    """Parse and check the footer of a compact delta (raises :class:`CorruptDeltaError`)."""
    buf = memoryview(data)
    if len(buf) < len(MAGIC) + TRAILER.size or bytes(buf[: len(MAGIC)]) != MAGIC:
        raise CorruptDeltaError("not a deltarl-compact delta (bad magic or too short: truncated?)")
    flen, fhash, end = TRAILER.unpack(buf[len(buf) - TRAILER.size :])
    if end != TRAILER_MAGIC:
        raise CorruptDeltaError("deltarl-compact delta has no valid trailer: truncated or damaged")
    if flen > min(MAX_FOOTER, len(buf) - TRAILER.size - len(MAGIC)):
        raise CorruptDeltaError(f"deltarl-compact footer length {flen} does not fit the object")
    packed = buf[len(buf) - TRAILER.size - flen : len(buf) - TRAILER.size]
    if xxhash.xxh3_64_intdigest(packed) != fhash:
        raise CorruptDeltaError("deltarl-compact footer checksum mismatch: the object is damaged")
    return parse_footer(packed)


def _read_index(
    buf: memoryview, footer: dict[str, Any], body_end: int
) -> tuple[np.ndarray, np.ndarray, bytes]:
    """Check and unpack the index: shared tables, then every chunk's header.

    Returns ``(table_of_key [n_keys], shared freq [S, ALPHABET], decompressed index bytes)``.
    """
    nk = n_keys(context_of(footer) is not None)
    if footer.get("prob_bits") != kernels.PROB_BITS:
        raise CorruptDeltaError(f"unsupported probability precision {footer.get('prob_bits')!r}")
    try:
        off, length, raw_len, digest = (int(x) for x in footer["index"])
    except (KeyError, TypeError, ValueError):
        raise CorruptDeltaError("footer does not locate the index") from None
    if off < len(MAGIC) or off + length > body_end or raw_len > MAX_FOOTER:
        raise CorruptDeltaError("index lies outside the object")
    if off + length != body_end:  # the parts tile the object: nothing before the footer unread
        raise CorruptDeltaError(
            f"deltarl-compact delta has {body_end - off - length} bytes between its index and "
            "its footer that belong to neither (trailing or spliced bytes: two files joined?)"
        )
    packed = buf[off : off + length]
    if xxhash.xxh3_64_intdigest(packed) != digest:
        raise CorruptDeltaError("index is damaged (checksum mismatch)")
    index = bounded_decompress(packed, raw_len, "index")  # the size the footer declares
    if len(index) != raw_len:
        raise CorruptDeltaError("index has the wrong length")
    r = VarintReader(index, "shared tables")
    n = r.varint()
    if n > nk:
        raise CorruptDeltaError(f"shared tables: {n} tables")
    freq = np.zeros((n, ALPHABET), np.int64)
    for i in range(n):
        freq[i] = read_table(r)
    n_used = r.varint()
    if n_used > nk:
        raise CorruptDeltaError(f"shared tables: {n_used} contexts")
    table_of_key = np.full(nk, -1, np.int64)
    key = -1
    for _ in range(n_used):
        key += r.varint() + 1
        table = r.varint()
        if key >= nk or table >= n:
            raise CorruptDeltaError("shared tables: bad context or table number")
        table_of_key[key] = table
    return table_of_key, freq, index


def _chunk_refs(
    buf: memoryview, footer: dict[str, Any], body_end: int, index: bytes
) -> list[ChunkRef]:
    """Locate every chunk and check the bodies' checksum (no base needed)."""
    refs = []
    off = len(MAGIC)
    hoff = len(index) - sum(int(m[2]) for t in footer["tensors"] for m in t["chunks"])
    if hoff < 0:
        raise CorruptDeltaError("chunk headers do not fit the index")
    for t in footer["tensors"]:
        name = t["name"]
        numel = int(np.prod(t["shape"], dtype=np.int64))
        for meta in t["chunks"]:
            try:
                start, count, hlen, rl, al, el = (int(x) for x in meta)
            except (TypeError, ValueError):
                raise CorruptDeltaError(f"{name}: malformed chunk entry in the footer") from None
            length = rl + al + el
            if min(hlen, rl, al, el) < 0 or off + length > body_end:
                raise CorruptDeltaError(f"{name}: chunk at byte {off} lies outside the object")
            if start < 0 or count <= 0 or start + count > numel:
                raise CorruptDeltaError(
                    f"{name}: chunk [{start}, {start + count}) lies outside the tensor"
                )
            refs.append(
                ChunkRef(
                    name,
                    start,
                    count,
                    index[hoff : hoff + hlen],
                    buf[off : off + length],
                    (rl, al, el),
                    off,
                )
            )
            off += length
            hoff += hlen
    index_off = int(footer["index"][0])
    if off != index_off:
        raise CorruptDeltaError("chunk bodies do not end where the index starts")
    if xxhash.xxh3_64_intdigest(buf[len(MAGIC) : off]) != footer.get("body_xxh3"):
        raise CorruptDeltaError("chunk bodies are damaged (checksum mismatch)")
    return refs


def _body_end(buf: memoryview) -> int:
    return len(buf) - TRAILER.size - TRAILER.unpack(buf[len(buf) - TRAILER.size :])[0]


def decode_compact(
    data: bytes | memoryview,
    base: Mapping[str, torch.Tensor],
    *,
    check_base: bool = True,
    base_digests: Mapping[str, str] | None = None,
    threads: int | None = None,
    context: DeltaContext | None = None,
    pinned: bool = False,
    pool: Executor | None = None,
) -> Delta:
    """Decode a compact delta against ``base`` (tensors at the delta's base version).

    Order: trailer, footer and every checksum are verified first; then a chained delta's
    context (:class:`~.context.ContextMismatchError` unless ``context`` is the one it was coded
    against; a standalone delta ignores ``context``); then (with ``check_base``, the default)
    the base digests, so a wrong base is refused with :class:`BaseMismatchError` instead of
    decoding garbage (``base_digests`` are trusted digests of ``base`` that save hashing it);
    then the chunks are decoded in parallel. Nothing is written anywhere. With ``pinned`` the
    changes are decoded into pinned host buffers laid out for a GPU
    (:func:`~deltarl.weightsync.change_buffers.change_arrays`), which ``stage_delta`` copies
    as they lie. ``pool``: threads to decode on (shared by several decodes at once; ``threads``
    is then ignored), else a pool of ``threads`` made for this one.
    """
    footer = read_footer(data)
    rho16 = check_context(footer, context)
    buf = memoryview(data)
    body_end = _body_end(buf)
    patches: dict[str, TensorPatch] = {}
    try:
        for t in footer["tensors"]:
            fmt = float_format(t["dtype"])
            patches[t["name"]] = TensorPatch(
                name=t["name"],
                dtype=fmt.name,
                shape=tuple(int(s) for s in t["shape"]),
                index=np.empty(0, np.int64),
                value=np.empty(0, fmt.bits_dtype),
                base_digest=UNKNOWN_DIGEST,
                result_digest=str(t["result_digest"]),
            )
        base_state_digest = str(footer["base_digest"])
        table_of_key, shared, index = _read_index(buf, footer, body_end)
        refs = _chunk_refs(buf, footer, body_end, index)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, CorruptDeltaError):
            raise
        raise CorruptDeltaError(f"deltarl-compact footer is malformed: {e}") from e
    delta = Delta(
        base_version=footer.get("base_version"), version=footer.get("version"), patches=patches
    )
    # The footer holds one digest of the whole base. Once the base's tensor digests combine to
    # it, each tensor's base digest is the base's own (a different tensor would change the
    # combination), so the patches get full per-tensor base digests without storing them.
    check_compatible(base, patches)
    if context is not None and rho16 is not None:
        _check_context_dtypes(context, delta)
    have = dict(base_digests) if base_digests is not None else state_digests(base)
    is_base = combine_digests(have) == base_state_digest
    if check_base and not is_base:
        twice = have == {n: p.result_digest for n, p in patches.items()}
        hint = (
            " (it already holds the delta's result: was the delta applied twice?)" if twice else ""
        )
        raise BaseMismatchError(
            f"state is not the base of this delta (version {delta.base_version} -> {delta.version}): "
            f"its digest differs{hint}; nothing was written"
        )
    for name, p in patches.items():
        p.base_digest = have[name] if is_base else UNKNOWN_DIGEST

    version = int(footer["format_version"])
    olds: dict[str, np.ndarray] = {}
    for name in {r.tensor for r in refs}:
        tt = base[name]
        if tt.device.type != "cpu":
            tt = tt.cpu()
        olds[name] = bits_numpy(tt if tt.is_contiguous() else tt.contiguous())

    whole, single, headers = _whole_tensors(refs, patches, version, chained=rho16 is not None)
    outs = _change_arrays(footer, patches) if pinned else {}

    def run(ref: ChunkRef) -> tuple[np.ndarray, np.ndarray]:
        fmt = float_format(patches[ref.tensor].dtype)
        old = olds[ref.tensor][ref.start : ref.start + ref.count]
        prev = (
            _prediction(context, ref.tensor, ref.start, ref.count, rho16)
            if rho16 is not None
            else None
        )
        header = headers.get(id(ref))
        idx, val = decode_chunk(ref, old, fmt, table_of_key, shared, prev, version, header)
        if not kernels.increasing_below(idx, ref.count):
            raise CorruptDeltaError(
                f"{ref.tensor}: the chunk at element {ref.start} decodes positions out of "
                "order or outside the chunk"
            )
        return idx, val

    object_bytes = np.frombuffer(buf, np.uint8)
    n_threads = threads or default_threads()
    by_format: dict[str, dict[str, list[tuple[ChunkRef, ChunkHeader]]]] = {}
    for name, coded in whole.items():
        by_format.setdefault(patches[name].dtype, {})[name] = coded
    plans = [
        plan_gap_chunks(group, float_format(dtype), olds, outs, table_of_key, shared)
        for dtype, group in by_format.items()
    ]
    with _pool_or_own(pool, n_threads) as workers:
        # a few runs of chunks per thread, each one compiled call: one GIL hand-off per run,
        # not per tensor (next to a generating engine's Python thread a hand-off can wait for
        # its switch interval)
        jobs = [
            workers.submit(decode_gap_batch, plan, object_bytes, lo, hi)
            for plan in plans
            for lo, hi in plan.batches(GAP_RUNS_PER_THREAD * n_threads)
        ]
        results = list(workers.map(run, single))
        parts: dict[str, list[tuple[ChunkRef, np.ndarray, np.ndarray]]] = {}
        for ref, (idx, val) in zip(single, results, strict=True):
            parts.setdefault(ref.tensor, []).append((ref, idx, val))
        for name, decoded in parts.items():
            _assemble(patches[name], decoded, workers, outs.get(name))
        for job in jobs:
            job.result()
    for plan in plans:
        for name, (index_out, value_out) in plan.results.items():
            patches[name].index, patches[name].value = index_out, value_out
    for t in footer["tensors"]:
        name = t["name"]
        p = patches[name]
        if p.changed != int(t["changed"]):
            raise CorruptDeltaError(
                f"{name}: decoded {p.changed} changes, the footer says {t['changed']}"
            )
    return delta


@contextlib.contextmanager
def _pool_or_own(pool: Executor | None, threads: int) -> Iterator[Executor]:
    """``pool``, or a pool of ``threads`` for the block (shut down after it)."""
    if pool is not None:
        yield pool
        return
    with ThreadPoolExecutor(threads) as own:
        yield own


def _change_arrays(
    footer: Mapping[str, Any], patches: Mapping[str, TensorPatch]
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Output arrays of every tensor's changes (as many as the footer says; checked after the
    decode) in pinned buffers laid out for staging
    (:func:`~deltarl.weightsync.change_buffers.change_arrays`)."""
    names = [str(t["name"]) for t in footer["tensors"]]
    sizes = []
    for t, name in zip(footer["tensors"], names, strict=True):
        n, p = int(t["changed"]), patches[name]
        if not 0 <= n <= p.numel:
            raise CorruptDeltaError(f"{name}: the footer lists {n} changes of {p.numel} elements")
        sizes.append((n, np.dtype(p.value.dtype)))
    return dict(zip(names, change_arrays(sizes), strict=True))


def _whole_tensors(
    refs: list[ChunkRef], patches: Mapping[str, TensorPatch], version: int, *, chained: bool
) -> tuple[dict[str, list[tuple[ChunkRef, ChunkHeader]]], list[ChunkRef], dict[int, ChunkHeader]]:
    """The tensors whose chunks are all standalone and coded by gaps (decoded in runs of
    chunks, one compiled call a run: :func:`~.compact_chunks.plan_gap_chunks`), with their read
    headers; every other chunk (decoded one by one); and those chunks' headers read here, by
    ``id`` of their ref (chained deltas' are read when decoded)."""
    if version < 3 or chained:
        return {}, refs, {}
    by_tensor: dict[str, list[ChunkRef]] = {}
    for r in refs:
        by_tensor.setdefault(r.tensor, []).append(r)
    whole: dict[str, list[tuple[ChunkRef, ChunkHeader]]] = {}
    single: list[ChunkRef] = []
    read: dict[int, ChunkHeader] = {}
    for name, rs in by_tensor.items():
        fmt = float_format(patches[name].dtype)
        headers = [read_header(r, fmt, False, version) for r in rs]
        if all(h.by_gaps for h in headers):
            whole[name] = list(zip(rs, headers, strict=True))
        else:
            single += rs
            read.update((id(r), h) for r, h in zip(rs, headers, strict=True))
    return whole, single, read


def _assemble(
    patch: TensorPatch,
    chunks: list[tuple[ChunkRef, np.ndarray, np.ndarray]],
    pool: Executor,
    out: tuple[np.ndarray, np.ndarray] | None = None,
) -> None:
    """``patch``'s indices and values from its decoded chunks (chunk-local indices, each chunk's
    checked in order and inside it): the chunks in element order, refused if their ranges
    overlap, copied into place on the pool (a serial concatenation cost ~7 ns a change);
    into ``out`` (arrays sized by the footer) when given."""
    total = sum(idx.size for _, idx, _ in chunks)
    if out is not None and out[0].size != total:
        raise CorruptDeltaError(
            f"{patch.name}: decoded {total} changes, the footer says {out[0].size}"
        )
    if len(chunks) == 1 and out is None:  # the common case: nothing to join
        ref, idx, val = chunks[0]
        patch.index, patch.value = (idx + ref.start if ref.start else idx), val
        return
    chunks = sorted(chunks, key=lambda c: c[0].start)
    for (a, _, _), (b, _, _) in itertools.pairwise(chunks):
        if a.start + a.count > b.start:
            raise CorruptDeltaError(f"{patch.name}: chunks overlap")
    sizes = [idx.size for _, idx, _ in chunks]
    if out is not None:
        index, value = out
    else:
        index = np.empty(total, np.int64)
        value = np.empty(total, chunks[0][2].dtype)
    ends = np.cumsum(sizes).tolist()

    def place(i: int) -> None:
        ref, idx, val = chunks[i]
        lo, hi = ends[i] - sizes[i], ends[i]
        np.add(idx, ref.start, out=index[lo:hi])
        value[lo:hi] = val

    list(pool.map(place, range(len(chunks))))
    patch.index, patch.value = index, value


def check_integrity(data: bytes | memoryview) -> dict[str, Any]:
    """Verify the trailer, the footer and every checksum (no base needed); return the footer."""
    return _verified_refs(data)[0]


def position_counts(data: bytes | memoryview) -> dict[str, int]:
    """How many chunks of a compact delta code their positions each way
    (:data:`~.compact_chunks.POSITIONS`), read from their headers after every checksum."""
    footer, refs = _verified_refs(data)
    v3 = int(footer["format_version"]) >= 3
    gaps = sum(v3 and VarintReader(r.header, r.tensor).varint() & 1 for r in refs)
    return {"contexts": len(refs) - gaps, "gaps": gaps}


def _verified_refs(data: bytes | memoryview) -> tuple[dict[str, Any], list[ChunkRef]]:
    """The footer and the chunks, after the trailer, the footer and every checksum."""
    footer = read_footer(data)
    buf = memoryview(data)
    body_end = _body_end(buf)
    try:
        _, _, index = _read_index(buf, footer, body_end)
        return footer, _chunk_refs(buf, footer, body_end, index)
    except (KeyError, TypeError) as e:
        raise CorruptDeltaError(f"deltarl-compact footer is malformed: {e}") from e


def footer_summary(data: bytes | memoryview) -> dict[str, Any]:
    """Versions, digests and per-tensor change counts of a compact delta, without decoding it."""
    f = read_footer(data)
    return {
        "format": f"{FORMAT_NAME}-v{f.get('format_version')}",
        "base_version": f.get("base_version"),
        "version": f.get("version"),
        "context": context_of(f),
        "tensors": {
            t["name"]: {"changed": t["changed"], "dtype": t["dtype"], "shape": t["shape"]}
            for t in f["tensors"]
        },
    }


__all__ = [
    "DEFAULT_CHUNK_ELEMS",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "check_context",
    "check_integrity",
    "context_of",
    "decode_compact",
    "encode_compact",
    "footer_summary",
    "is_compact",
    "position_counts",
    "read_footer",
]


_decoder_warm = threading.Event()


def warm_up_states() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Two tiny bf16 states a step apart, one tensor sparsely changed and one densely: what the
    warm-ups (here and in :mod:`.device_scan`) code to compile the kernels."""
    g = torch.Generator().manual_seed(0)
    old = {k: (torch.randn(8192, generator=g) * 0.02).to(torch.bfloat16) for k in ("a", "b")}
    new = {k: t.clone() for k, t in old.items()}
    new["a"][::97] = (old["a"][::97].float() * 1.01 + 1e-3).to(torch.bfloat16)
    new["b"][::2] = (old["b"][::2].float() * 1.05 + 1e-3).to(torch.bfloat16)
    return old, new


def warm_up_decoder() -> None:
    """Compile the numba kernels that decoding runs, both ways of coding positions, on a tiny
    delta (the first decode in a process compiles them: ~5 s on a GPU host, more than the decode
    of a 30 B-parameter version). Once per process; a rollout worker calls it when it loads an
    anchor, before it follows deltas."""
    if _decoder_warm.is_set():
        return
    old, new = warm_up_states()
    delta = compute_delta(old, new, 0, 1)
    for positions in POSITIONS:
        data = encode_compact(delta, old, threads=1, positions=positions)
        for threads in (1, 2):
            decode_compact(data, old, threads=threads)
    _decoder_warm.set()
