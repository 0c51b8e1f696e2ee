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
  a bit-length symbol plus raw low bits. Symbols are rANS-coded with frequency tables shared by the
  whole delta and selected per context by its change rate (elements in contexts that change often
  also move by more ULPs), so small tensors pay nothing for tables of their own.

Chunks of at most ``chunk_elems`` elements are analysed and coded independently on all cores
(numba kernels release the GIL), so memory stays bounded by a chunk of the model plus the delta.

Integrity: the trailer carries an xxh3-64 of the footer, the footer an xxh3-64 of every chunk, and
every tensor's base and result digest. :func:`decode_compact` refuses a wrong base before decoding
and any damaged byte with :class:`CorruptDeltaError`.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash
import zstandard

from . import kernels
from .bits import FloatFormat, bits_numpy, float_format
from .delta import Delta, TensorPatch, check_compatible, verify_base
from .errors import CorruptDeltaError, StateMismatchError

FORMAT_NAME = "deltarl-compact"
FORMAT_VERSION = 1
MAGIC = b"DRLDLT01"
TRAILER_MAGIC = b"DRLDEND1"
TRAILER = struct.Struct("<QQ8s")  # footer length, xxh3-64 of footer, end magic
DEFAULT_CHUNK_ELEMS = 1 << 24
ALPHABET = 74  # 16 small-diff symbols + 2 * 29 bit-length classes (up to 32-bit diffs)
SMALL = 8  # |diff| <= SMALL gets a symbol of its own
MAX_FOOTER = 256 << 20


def default_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


# ---------------------------------------------------------------------------------------------
# symbol mapping and models (pure numpy, shared by encoder and decoder)


def _bitlen(a: np.ndarray) -> np.ndarray:
    """Bit length of positive int64 values below 2**53 (exact through frexp)."""
    return np.frexp(a.astype(np.float64))[1].astype(np.int64)


def wrapped_diff(new: np.ndarray, old: np.ndarray, width: int) -> np.ndarray:
    """``new - old`` as signed ``width``-bit integers (int64)."""
    span = 1 << width
    d = (new.astype(np.int64) - old.astype(np.int64)) & (span - 1)
    return np.where(d >= span // 2, d - span, d)


def wrapped_add(old: np.ndarray, d: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    span = 1 << fmt.width
    v = (old.astype(np.int64) + d) & (span - 1)
    v = np.where(v >= span // 2, v - span, v)
    return v.astype(fmt.bits_dtype)


def diff_to_symbols(d: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Map non-zero diffs to (symbol, extra-bit value, extra-bit width)."""
    a = np.abs(d)
    neg = (d < 0).astype(np.int64)
    small = a <= SMALL
    length = _bitlen(np.maximum(a, 1))
    sym = np.where(small, 2 * (a - 1) + neg, 16 + 2 * (length - 4) + neg)
    width = np.where(small, 0, length - 1)
    extra = np.where(small, 0, a - (np.int64(1) << np.maximum(width, 0)))
    return sym.astype(np.int64), extra.astype(np.int64), width.astype(np.int64)


def symbol_extra_widths(sym: np.ndarray) -> np.ndarray:
    return np.where(sym < 16, 0, (sym - 16) // 2 + 3).astype(np.int64)


def symbols_to_diff(sym: np.ndarray, extra: np.ndarray) -> np.ndarray:
    neg = (sym & 1).astype(bool)
    width = symbol_extra_widths(sym)
    a = np.where(sym < 16, sym // 2 + 1, (np.int64(1) << width) + extra)
    return np.where(neg, -a, a)


def rice_parameter(n: np.ndarray, coded: np.ndarray) -> np.ndarray:
    """Near-optimal Rice parameter for ``coded`` geometric gaps among ``n`` elements.

    k = round(log2(mean_gap * ln 2)), computed in integers so encoder and decoder always agree.
    """
    n = n.astype(np.int64)
    coded = np.maximum(coded.astype(np.int64), 1)
    v = ((n - coded) * 64241) // (coded * 65536)
    return np.maximum(_bitlen(np.maximum(v, 1)) - 1, 0) * (v > 0)


def rate_bucket(n: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Half-octave bucket of the change rate k/n of a context (0 = densest); integers only."""
    r = (n.astype(np.int64) * 16) // np.maximum(k.astype(np.int64), 1)
    length = _bitlen(np.maximum(r, 16))
    half = (r >> (length - 2)) & 1
    return 2 * (length - 5) + half


def quantize_frequencies(counts: np.ndarray) -> np.ndarray:
    """Integer frequencies summing to ``PROB_SCALE``, non-zero exactly where ``counts`` is."""
    total = int(counts.sum())
    assert total > 0
    scale = kernels.PROB_SCALE
    f = np.where(counts > 0, np.maximum(1, (counts * scale) // total), 0).astype(np.int64)
    diff = scale - int(f.sum())
    order = np.argsort(-counts, kind="stable")
    i = 0
    while diff != 0:
        s = order[i % counts.size]
        if counts[s] > 0:
            if diff > 0:
                f[s] += diff
                diff = 0
            elif f[s] > 1:
                take = min(-diff, int(f[s]) - 1)
                f[s] -= take
                diff += take
        i += 1
    return f


@dataclass(slots=True)
class Tables:
    """rANS frequency tables: one row per table, ``ALPHABET`` columns."""

    freq: np.ndarray  # int32 [T, ALPHABET]
    cum: np.ndarray  # int32 [T, ALPHABET]

    @classmethod
    def from_freq(cls, freq: np.ndarray) -> Tables:
        cum = np.zeros_like(freq)
        cum[:, 1:] = np.cumsum(freq, axis=1)[:, :-1]
        return cls(freq.astype(np.int32), cum.astype(np.int32))

    def lookup(self) -> np.ndarray:
        t = self.freq.shape[0]
        out = np.zeros((t, kernels.PROB_SCALE), np.uint8)
        for i in range(t):
            out[i] = np.repeat(np.arange(ALPHABET, dtype=np.uint8), self.freq[i])
        return out


# ---------------------------------------------------------------------------------------------
# encoder


@dataclass(slots=True)
class _Analysis:
    """Everything phase A learns about one chunk; phase B turns it into bytes."""

    tensor: str
    start: int
    count: int
    ctx_pairs: list[int]  # flat [ctx, k, ctx, k, ...] for contexts with changes
    gaps: np.ndarray  # int64, Rice-coded values in context order
    kparams: np.ndarray  # int64, Rice parameter of each gap
    symbols: np.ndarray  # int64, one per changed element in index order
    buckets: np.ndarray  # int64, rate bucket of each symbol's context
    extra: np.ndarray  # int64 extra-bit values
    widths: np.ndarray  # int64 extra-bit widths


def _context_layout(fmt: FloatFormat) -> tuple[int, int]:
    """(shift, mask) extracting the exponent field from a bit pattern."""
    return fmt.mantissa_bits, fmt.exponent_mask


def _analyse(
    tensor: str, start: int, old: np.ndarray, index: np.ndarray, value: np.ndarray, fmt: FloatFormat
) -> _Analysis:
    shift, emask = _context_layout(fmt)
    nctx = emask + 1
    k = index.size
    hist = np.zeros(nctx, np.int64)
    ctx = np.empty(k, np.int64)
    rank = np.empty(k, np.int64)
    kernels.scan_contexts(old, index, shift, emask, hist, ctx, rank)
    kc = np.bincount(ctx, minlength=nctx)
    present = np.flatnonzero(kc)
    comp = 2 * kc > hist

    order = np.argsort(ctx, kind="stable")
    c_sorted, r_sorted = ctx[order], rank[order]
    keep = ~comp[c_sorted]
    c_sorted, r_sorted = c_sorted[keep], r_sorted[keep]
    gap_ctx = [c_sorted]
    gap_rank = [r_sorted]
    for c in np.flatnonzero(comp):  # rare: contexts where most elements changed
        unchanged = np.ones(int(hist[c]), bool)
        unchanged[rank[ctx == c]] = False
        gap_ctx.append(np.full(int(unchanged.sum()), c, np.int64))
        gap_rank.append(np.flatnonzero(unchanged).astype(np.int64))
    gc = np.concatenate(gap_ctx)
    gr = np.concatenate(gap_rank)
    o2 = np.argsort(gc, kind="stable")  # contexts ascending, ranks stay increasing within each
    gc, gr = gc[o2], gr[o2]
    prev = np.empty_like(gr)
    if gr.size:
        prev[0] = -1
        prev[1:] = gr[:-1]
        prev[np.flatnonzero(np.diff(gc)) + 1] = -1
    gaps = gr - prev - 1
    coded = np.where(comp, hist - kc, kc)
    kparams = rice_parameter(hist, coded)[gc]

    old_vals = old[index]
    d = wrapped_diff(value, old_vals, fmt.width)
    symbols, extra, widths = diff_to_symbols(d)
    buckets = rate_bucket(hist, kc)[ctx]
    pairs = np.stack([present, kc[present]], axis=1).reshape(-1).tolist()
    return _Analysis(tensor, start, old.size, pairs, gaps, kparams, symbols, buckets, extra, widths)


def _code(a: _Analysis, table_of_bucket: np.ndarray, tables: Tables) -> tuple[bytes, list[int]]:
    rice = np.zeros((int(kernels.rice_bits(a.gaps, a.kparams)) + 7) // 8, np.uint8)
    kernels.rice_encode(a.gaps, a.kparams, rice)
    tid = table_of_bucket[a.buckets]
    cap = 16 + 4 * a.symbols.size
    rans = np.empty(cap, np.uint8)
    pos = kernels.rans_encode(a.symbols, tid, tables.freq, tables.cum, rans)
    rans_bytes = rans[pos:]
    extra = np.zeros((int(a.widths.sum()) + 7) // 8, np.uint8)
    kernels.raw_bits_encode(a.extra, a.widths, extra)
    parts = [rice.tobytes(), rans_bytes.tobytes(), extra.tobytes()]
    return b"".join(parts), [len(p) for p in parts]


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
    base: Mapping[str, torch.Tensor],
    *,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    threads: int | None = None,
) -> bytes:
    """Serialize ``delta`` in the compact format, using ``base`` (the state at the delta's base
    version, CPU tensors) as side information."""
    check_compatible(base, delta.patches)
    threads = threads or default_threads()
    jobs = _chunks(delta.patches, chunk_elems)
    olds: dict[str, np.ndarray] = {}
    for name in {j[0] for j in jobs}:
        t = base[name]
        if t.device.type != "cpu":
            t = t.cpu()
        olds[name] = bits_numpy(t.contiguous())

    def analyse(job: tuple[str, int, int]) -> _Analysis:
        name, start, count = job
        p = delta.patches[name]
        lo, hi = np.searchsorted(p.index, [start, start + count])
        fmt = float_format(p.dtype)
        return _analyse(
            name,
            start,
            olds[name][start : start + count],
            p.index[lo:hi] - start,
            p.value[lo:hi],
            fmt,
        )

    with ThreadPoolExecutor(threads) as pool:
        analyses = list(pool.map(analyse, jobs))

        nb = 64
        counts = np.zeros((nb, ALPHABET), np.int64)
        for a in analyses:
            counts += np.bincount(
                a.buckets * ALPHABET + a.symbols, minlength=nb * ALPHABET
            ).reshape(nb, ALPHABET)
        used = np.flatnonzero(counts.sum(axis=1))
        table_of_bucket = np.full(nb, -1, np.int64)
        table_of_bucket[used] = np.arange(used.size)
        freq = (
            np.stack([quantize_frequencies(counts[b]) for b in used])
            if used.size
            else np.zeros((0, ALPHABET), np.int64)
        )
        tables = Tables.from_freq(freq)
        coded = list(pool.map(lambda a: _code(a, table_of_bucket, tables), analyses))

    out = bytearray(MAGIC)
    chunk_meta: dict[str, list[dict[str, Any]]] = {}
    for a, (blob, lengths) in zip(analyses, coded, strict=True):
        chunk_meta.setdefault(a.tensor, []).append(
            {
                "start": a.start,
                "count": a.count,
                "offset": len(out),
                "streams": lengths,
                "xxh3": xxhash.xxh3_64_intdigest(blob),
                "ctx": a.ctx_pairs,
            }
        )
        out += blob
    footer = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "base_version": delta.base_version,
        "version": delta.version,
        "prob_bits": kernels.PROB_BITS,
        "tables": {str(int(b)): _sparse_table(freq[i]) for i, b in enumerate(used)},
        "tensors": [
            {
                "name": p.name,
                "dtype": p.dtype,
                "shape": list(p.shape),
                "changed": p.changed,
                "base_digest": p.base_digest,
                "result_digest": p.result_digest,
                "chunks": chunk_meta.get(p.name, []),
            }
            for p in (delta.patches[n] for n in sorted(delta.patches))
        ],
    }
    raw = json.dumps(footer, separators=(",", ":")).encode()
    packed = zstandard.ZstdCompressor(level=19).compress(raw)
    out += packed
    out += TRAILER.pack(len(packed), xxhash.xxh3_64_intdigest(packed), TRAILER_MAGIC)
    return bytes(out)


def _sparse_table(freq: np.ndarray) -> list[int]:
    nz = np.flatnonzero(freq)
    return np.stack([nz, freq[nz]], axis=1).reshape(-1).tolist()


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
    try:
        footer = json.loads(
            zstandard.ZstdDecompressor().decompress(packed, max_output_size=MAX_FOOTER)
        )
    except (zstandard.ZstdError, ValueError) as e:
        raise CorruptDeltaError(f"deltarl-compact footer unreadable: {e}") from e
    if not isinstance(footer, dict) or footer.get("format") != FORMAT_NAME:
        raise CorruptDeltaError("deltarl-compact footer has the wrong format tag")
    if footer.get("format_version") != FORMAT_VERSION:
        raise CorruptDeltaError(
            f"unsupported deltarl-compact version {footer.get('format_version')!r}"
        )
    return footer


def _tables_from_footer(footer: dict[str, Any]) -> tuple[np.ndarray, Tables, np.ndarray]:
    if footer.get("prob_bits") != kernels.PROB_BITS:
        raise CorruptDeltaError(f"unsupported probability precision {footer.get('prob_bits')!r}")
    items = sorted((int(b), v) for b, v in footer["tables"].items())
    table_of_bucket = np.full(64, -1, np.int64)
    freq = np.zeros((len(items), ALPHABET), np.int64)
    for i, (b, pairs) in enumerate(items):
        if not 0 <= b < 64 or len(pairs) % 2:
            raise CorruptDeltaError(f"bad frequency table for bucket {b}")
        arr = np.asarray(pairs, np.int64).reshape(-1, 2)
        if arr.size and (
            arr[:, 0].min() < 0 or arr[:, 0].max() >= ALPHABET or arr[:, 1].min() <= 0
        ):
            raise CorruptDeltaError(f"bad frequency table for bucket {b}")
        freq[i, arr[:, 0]] = arr[:, 1]
        if int(freq[i].sum()) != kernels.PROB_SCALE:
            raise CorruptDeltaError(
                f"frequency table for bucket {b} does not sum to 2**{kernels.PROB_BITS}"
            )
        table_of_bucket[b] = i
    tables = Tables.from_freq(freq)
    return table_of_bucket, tables, tables.lookup()


def _decode_chunk(
    blob: memoryview,
    meta: dict[str, Any],
    old: np.ndarray,
    fmt: FloatFormat,
    table_of_bucket: np.ndarray,
    tables: Tables,
    lookup: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    shift, emask = _context_layout(fmt)
    nctx = emask + 1
    hist = np.zeros(nctx, np.int64)
    kernels.context_histogram(old, shift, emask, hist)
    pairs = np.asarray(meta["ctx"], np.int64).reshape(-1, 2)
    kc = np.zeros(nctx, np.int64)
    if pairs.size:
        c = pairs[:, 0]
        if c.min() < 0 or c.max() >= nctx or np.any(np.diff(c) <= 0) or pairs[:, 1].min() <= 0:
            raise CorruptDeltaError("chunk context table is malformed")
        kc[c] = pairs[:, 1]
    if np.any(kc > hist):
        raise CorruptDeltaError(
            "chunk claims more changes than the base has elements (wrong base?)"
        )
    comp = 2 * kc > hist
    coded = np.where(comp, hist - kc, kc)
    coded[kc == 0] = 0
    kp = rice_parameter(hist, coded)
    gap_ctx = np.repeat(np.arange(nctx), coded)
    kparams = kp[gap_ctx]
    rice_len, rans_len, extra_len = (int(x) for x in meta["streams"])
    if rice_len + rans_len + extra_len != len(blob):
        raise CorruptDeltaError("chunk stream lengths do not add up")
    raw = np.frombuffer(blob, np.uint8)
    gaps = np.empty(gap_ctx.size, np.int64)
    if kernels.rice_decode(raw[:rice_len], kparams, gaps) < 0:
        raise CorruptDeltaError("position stream ends early")
    ends = np.cumsum(coded)
    starts = ends - coded
    steps = gaps + 1
    csum = np.cumsum(steps)
    seg_base = np.where(starts > 0, csum[np.maximum(starts - 1, 0)] if csum.size else 0, 0)
    ranks = csum - 1 - np.repeat(seg_base, coded)
    if ranks.size:
        last = ranks[np.maximum(ends - 1, 0)]
        if np.any((coded > 0) & (last >= hist)):
            raise CorruptDeltaError(
                "position stream names elements beyond the tensor (wrong base?)"
            )
    k = int(kc.sum())
    index = np.empty(k, np.int64)
    ctx = np.empty(k, np.int64)
    m = kernels.select_changed(
        old, shift, emask, ranks, starts.astype(np.int64), ends.astype(np.int64), comp, index, ctx
    )
    if m != k:
        raise CorruptDeltaError(
            "positions do not decode consistently (wrong base or damaged chunk)"
        )
    bucket = rate_bucket(hist, kc)[ctx]
    tid = table_of_bucket[bucket]
    if tid.size and tid.min() < 0:
        raise CorruptDeltaError("chunk refers to a frequency table the delta does not contain")
    symbols = np.empty(k, np.int64)
    if (
        kernels.rans_decode(
            raw[rice_len : rice_len + rans_len], tid, tables.freq, tables.cum, lookup, symbols
        )
        != rans_len
    ):
        raise CorruptDeltaError("value stream is damaged")
    widths = symbol_extra_widths(symbols)
    if widths.size and widths.max() >= fmt.width:
        raise CorruptDeltaError("value stream holds a difference wider than the dtype")
    extra = np.empty(k, np.int64)
    if kernels.raw_bits_decode(raw[rice_len + rans_len :], widths, extra) < 0:
        raise CorruptDeltaError("extra-bits stream ends early")
    d = symbols_to_diff(symbols, extra)
    return index, wrapped_add(old[index], d, fmt)


def decode_compact(
    data: bytes | memoryview,
    base: Mapping[str, torch.Tensor],
    *,
    check_base: bool = True,
    base_digests: Mapping[str, str] | None = None,
    threads: int | None = None,
) -> Delta:
    """Decode a compact delta against ``base`` (CPU tensors at the delta's base version).

    With ``check_base`` (default) the base digests are verified first, so a wrong base is refused
    with :class:`BaseMismatchError` instead of decoding garbage; ``base_digests`` are trusted
    digests of ``base`` that save hashing it.
    """
    footer = read_footer(data)
    buf = memoryview(data)
    body_end = len(buf) - TRAILER.size - TRAILER.unpack(buf[len(buf) - TRAILER.size :])[0]
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
                base_digest=str(t["base_digest"]),
                result_digest=str(t["result_digest"]),
            )
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptDeltaError(f"deltarl-compact footer is malformed: {e}") from e
    delta = Delta(
        base_version=footer.get("base_version"), version=footer.get("version"), patches=patches
    )
    if check_base:
        verify_base(base, delta, base_digests)
    else:
        check_compatible(base, patches)
    table_of_bucket, tables, lookup = _tables_from_footer(footer)

    jobs = []
    for t in footer["tensors"]:
        name = t["name"]
        p = patches[name]
        pos = len(MAGIC)
        for meta in t["chunks"]:
            off, length = int(meta["offset"]), sum(int(x) for x in meta["streams"])
            start, count = int(meta["start"]), int(meta["count"])
            if (
                off < len(MAGIC)
                or off + length > body_end
                or start < 0
                or count <= 0
                or start + count > p.numel
            ):
                raise CorruptDeltaError(
                    f"{name}: chunk at byte {off} lies outside the object or the tensor"
                )
            blob = buf[off : off + length]
            if xxhash.xxh3_64_intdigest(blob) != meta["xxh3"]:
                raise CorruptDeltaError(
                    f"{name}: chunk at byte {off} is damaged (checksum mismatch)"
                )
            jobs.append((name, start, count, blob, meta))
            pos = off + length
        del pos

    olds: dict[str, np.ndarray] = {}
    for name in {j[0] for j in jobs}:
        tt = base[name]
        if tt.device.type != "cpu":
            tt = tt.cpu()
        olds[name] = bits_numpy(tt.contiguous())

    def run(job: tuple[str, int, int, memoryview, dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
        name, start, count, blob, meta = job
        fmt = float_format(patches[name].dtype)
        idx, val = _decode_chunk(
            blob, meta, olds[name][start : start + count], fmt, table_of_bucket, tables, lookup
        )
        return idx + start, val

    with ThreadPoolExecutor(threads or default_threads()) as pool:
        results = list(pool.map(run, jobs))
    parts: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for job, res in zip(jobs, results, strict=True):
        parts.setdefault(job[0], []).append(res)
    for t in footer["tensors"]:
        name = t["name"]
        if name in parts:
            p = patches[name]
            p.index = np.concatenate([i for i, _ in parts[name]])
            p.value = np.concatenate([v for _, v in parts[name]])
        if patches[name].changed != int(t["changed"]):
            raise CorruptDeltaError(
                f"{name}: decoded {patches[name].changed} changes, footer says {t['changed']}"
            )
    return delta


def check_integrity(data: bytes | memoryview) -> dict[str, Any]:
    """Verify the trailer, the footer and every chunk checksum (no base needed); return the footer."""
    footer = read_footer(data)
    buf = memoryview(data)
    body_end = len(buf) - TRAILER.size - TRAILER.unpack(buf[len(buf) - TRAILER.size :])[0]
    for t in footer["tensors"]:
        for meta in t["chunks"]:
            off, length = int(meta["offset"]), sum(int(x) for x in meta["streams"])
            if off < len(MAGIC) or off + length > body_end:
                raise CorruptDeltaError(f"{t['name']}: chunk at byte {off} lies outside the object")
            if xxhash.xxh3_64_intdigest(buf[off : off + length]) != meta["xxh3"]:
                raise CorruptDeltaError(
                    f"{t['name']}: chunk at byte {off} is damaged (checksum mismatch)"
                )
    return footer


def footer_summary(data: bytes | memoryview) -> dict[str, Any]:
    """Versions, digests and per-tensor change counts of a compact delta, without decoding it."""
    f = read_footer(data)
    return {
        "format": f"{FORMAT_NAME}-v{FORMAT_VERSION}",
        "base_version": f.get("base_version"),
        "version": f.get("version"),
        "tensors": {
            t["name"]: {"changed": t["changed"], "dtype": t["dtype"], "shape": t["shape"]}
            for t in f["tensors"]
        },
    }


__all__ = [
    "DEFAULT_CHUNK_ELEMS",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "StateMismatchError",
    "decode_compact",
    "encode_compact",
    "footer_summary",
    "is_compact",
    "read_footer",
]
