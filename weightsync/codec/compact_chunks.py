"""Per-chunk coding of the compact format: analysis, entropy coding and decoding of one chunk.

The container around the chunks (layout, footer, index, checksums, threads) is ``compact.py``;
the entropy models both sides share are ``entropy.py``; the compiled loops are ``kernels.py``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from deltarl.weightsync.codec import kernels
from deltarl.weightsync.codec.bits import FloatFormat
from deltarl.weightsync.codec.context import (
    N_MOVE_BUCKETS,
    predict,
    skip_forbidden,
)
from deltarl.weightsync.codec.entropy import (
    ALPHABET,
    SMALL,
    TOP_BITS,
    VarintReader,
    coding_cost_bits,
    cumulative,
    diff_to_symbols,
    entropy_bits,
    quantize_frequencies,
    read_table,
    rice_parameter,
    table_bytes,
    varints,
    wrapped_diff,
)
from deltarl.weightsync.errors import CorruptDeltaError


def _empty() -> np.ndarray:
    return np.zeros(0, np.int64)


@dataclass(slots=True)
class ChunkAnalysis:
    """Everything phase A learns about one chunk; phase B turns it into bytes.

    The position half: ``ctx_ids`` (int64 [C], the position contexts, old exponents, with
    changes, ascending), ``kc`` (changes per context), ``hist`` (the chunk's elements of each;
    empty by gaps), ``rice_k`` (each context's Rice parameter; by gaps the chunk's one),
    ``gaps`` (uint32, the Rice-coded values, < chunk size) and ``kparams`` (uint8, each one's
    parameter). The value half (:func:`_with_values`): ``key`` (int64 [V], value contexts with
    changes, ascending: the shared tables' keys), ``counts`` (int64 [V, ALPHABET], symbols per
    value context), ``symbols`` (uint16, one per change in index order), ``sym_ctx`` (int32,
    each symbol's row in ``key``), ``extra`` / ``widths`` (uint32 / uint8 extra bits), ``own``
    (bool [V], contexts coded with their own table)."""

    tensor: str
    start: int
    count: int
    ctx_ids: np.ndarray
    kc: np.ndarray
    hist: np.ndarray
    rice_k: np.ndarray
    gaps: np.ndarray
    kparams: np.ndarray
    chained: bool = False  # values coded against a prediction from a context delta
    by_gaps: bool = False  # positions coded as plain gaps (``POSITIONS``), not by context rank
    key: np.ndarray = field(default_factory=_empty)
    counts: np.ndarray = field(default_factory=_empty)
    symbols: np.ndarray = field(default_factory=_empty)
    sym_ctx: np.ndarray = field(default_factory=_empty)
    extra: np.ndarray = field(default_factory=_empty)
    widths: np.ndarray = field(default_factory=_empty)
    own: np.ndarray | None = None


POSITIONS = ("contexts", "gaps")
"""How a chunk codes its changed positions. ``contexts``: by rank within the old exponent's
elements, the fewest bytes (an update is visible only above half an ULP, so small exponents
change more often), but the decoder must walk every element of the chunk to turn ranks back into
positions. ``gaps``: the gaps between consecutive changed positions, one Rice parameter per
chunk; ~1.5x the bytes on a real dense model's deltas, and a decoder that reads only
the changed elements of the base."""


def context_layout(fmt: FloatFormat) -> tuple[int, int]:
    """(shift, mask) extracting the exponent field from a bit pattern."""
    return fmt.mantissa_bits, fmt.exponent_mask


def position_contexts(
    old: np.ndarray, fmt: FloatFormat, prediction: Prediction | None
) -> tuple[np.ndarray, int, int]:
    """``(keys, shift, mask)`` such that ``(keys >> shift) & mask`` is each element's position
    context: its old exponent, and in a chained chunk also whether the context delta moved it
    (``2 exponent + moved``), which makes a change likelier."""
    shift, emask = context_layout(fmt)
    if prediction is None:
        return old, shift, emask
    keys = np.empty(old.size, np.int16 if emask < 1 << 14 else np.int32)
    kernels.moved_keys(old, shift, emask, prediction.index, keys)
    return keys, 0, (emask << 1) | 1


def value_residuals(
    old: np.ndarray,
    index: np.ndarray,
    ctx: np.ndarray,
    fmt: FloatFormat,
    prev: Prediction | None,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """What the values are coded against: ``(reference bits, forbidden residual, value context)``
    per changed element. Standalone: the old value, no forbidden residual (None), the old
    exponent. Chained: the prediction from the context delta, the residual of "unchanged", and
    ``exponent * N_MOVE_BUCKETS + move bucket`` (``ctx`` holds ``2 exponent + moved``)."""
    if prev is None:
        return old[index], None, ctx
    ref, forbidden, buckets = predict(old, index, prev.index, prev.before, fmt, prev.rho16)
    return ref, forbidden, (ctx >> 1) * N_MOVE_BUCKETS + buckets


@dataclass(frozen=True, slots=True)
class Prediction:
    """A chunk's slice of a :class:`~.context.DeltaContext` and the extrapolation factor."""

    index: np.ndarray  # chunk-local sorted indices the context delta changed
    before: np.ndarray  # their bit patterns before it
    rho16: int


@dataclass(frozen=True, slots=True)
class ChunkScan:
    """What :func:`~.kernels.scan_contexts` finds in one chunk, computed where the weights live
    (:func:`~.device_scan.changes_and_scans`: on a GPU, so only O(changed) data reaches the
    host). With it :func:`analyse_chunk` reads no base element but the changed ones."""

    count: int  # elements in the chunk
    # int64 [contexts]: the chunk's elements per position context (None: a scan for positions
    # coded as gaps, which need neither this nor the ranks)
    hist: np.ndarray | None
    ctx: np.ndarray  # integer [k] (int16 from the device): each change's context, index order
    # integer [k] (int32): its rank among the chunk's earlier elements of its context (None
    # with ``hist``)
    rank: np.ndarray | None
    old: np.ndarray  # [k]: the changed elements' bit patterns at the base


def analyse_chunk(
    tensor: str,
    start: int,
    old: np.ndarray | None,
    index: np.ndarray,
    value: np.ndarray,
    fmt: FloatFormat,
    prediction: Prediction | None = None,
    scan: ChunkScan | None = None,
    positions: str = "contexts",
) -> ChunkAnalysis:
    """Phase A for one chunk: ``old`` (the chunk's base bit patterns), ``index`` (chunk-local,
    increasing) and ``value`` (new bit patterns) of its changed elements. With ``scan`` (a
    standalone delta only) ``old`` is not read and may be None. ``positions``: one of
    :data:`POSITIONS`."""
    if positions == "gaps":
        return _analyse_by_gaps(tensor, start, old, index, value, fmt, prediction, scan)
    if positions != "contexts":
        raise ValueError(f"positions must be one of {POSITIONS}, not {positions!r}")
    if scan is not None:
        hist, ctx, rank, ref, count = _checked_scan(scan, index, value, fmt, prediction)
        assert hist is not None and rank is not None  # need_ranks: checked there
        nctx = hist.size
    else:
        if old is None:
            raise ValueError("analyse_chunk needs the chunk's base elements or its scan")
        keys, shift, emask = position_contexts(old, fmt, prediction)
        nctx = emask + 1
        real = value != old[index]  # a composed delta may hold elements that changed back
        if not bool(real.all()):
            index, value = index[real], value[real]
        k = index.size
        hist = np.zeros(nctx, np.int64)
        ctx = np.empty(k, np.int64)
        rank = np.empty(k, np.int64)
        kernels.scan_contexts(keys, index, shift, emask, hist, ctx, rank)
        count, ref = old.size, None
    kc_all = kernels.count_values(ctx, nctx)
    present = np.flatnonzero(kc_all)
    comp = 2 * kc_all > hist

    coded = np.where(comp, hist - kc_all, kc_all)
    gaps = np.empty(int(coded.sum()), np.uint32)  # < chunk size
    kparams = np.empty(gaps.size, np.uint8)
    kparam_of_ctx = rice_parameter(hist, coded).astype(np.uint8)
    kernels.position_gaps(ctx, rank, hist, kc_all, comp, kparam_of_ctx, gaps, kparams)

    if ref is None:
        assert old is not None
        ref, forbidden, vctx = value_residuals(old, index, ctx, fmt, prediction)
    else:
        forbidden, vctx = None, ctx
    return _with_values(
        ChunkAnalysis(
            tensor=tensor,
            start=start,
            count=count,
            ctx_ids=present,
            kc=kc_all[present],
            hist=hist[present],
            rice_k=kparam_of_ctx[present].astype(np.int64),
            # compact dtypes: this is held for every changed element until the chunk is coded
            gaps=gaps,
            kparams=kparams,
            chained=prediction is not None,
        ),
        value,
        ref,
        forbidden,
        vctx,
        ctx,
        present,
        fmt,
    )


def _analyse_by_gaps(
    tensor: str,
    start: int,
    old: np.ndarray | None,
    index: np.ndarray,
    value: np.ndarray,
    fmt: FloatFormat,
    prediction: Prediction | None,
    scan: ChunkScan | None,
) -> ChunkAnalysis:
    """:func:`analyse_chunk` for positions coded as gaps: reads only the changed elements of the
    base. The contexts listed in the header are the old exponents (value contexts standalone),
    with their change counts, which the decoder checks against its base."""
    shift, emask = context_layout(fmt)
    if scan is not None:
        _, ctx, _, ref, count = _checked_scan(scan, index, value, fmt, prediction, need_ranks=False)
        ctx = ctx.astype(np.int64)
        forbidden, vctx = None, ctx
    else:
        if old is None:
            raise ValueError("analyse_chunk needs the chunk's base elements or its scan")
        real = value != old[index]  # a composed delta may hold elements that changed back
        if not bool(real.all()):
            index, value = index[real], value[real]
        ctx = (old[index].astype(np.int64) >> shift) & emask
        count = old.size
        # value_residuals takes chained contexts as 2 exponent + moved and uses the exponent
        ref, forbidden, vctx = value_residuals(
            old, index, 2 * ctx if prediction else ctx, fmt, prediction
        )
    kc_all = kernels.count_values(ctx, emask + 1)
    present = np.flatnonzero(kc_all)
    gaps = np.empty(index.size, np.uint32)  # < chunk size
    kernels.index_gaps(index, gaps)
    rice = _best_rice(gaps, count)
    return _with_values(
        _by_gaps(tensor, start, count, kc_all, rice, gaps, chained=prediction is not None),
        value,
        ref,
        forbidden,
        vctx,
        ctx,
        present,
        fmt,
    )


def analyse_scan_by_gaps(
    tensor: str,
    start: int,
    index: np.ndarray,
    value: np.ndarray,
    fmt: FloatFormat,
    scan: ChunkScan,
) -> ChunkAnalysis:
    """:func:`analyse_chunk` of a standalone chunk coded by gaps from its ``scan``, in one
    compiled call (:func:`~.kernels.analyse_gap_scan`): the same analysis and the same checks.
    ``index``: the changes' indices in the tensor (not the chunk), increasing."""
    _, emask = context_layout(fmt)
    k = index.size
    _check_scan_lists(scan, fmt, k, need_ranks=False)
    k0 = _rice_guess(scan.count, k)
    k_lo = max(0, k0 - 2)
    status, gaps, rice, kc_all, symbols, extra, widths, rows, counts = kernels.analyse_gap_scan(
        index,
        start,
        scan.count,
        value,
        scan.ctx,
        scan.old,
        emask,
        fmt.width,
        TOP_BITS,
        SMALL,
        ALPHABET,
        k_lo,
        min(MAX_RICE, k0 + 3) - k_lo,
    )
    if status == -1:
        raise ValueError(
            "scan does not fit the delta: an index past the chunk or an unchanged value"
        )
    if status == -2:
        raise ValueError(f"scan contexts outside [0, {emask}]")
    a = _by_gaps(tensor, start, scan.count, kc_all, int(rice), gaps, chained=False)
    a.key, a.counts, a.symbols, a.sym_ctx = a.ctx_ids, counts, symbols, rows
    a.extra, a.widths = extra, widths
    return a


def _by_gaps(
    tensor: str,
    start: int,
    count: int,
    kc_all: np.ndarray,
    rice: int,
    gaps: np.ndarray,
    *,
    chained: bool,
) -> ChunkAnalysis:
    """The position half of a chunk coded by gaps: the contexts with changes (``kc_all``,
    changes per context), its one Rice parameter and its gaps."""
    present = np.flatnonzero(kc_all)
    return ChunkAnalysis(
        tensor=tensor,
        start=start,
        count=count,
        ctx_ids=present,
        kc=kc_all[present],
        hist=np.zeros(0, np.int64),
        rice_k=np.array([rice], np.int64),
        gaps=gaps,
        kparams=_empty(),  # every gap takes rice_k[0]
        chained=chained,
        by_gaps=True,
    )


def _rice_guess(count: int, changes: int) -> int:
    """:func:`~.entropy.rice_parameter` of one context, in Python integers."""
    coded = max(changes, 1)
    v = ((count - coded) * 64241) // (coded * 65536)
    return max(v.bit_length() - 1, 0) if v > 0 else 0


def _best_rice(gaps: np.ndarray, count: int) -> int:
    """The Rice parameter that codes ``gaps`` in the fewest bits, searched around the one a
    geometric distribution of their mean would have."""
    k0 = _rice_guess(count, gaps.size)
    k_lo = max(0, k0 - 2)
    costs = np.empty(min(MAX_RICE, k0 + 3) - k_lo, np.int64)
    kernels.rice_costs(gaps, k_lo, costs)
    return k_lo + int(np.argmin(costs))


def _with_values(
    a: ChunkAnalysis,
    value: np.ndarray,
    ref: np.ndarray,
    forbidden: np.ndarray | None,
    vctx: np.ndarray,
    ctx: np.ndarray,
    present: np.ndarray,
    fmt: FloatFormat,
) -> ChunkAnalysis:
    """Fill in ``a``'s value half: the value contexts, symbols and their counts of the changed
    elements ``value`` coded against ``ref`` (and ``forbidden``, chained)."""
    # value contexts present, ascending (standalone they are the position contexts: each change
    # is one symbol of its own context), and each symbol's row among them
    vkeys = present if vctx is ctx else np.flatnonzero(np.bincount(vctx, minlength=1))
    pos_of_key = np.zeros(int(vkeys[-1]) + 1 if vkeys.size else 1, np.int32)
    pos_of_key[vkeys] = np.arange(vkeys.size, dtype=np.int32)
    if forbidden is None:  # standalone: diff, symbols, rows and counts in one compiled pass
        k = value.size
        symbols = np.empty(k, np.uint16)
        extra = np.empty(k, np.uint32)
        widths = np.empty(k, np.uint8)
        sym_ctx = np.empty(k, np.int32)
        counts = np.zeros((vkeys.size, ALPHABET), np.int64)
        kernels.value_symbols(
            value,
            ref,
            fmt.width,
            vctx,
            pos_of_key,
            TOP_BITS,
            SMALL,
            symbols,
            extra,
            widths,
            sym_ctx,
            counts,
        )
    else:
        sym_ctx = pos_of_key[vctx]
        d = skip_forbidden(wrapped_diff(value, ref, fmt.width), forbidden)
        symbols, extra, widths = diff_to_symbols(d)
        counts = np.bincount(
            sym_ctx.astype(np.int64) * ALPHABET + symbols, minlength=vkeys.size * ALPHABET
        )
    a.key = vkeys
    a.counts = counts.reshape(vkeys.size, ALPHABET)
    # compact dtypes: this is held for every changed element until the chunk is coded
    a.symbols = symbols.astype(np.uint16, copy=False)
    a.sym_ctx = sym_ctx
    a.extra = extra.astype(np.uint32, copy=False)
    a.widths = widths.astype(np.uint8, copy=False)
    return a


def _check_scan_lists(scan: ChunkScan, fmt: FloatFormat, k: int, *, need_ranks: bool) -> None:
    """The scan's histogram (where it has one: positions by context rank need it) fits a chunk
    of its size, and it lists ``k`` changes."""
    _, emask = context_layout(fmt)
    if scan.hist is None or scan.rank is None:
        if need_ranks or (scan.hist is None) != (scan.rank is None):
            raise ValueError(
                "scan has no context ranks (made for positions coded as gaps): positions by "
                "context rank need them"
            )
    elif scan.hist.shape != (emask + 1,) or int(scan.hist.sum()) != scan.count:
        raise ValueError(f"scan histogram does not fit a chunk of {scan.count} {fmt.name} elements")
    ranks_fit = scan.rank is None or scan.rank.shape == (k,)
    if scan.ctx.shape != (k,) or not ranks_fit or scan.old.shape != (k,):
        raise ValueError(f"scan lists {scan.ctx.size} changed elements, the delta {k}")


def _checked_scan(
    scan: ChunkScan,
    index: np.ndarray,
    value: np.ndarray,
    fmt: FloatFormat,
    prediction: Prediction | None,
    need_ranks: bool = True,
) -> tuple[np.ndarray | None, np.ndarray, np.ndarray | None, np.ndarray, int]:
    """``(hist, ctx, rank, old values, count)`` of a precomputed scan, after checking that it
    fits the chunk (a wrong scan would code wrong positions without any error); ``hist`` and
    ``rank`` may be None unless ``need_ranks``."""
    if prediction is not None:
        raise ValueError(
            "a precomputed scan is for standalone deltas (a chained one needs the base)"
        )
    _, emask = context_layout(fmt)
    k = index.size
    _check_scan_lists(scan, fmt, k, need_ranks=need_ranks)
    if k and (int(index[-1]) >= scan.count or bool((value == scan.old).any())):
        raise ValueError(
            "scan does not fit the delta: an index past the chunk or an unchanged value"
        )
    # the kernels take the scan's narrow dtypes as they are (int16 contexts, int32 ranks) and
    # index with the contexts unchecked: they must lie in [0, emask]
    ctx = np.ascontiguousarray(scan.ctx)
    rank = None if scan.rank is None else np.ascontiguousarray(scan.rank)
    if k and (int(ctx.min()) < 0 or int(ctx.max()) > emask):
        raise ValueError(f"scan contexts outside [0, {emask}]")
    hist = None if scan.hist is None else np.ascontiguousarray(scan.hist, np.int64)
    return hist, ctx, rank, scan.old, scan.count


MAX_RICE = 40  # a Rice parameter above this names gaps no chunk holds (a malformed header)
N_KEYS = 256  # shared tables are keyed by the old exponent (8 bits at most)
N_KEYS_CHAINED = N_KEYS * N_MOVE_BUCKETS  # chained: (old exponent, previous move)


def n_keys(chained: bool) -> int:
    return N_KEYS_CHAINED if chained else N_KEYS


TABLE_COST_BITS = (8, 18)  # ~bits of a serialized table: fixed + per non-zero symbol


def shared_tables(
    analyses: list[ChunkAnalysis], use_own: bool, chained: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Quantized shared tables of the value contexts, from all chunks that use them (the same
    exponent behaves alike across tensors: its ULP is the same size).

    Neighbouring exponents of the same move bucket share one table where that is cheaper,
    the table's own size included (:func:`cluster_keys`).

    Returns ``(table_of_key [n_keys(chained)], freq [S, ALPHABET])``.
    """
    nk = n_keys(chained)
    counts = np.zeros((nk, ALPHABET), np.int64)
    for a in analyses:
        sel = ~a.own if (use_own and a.own is not None) else np.ones(a.key.size, bool)
        counts[a.key[sel]] += a.counts[sel]  # a chunk's value contexts are distinct
    families = N_MOVE_BUCKETS if chained else 1
    table_of_key = np.full(nk, -1, np.int64)
    pooled: list[np.ndarray] = []
    for fam in range(families):
        keys = np.arange(fam, nk, families)
        keys = keys[counts[keys].sum(axis=1) > 0]
        for seg in cluster_keys(counts[keys]):
            table_of_key[keys[seg]] = len(pooled)
            pooled.append(counts[keys[seg]].sum(axis=0))
    freq = np.zeros((len(pooled), ALPHABET), np.int64)
    for i, c in enumerate(pooled):
        freq[i] = quantize_frequencies(c)
    return table_of_key, freq


def cluster_keys(counts: np.ndarray) -> list[slice]:
    """Split consecutive rows of ``counts`` into runs that share a table, minimizing the coded
    size (empirical entropy of each run's pooled counts plus its table's cost): an exact
    dynamic program over run boundaries, with runs of at most 32 rows."""
    n = counts.shape[0]
    if n == 0:
        return []
    prefix = np.zeros((n + 1, counts.shape[1]), np.int64)
    np.cumsum(counts, axis=0, out=prefix[1:])
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    cut = np.zeros(n + 1, np.int64)
    fixed, per_symbol = TABLE_COST_BITS
    for j in range(1, n + 1):
        i0 = max(0, j - 32)
        pooled = prefix[j] - prefix[i0:j]  # runs [i, j) for i in i0..j-1
        cost = entropy_bits(pooled) + fixed + per_symbol * (pooled > 0).sum(axis=1)
        total = best[i0:j] + cost
        i = int(np.argmin(total))
        best[j], cut[j] = total[i], i0 + i
    runs: list[slice] = []
    j = n
    while j > 0:
        runs.append(slice(int(cut[j]), j))
        j = int(cut[j])
    return runs[::-1]


OWN_TABLE_MIN = 16384


def choose_own_tables(a: ChunkAnalysis, table_of_key: np.ndarray, shared: np.ndarray) -> None:
    """Give a context its own table where that costs fewer bits, table included (MDL).

    Chunks with fewer than ``OWN_TABLE_MIN`` changes are not considered: their tables would
    not pay for themselves, and the check costs time per chunk."""
    if a.key.size == 0 or a.symbols.size < OWN_TABLE_MIN:
        a.own = np.zeros(a.key.size, bool)
        return
    shared_cost = coding_cost_bits(a.counts, shared[table_of_key[a.key]])
    nnz = (a.counts > 0).sum(axis=1)
    n = a.counts.sum(axis=1)
    own_cost = entropy_bits(a.counts) + 8 * (1 + 2 * nnz) + 0.002 * n * kernels.PROB_BITS
    a.own = own_cost < shared_cost


def code_chunk(
    a: ChunkAnalysis,
    table_of_key: np.ndarray,
    shared: np.ndarray,
    shared32: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[bytes, bytes | memoryview, list[int]]:
    """Code one chunk: returns (header bytes, body bytes, [rice, rans, extra] body lengths).
    ``shared32``: ``shared`` as int32 and its cumulative frequencies, made once per delta (else
    per chunk).

    The header starts with ``2 C + by_gaps`` (``C`` contexts listed). By context rank, it lists
    the position contexts with changes as varints ``(context gap, 2 k + own, 2 rice +
    complement[, elements of the context in the chunk if complement])`` (``rice``: the Rice
    parameter of its gaps; ``complement``: its gaps name the unchanged elements, because more
    than half changed). By gaps, the chunk's one Rice parameter, then the old exponents with
    changes as ``(context gap, 2 k + own)``. The chunk's own frequency tables follow; headers of
    all chunks are compressed together. Standalone, value contexts are the old exponents, so
    ``own`` flags them; a chained chunk has more value contexts: its ``own`` bits are 0 and a
    list ``(count, value-context gaps...)`` of those with their own table precedes the tables.
    (Format version 2 headers start with ``C``: every chunk by context rank. Version 1 headers
    had neither ``rice`` nor ``complement``: its decoder derived both from the context's element
    count, counted from the base in a pass of its own.)
    """
    assert a.own is not None
    own_pos = np.flatnonzero(a.own)
    own_freq = (
        np.stack([quantize_frequencies(a.counts[i]) for i in own_pos])
        if own_pos.size
        else np.zeros((0, ALPHABET), np.int64)
    )
    header = [2 * int(a.ctx_ids.size) + int(a.by_gaps)]
    prev = -1
    own_flags = a.own.tolist() if not a.chained else [False] * a.ctx_ids.size
    if a.by_gaps:
        header.append(int(a.rice_k[0]))
        for c, kcount, own in zip(a.ctx_ids.tolist(), a.kc.tolist(), own_flags, strict=True):
            header += [c - prev - 1, 2 * kcount + int(own)]
            prev = c
    else:
        for c, kcount, n, rice, own in zip(
            a.ctx_ids.tolist(),
            a.kc.tolist(),
            a.hist.tolist(),
            a.rice_k.tolist(),
            own_flags,
            strict=True,
        ):
            comp = 2 * kcount > n
            header += [c - prev - 1, 2 * kcount + int(own), 2 * rice + int(comp)]
            if comp:
                header.append(n)
            prev = c
    if a.chained:
        header.append(int(own_pos.size))
        prev = -1
        for key in a.key[own_pos].tolist():
            header.append(key - prev - 1)
            prev = key
    head = varints(header) + b"".join(table_bytes(f) for f in own_freq)

    if own_pos.size or shared32 is None:
        freq = np.concatenate([shared, own_freq]).astype(np.int32)
        cum = cumulative(freq)
    else:
        freq, cum = shared32
    ctx_table = table_of_key[a.key]
    ctx_table[own_pos] = shared.shape[0] + np.arange(own_pos.size)
    if a.by_gaps:  # one compiled call: one GIL hand-off
        body, *lengths = kernels.code_gap_body(
            a.gaps, int(a.rice_k[0]), a.symbols, a.sym_ctx, ctx_table, freq, cum, a.extra, a.widths
        )
        return head, body.data, [int(n) for n in lengths]

    rice = np.zeros((int(kernels.rice_bits(a.gaps, a.kparams)) + 7) // 8, np.uint8)
    kernels.rice_encode(a.gaps, a.kparams, rice)

    rans = np.empty(16 + 4 * a.symbols.size, np.uint8)
    pos = kernels.rans_encode(a.symbols, a.sym_ctx, ctx_table, freq, cum, rans)
    extra = np.zeros((int(a.widths.sum()) + 7) // 8, np.uint8)
    kernels.raw_bits_encode(a.extra, a.widths, extra)
    parts = [rice.tobytes(), rans[pos:].tobytes(), extra.tobytes()]
    return head, b"".join(parts), [len(p) for p in parts]


_ContextList = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


@dataclass(slots=True)
class ChunkRef:
    tensor: str
    start: int
    count: int
    header: bytes
    body: memoryview
    streams: tuple[int, int, int]  # rice, rans, extra bytes
    offset: int = 0  # of the body in the object


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    """A chunk header, read (:func:`read_header`)."""

    by_gaps: bool
    rice_k: int  # by gaps: the chunk's Rice parameter
    contexts: _ContextList  # (ids, changes, own, rice, complement, elements): _read_contexts
    own_keys: np.ndarray  # value contexts with a table of their own
    own_freq: np.ndarray  # [own, ALPHABET] those tables
    changes: int = field(init=False)  # of the chunk: the contexts' changes summed

    def __post_init__(self) -> None:
        object.__setattr__(self, "changes", int(self.contexts[1].sum()))


def read_header(ref: ChunkRef, fmt: FloatFormat, chained: bool, version: int) -> ChunkHeader:
    """``ref``'s header, checked: :class:`CorruptDeltaError` if it is malformed or claims more
    changes than the chunk has elements."""
    _, emask = context_layout(fmt)
    n_exp = emask + 1
    if version >= 3 and not chained:
        fast = _read_gap_header(ref, n_exp)
        if fast is not None:
            return fast
    r = VarintReader(ref.header, f"{ref.tensor}: chunk header")
    first = r.varint()
    by_gaps = version >= 3 and bool(first & 1)
    n_present = first >> 1 if version >= 3 else first
    rice_k = 0
    if by_gaps:
        rice_k = r.varint()
        if rice_k > MAX_RICE or n_present > n_exp:
            raise CorruptDeltaError(f"{ref.tensor}: chunk header is malformed")
        head = _read_contexts(r, ref.tensor, n_present, n_exp, with_rice=False)
    else:
        nctx = 2 * n_exp if chained else n_exp  # chained: 2 exponent + moved
        if n_present > nctx:
            raise CorruptDeltaError(f"{ref.tensor}: chunk header lists {n_present} contexts")
        head = _read_contexts(r, ref.tensor, n_present, nctx, with_rice=version >= 2)
    ctx_ids, kc_present, own = head[0], head[1], head[2]
    own_keys = ctx_ids[own]
    if chained:
        if own.any():
            raise CorruptDeltaError(f"{ref.tensor}: chained chunk header is malformed")
        n_own = r.varint()
        if n_own > N_KEYS_CHAINED:
            raise CorruptDeltaError(f"{ref.tensor}: chunk header lists {n_own} own tables")
        own_keys = np.empty(n_own, np.int64)
        key = -1
        for i in range(n_own):
            key += r.varint() + 1
            if key >= n_exp * N_MOVE_BUCKETS:
                raise CorruptDeltaError(f"{ref.tensor}: chunk header is malformed")
            own_keys[i] = key
    n_own = int(own_keys.size)
    own_freq = (
        np.stack([read_table(r) for _ in range(n_own)])
        if n_own
        else np.zeros((0, ALPHABET), np.int64)
    )
    r.done()
    if int(kc_present.sum()) > ref.count:
        raise CorruptDeltaError(f"{ref.tensor}: chunk claims more changes than it has elements")
    return ChunkHeader(by_gaps, rice_k, head, own_keys, own_freq)


def _read_gap_header(ref: ChunkRef, n_exp: int) -> ChunkHeader | None:
    """A standalone chunk header coded by gaps, read in one compiled call
    (:func:`~.kernels.read_gap_header`, the same checks and errors as the reader in Python);
    None if the chunk codes its positions by context rank."""
    buf = np.frombuffer(ref.header, np.uint8)
    status, detail, rice, ids, changes, own, tables = kernels.read_gap_header(
        buf, n_exp, ALPHABET, MAX_RICE
    )
    what = f"{ref.tensor}: chunk header"
    if status == 1:
        return None
    if status < 0:
        raise CorruptDeltaError(
            {
                -1: f"{what} ends early or holds a malformed number",
                -2: f"{what} is malformed",
                -3: f"{what}: frequency table with {detail} symbols",
                -4: f"{what}: frequency table entry out of range",
                -5: f"{what}: frequency table does not sum to 2**{kernels.PROB_BITS}",
                -6: f"{what} has {detail} unexpected bytes",
            }[int(status)]
        )
    if int(changes.sum()) > ref.count:
        raise CorruptDeltaError(f"{ref.tensor}: chunk claims more changes than it has elements")
    zeros = np.zeros(ids.size, np.int64)
    head = (ids, changes, own, zeros, zeros.astype(bool), zeros)
    return ChunkHeader(True, int(rice), head, ids[own], tables)


def decode_chunk(
    ref: ChunkRef,
    old: np.ndarray,
    fmt: FloatFormat,
    table_of_key: np.ndarray,
    shared: np.ndarray,
    prediction: Prediction | None = None,
    version: int = 3,
    header: ChunkHeader | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Decode one chunk against ``old`` (its base elements): ``(chunk-local indices, new bit
    patterns)`` of its changed elements. ``version``: the object's format version (1: the
    header holds no element counts, they are counted from the base; 1 and 2: every chunk is
    coded by context rank). ``header``: the chunk's, if already read."""
    _, emask = context_layout(fmt)
    n_exp = emask + 1
    rice_len, rans_len, _ = ref.streams
    raw = np.frombuffer(ref.body, np.uint8)
    if old.size != ref.count:
        raise ValueError(f"{ref.tensor}: a chunk of {ref.count} elements, a base of {old.size}")
    h = header if header is not None else read_header(ref, fmt, prediction is not None, version)
    nv = n_exp * N_MOVE_BUCKETS if prediction is not None else n_exp
    ctx_table = np.full(nv, -1, np.int64)
    ctx_table[:] = table_of_key[:nv]
    ctx_table[h.own_keys] = shared.shape[0] + np.arange(h.own_keys.size)
    freq = np.concatenate([shared, h.own_freq]).astype(np.int32)
    cum = cumulative(freq)
    owner = kernels.rans_owners(freq, cum)
    rans = raw[rice_len : rice_len + rans_len]
    extra = raw[rice_len + rans_len :]
    if h.by_gaps and prediction is None:  # positions and values in one compiled pass
        shift, _ = context_layout(fmt)
        index = np.empty(h.changes, np.int64)
        values = np.empty(index.size, fmt.bits_dtype)
        expected = np.zeros(n_exp, np.int64)
        expected[h.contexts[0]] = h.contexts[1]
        status = kernels.decode_gap_chunk(
            raw[:rice_len],
            h.rice_k,
            old,
            shift,
            emask,
            expected,
            ctx_table,
            freq,
            cum,
            owner,
            rans,
            extra,
            fmt.width,
            TOP_BITS,
            SMALL,
            index,
            values,
            0,
        )
        if status < 0:
            raise CorruptDeltaError(f"{ref.tensor}: {_CHUNK_ERRORS[status]}")
        return index, values
    if h.by_gaps:
        index, ctx, old_at = _positions_by_gaps(
            ref, raw[:rice_len], old, fmt, h.rice_k, h.contexts[0], h.contexts[1]
        )
    else:
        keys, shift, kmask = position_contexts(old, fmt, prediction)
        index, ctx, old_at = _positions_by_rank(
            ref, raw[:rice_len], old, keys, shift, kmask, h.contexts, version
        )
    k = index.size
    values = np.empty(k, fmt.bits_dtype)
    if prediction is None:  # tables, symbols and values in one compiled call
        status = kernels.decode_standalone_values(
            ctx,
            old_at,
            ctx_table,
            freq,
            cum,
            owner,
            rans,
            extra,
            fmt.width,
            TOP_BITS,
            SMALL,
            values,
        )
        if status < 0:
            raise CorruptDeltaError(f"{ref.tensor}: {_CHUNK_ERRORS[status]}")
        return index, values
    # chained: value_residuals takes position contexts as 2 exponent + moved
    ref_bits, forbidden, vctx = value_residuals(
        old, index, 2 * ctx if h.by_gaps else ctx, fmt, prediction
    )
    tid = ctx_table[vctx]
    if tid.size and tid.min() < 0:
        raise CorruptDeltaError(f"{ref.tensor}: {_CHUNK_ERRORS[-4]}")
    symbols = np.empty(k, np.int64)
    if kernels.rans_decode(rans, tid, freq, cum, owner, symbols) != rans_len:
        raise CorruptDeltaError(f"{ref.tensor}: {_CHUNK_ERRORS[-5]}")
    used = kernels.decode_values(
        symbols, extra, ref_bits, forbidden, True, fmt.width, TOP_BITS, SMALL, values
    )
    if used < 0:
        raise CorruptDeltaError(f"{ref.tensor}: {_CHUNK_ERRORS[-7 if used == -2 else -6]}")
    return index, values


_CHUNK_ERRORS = {
    -1: "position stream ends early",
    -2: "positions name elements beyond the tensor (damaged chunk)",
    -3: "positions do not decode consistently (wrong base or damaged chunk)",
    -4: "chunk refers to a frequency table the delta does not hold",
    -5: "value stream is damaged",
    -6: "extra-bits stream ends early",
    -7: "value stream holds a difference wider than the dtype",
}


@dataclass
class GapPlan:
    """Every standalone chunk coded by gaps of the tensors of one float format in an object,
    laid out for :func:`~.kernels.decode_gap_batch` (see there for ``meta``), with the tensors'
    output arrays (``results``) that the batches fill. ``keep``: the arrays whose addresses
    ``meta`` holds."""

    fmt: FloatFormat
    meta: np.ndarray
    expected: np.ndarray
    ctx_tables: np.ndarray
    freq: np.ndarray
    cum: np.ndarray
    owner: np.ndarray
    refs: list[ChunkRef]
    results: dict[str, tuple[np.ndarray, np.ndarray]]
    keep: list[np.ndarray]

    def batches(self, n: int) -> list[tuple[int, int]]:
        """The chunks cut into at most ``n`` runs ``(lo, hi)`` of about as many changes."""
        total = np.cumsum(self.meta[:, 7]) if len(self.refs) else np.zeros(0, np.int64)
        if not total.size:
            return []
        cuts = np.searchsorted(total, total[-1] * np.arange(1, n) / n, side="right")
        bounds = sorted({0, *cuts.tolist(), len(self.refs)})
        return list(itertools.pairwise(bounds))


def plan_gap_chunks(
    tensors: Mapping[str, list[tuple[ChunkRef, ChunkHeader]]],
    fmt: FloatFormat,
    olds: Mapping[str, np.ndarray],
    outs: Mapping[str, tuple[np.ndarray, np.ndarray]],
    table_of_key: np.ndarray,
    shared: np.ndarray,
) -> GapPlan:
    """A :class:`GapPlan` of ``tensors`` (each with every chunk standalone and coded by gaps,
    their headers read): chunks in element order, refused if they overlap; outputs from
    ``outs`` where given (as many changes as the footer says, checked against the headers),
    else allocated; each chunk's own tables after the shared ones."""
    _, emask = context_layout(fmt)
    n_exp = emask + 1
    rows: list[tuple[ChunkRef, ChunkHeader, int, int, int]] = []  # + base, index, value address
    results: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    keep: list[np.ndarray] = []
    for name, chunks in tensors.items():
        chunks = sorted(chunks, key=lambda c: c[0].start)
        for (a, _), (b, _) in itertools.pairwise(chunks):
            if a.start + a.count > b.start:
                raise CorruptDeltaError(f"{name}: chunks overlap")
        old = np.ascontiguousarray(olds[name]).reshape(-1)
        last = chunks[-1][0]
        if last.start + last.count > old.size:
            raise CorruptDeltaError(f"{name}: a chunk lies past the tensor's {old.size} elements")
        total = sum(h.changes for _, h in chunks)
        if name in outs:
            index, values = outs[name]
            if index.size != total:
                raise CorruptDeltaError(
                    f"{name}: chunk headers list {total} changes, the footer says {index.size}"
                )
        else:
            index = np.empty(total, np.int64)
            values = np.empty(total, fmt.bits_dtype)
        if not (index.flags.c_contiguous and values.flags.c_contiguous):
            raise ValueError(f"{name}: output arrays must be contiguous")
        if values.dtype != old.dtype:
            raise ValueError(f"{name}: values of {values.dtype} for a base of {old.dtype}")
        results[name] = (index, values)
        keep += [old, index, values]
        at, size = 0, old.itemsize
        for r, h in chunks:
            rows.append(
                (
                    r,
                    h,
                    old.ctypes.data + r.start * size,
                    index.ctypes.data + at * 8,
                    values.ctypes.data + at * size,
                )
            )
            at += h.changes
    n = len(rows)
    expected = np.zeros((n, n_exp), np.int64)
    ctx_tables = np.empty((n, n_exp), np.int64)
    ctx_tables[:] = table_of_key[:n_exp]
    tables, first_own = [shared], shared.shape[0]
    for j, (_, h, _, _, _) in enumerate(rows):
        expected[j, h.contexts[0]] = h.contexts[1]
        ctx_tables[j, h.own_keys] = first_own + np.arange(h.own_keys.size)
        first_own += h.own_keys.size
        tables.append(h.own_freq)
    freq = np.concatenate(tables).astype(np.int32)
    cum = cumulative(freq)
    meta = np.array(
        [
            [r.offset, *r.streams, h.rice_k, r.start, r.count, h.changes, base, ix, vx]
            for r, h, base, ix, vx in rows
        ],
        np.int64,
    ).reshape(n, 11)
    return GapPlan(
        fmt,
        meta,
        expected,
        ctx_tables,
        freq,
        cum,
        kernels.rans_owners(freq, cum),
        [r for r, *_ in rows],
        results,
        keep,
    )


def decode_gap_batch(plan: GapPlan, data: np.ndarray, lo: int, hi: int) -> None:
    """Decode chunks ``lo`` to ``hi`` of ``plan`` into its outputs, in one compiled call;
    :class:`CorruptDeltaError` names the first chunk that fails. ``data``: the whole object (the
    chunks' ``offset`` point into it)."""
    shift, emask = context_layout(plan.fmt)
    status, j = kernels.decode_gap_batch(
        data,
        plan.meta,
        plan.expected,
        plan.ctx_tables,
        plan.freq,
        plan.cum,
        plan.owner,
        np.empty(0, plan.fmt.bits_dtype),
        shift,
        emask,
        plan.fmt.width,
        TOP_BITS,
        SMALL,
        lo,
        hi,
    )
    if status < 0:
        ref = plan.refs[j]
        raise CorruptDeltaError(
            f"{ref.tensor}: the chunk at element {ref.start}: {_CHUNK_ERRORS[status]}"
        )


def _read_contexts(
    r: VarintReader, tensor: str, n_present: int, nctx: int, *, with_rice: bool
) -> _ContextList:
    """A chunk header's list of contexts: ``(context ids, changes, own, rice, complement,
    elements of complement contexts)``, the last three only ``with_rice`` (format version 2 and
    up, by context rank; zeros otherwise)."""
    ctx_ids = np.empty(n_present, np.int64)
    kc_present = np.empty(n_present, np.int64)
    own = np.zeros(n_present, bool)
    rice_present = np.zeros(n_present, np.int64)
    comp_present = np.zeros(n_present, bool)
    n_comp = np.zeros(n_present, np.int64)  # a complement context's elements
    c = -1
    for i in range(n_present):
        c += r.varint() + 1
        v = r.varint()
        if c >= nctx or v < 2:
            raise CorruptDeltaError(f"{tensor}: chunk header is malformed")
        ctx_ids[i], kc_present[i], own[i] = c, v >> 1, bool(v & 1)
        if with_rice:
            w = r.varint()
            rice_present[i], comp_present[i] = w >> 1, bool(w & 1)
            if comp_present[i]:
                n_comp[i] = r.varint()
            if rice_present[i] > MAX_RICE or (
                comp_present[i] and not kc_present[i] <= n_comp[i] < 2 * kc_present[i]
            ):
                raise CorruptDeltaError(f"{tensor}: chunk header is malformed")
    return ctx_ids, kc_present, own, rice_present, comp_present, n_comp


def _positions_by_gaps(
    ref: ChunkRef,
    stream: np.ndarray,
    old: np.ndarray,
    fmt: FloatFormat,
    rice_k: int,
    ctx_ids: np.ndarray,
    kc_present: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(indices, old exponents, old bit patterns)`` of a chunk coded by gaps, in one compiled
    call. Reads only the changed elements of ``old``; their exponents must have the header's
    change counts (another base almost never does)."""
    shift, emask = context_layout(fmt)
    k = int(kc_present.sum())
    index = np.empty(k, np.int64)
    ctx = np.empty(k, np.int64)
    old_at = np.empty(k, old.dtype)
    expected = np.zeros(emask + 1, np.int64)
    expected[ctx_ids] = kc_present
    status = kernels.decode_gap_positions(
        stream, rice_k, old, shift, emask, expected, index, ctx, old_at
    )
    if status < 0:
        raise CorruptDeltaError(f"{ref.tensor}: {_CHUNK_ERRORS[status]}")
    return index, ctx, old_at


def _positions_by_rank(
    ref: ChunkRef,
    stream: np.ndarray,
    old: np.ndarray,
    keys: np.ndarray,
    shift: int,
    kmask: int,
    head: _ContextList,
    version: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(indices, position contexts, old bit patterns)`` of a chunk coded by context rank: one
    walk over every element of ``old`` (``keys``: its position contexts,
    :func:`position_contexts`)."""
    ctx_ids, kc_present, _, rice_present, comp_present, n_comp = head
    nctx = kmask + 1
    kc = np.zeros(nctx, np.int64)
    kc[ctx_ids] = kc_present
    hist = np.full(nctx, old.size, np.int64)  # version 2: a bound, but where complement
    if version >= 2:
        comp = np.zeros(nctx, bool)
        comp[ctx_ids] = comp_present
        hist[ctx_ids[comp_present]] = n_comp[comp_present]
        coded = np.where(comp, hist - kc, kc)
        rice_of_ctx = np.zeros(nctx, np.int64)
        rice_of_ctx[ctx_ids] = rice_present
    else:  # counted from the base, and the rest derived from the counts as the encoder did
        hist[:] = 0
        kernels.context_histogram(keys, shift, kmask, hist)
        if np.any(kc > hist):
            raise CorruptDeltaError(
                f"{ref.tensor}: chunk claims more changes than the base has elements (wrong base?)"
            )
        comp = 2 * kc > hist
        coded = np.where(comp, hist - kc, kc)
        coded[kc == 0] = 0
        rice_of_ctx = rice_parameter(hist, coded)
    gap_ctx = np.repeat(np.arange(nctx), coded)
    kparams = rice_of_ctx[gap_ctx]
    gaps = np.empty(gap_ctx.size, np.int64)
    if kernels.rice_decode(stream, kparams, gaps) < 0:
        raise CorruptDeltaError(f"{ref.tensor}: position stream ends early")
    ends = np.cumsum(coded)
    starts = ends - coded
    with_gaps = coded > 0
    if gaps.size:  # each context's last coded rank (the sum of its gaps + 1, minus 1)
        last = np.add.reduceat(gaps + 1, starts[with_gaps]) - 1
        if np.any(last >= hist[with_gaps]):
            raise CorruptDeltaError(
                f"{ref.tensor}: positions name elements beyond the tensor (wrong base?)"
            )
    k = int(kc.sum())
    index = np.empty(k, np.int64)
    ctx = np.empty(k, np.int64)
    old_at = np.empty(k, old.dtype)
    m = kernels.select_changed(keys, shift, kmask, gaps, starts, ends, comp, index, ctx, old_at)
    if m != k:
        raise CorruptDeltaError(
            f"{ref.tensor}: positions do not decode consistently (wrong base or damaged chunk)"
        )
    if keys is not old:  # chained: the keys are the contexts, not the old bit patterns
        old_at = old[index]
    return index, ctx, old_at
