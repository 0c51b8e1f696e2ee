"""Compiled inner loops of the compact codec (numba, ``nogil`` so chunks run on all cores).

Every kernel is a single pass over its input with no allocation inside the loop. The Python side
(``compact.py``) prepares arrays, sizes output buffers exactly and checks every length it reads
back, so a kernel can trust its arguments; kernels that read untrusted bytes (the decoders) bound
every read and report overruns through their return value instead of reading past the buffer.

Conventions:

* bit streams are MSB-first inside each byte; a Rice code is ``q`` zero bits, a one bit, then the
  ``k`` low bits of the value (MSB first);
* the rANS coder is the classic byte-wise 32-bit variant (state in ``[L, 256 L)``, ``L = 2**23``)
  with ``PROB_BITS``-bit frequencies, encoded back to front and decoded front to back.
"""

from __future__ import annotations

import math

import numpy as np
from numba import carray, njit, types
from numba.extending import intrinsic

RANS_L = 1 << 23
PROB_BITS = 14
PROB_SCALE = 1 << PROB_BITS
# the rANS decoder finds a slot's symbol from the owners of 2**(PROB_BITS - BUCKET_SHIFT) buckets
# of slots (:func:`rans_owners`): one load when a bucket has a single owner, as most have
BUCKET_SHIFT = 4
# changes per block of the gap decoder (:func:`decode_gap_chunk`): positions, then base loads,
# then values, each a loop over one block held in the caches
GAP_BLOCK = 2048
# a chunk header's change count of one context above this is malformed (no chunk holds that
# many elements), so that sums of counts never wrap
MAX_CHANGES = 1 << 48
# zero bits before the first one bit of a non-zero byte (MSB first)
_LEADING_ZEROS = np.array([8 - int(b).bit_length() for b in range(256)], np.int64)


@njit(nogil=True, cache=True)
def scan_contexts(old, index, shift, emask, hist, ctx_out, rank_out):  # pragma: no cover - jit
    """Context histogram of ``old`` and, for each changed element, its context and its rank
    among the elements of the same context that precede it.

    ``index`` must be strictly increasing and within ``old``; ``hist`` is zeroed by the caller.
    """
    j = 0
    k = index.size
    nxt = index[0] if k > 0 else -1
    for i in range(old.size):
        c = (np.int64(old[i]) >> shift) & emask
        if i == nxt:
            ctx_out[j] = c
            rank_out[j] = hist[c]
            j += 1
            nxt = index[j] if j < k else -1
        hist[c] += 1


@njit(nogil=True, cache=True)
def position_gaps(
    ctx, rank, hist, kc, comp, tag_of_ctx, gaps_out, tag_out
):  # pragma: no cover - jit
    """The Rice-coded position stream of a chunk from :func:`scan_contexts`' output: contexts in
    ascending order; within a context the gaps between the ranks of its changed elements, or,
    where ``comp[c]``, between the ranks of its unchanged ones (``rank - previous - 1``, the
    previous of a context's first being -1). ``tag_out`` gets each gap's ``tag_of_ctx`` of its
    context (the encoder passes the contexts' Rice parameters; ``arange`` gives the contexts).

    ``kc``: changes per context; the outputs hold ``sum(where(comp, hist - kc, kc))``.
    """
    nctx = hist.size
    k = ctx.size
    first = np.zeros(nctx + 1, np.int64)  # changed elements of each context, counting sort
    for c in range(nctx):
        first[c + 1] = first[c] + kc[c]
    fill = first[:nctx].copy()
    ranks = np.empty(k, np.int64)
    for j in range(k):  # index order: ranks of one context ascending
        c = ctx[j]
        ranks[fill[c]] = rank[j]
        fill[c] += 1
    m = 0
    for c in range(nctx):
        lo, hi = first[c], first[c + 1]
        prev = np.int64(-1)
        tag = tag_of_ctx[c]
        if not comp[c]:
            for i in range(lo, hi):
                gaps_out[m] = ranks[i] - prev - 1
                tag_out[m] = tag
                prev = ranks[i]
                m += 1
        else:
            nxt = lo
            for r in range(hist[c]):
                if nxt < hi and ranks[nxt] == r:
                    nxt += 1
                    continue
                gaps_out[m] = r - prev - 1
                tag_out[m] = tag
                prev = np.int64(r)
                m += 1
    return m


@njit(nogil=True, cache=True, inline="always")
def _symbol(v, top_bits, small):  # pragma: no cover - jit
    """(symbol, extra-bit value, extra-bit width) of one non-zero diff ``v`` (the rule is
    :func:`~.entropy.diff_to_symbols`)."""
    neg = np.int64(1) if v < 0 else np.int64(0)
    a = -v if v < 0 else v
    if a <= small:
        return 2 * (a - 1) + neg, np.int64(0), np.int64(0)
    length = np.int64(0)
    x = a
    while x:
        x >>= 1
        length += 1
    w = length - 1 - top_bits
    top = (a >> w) & ((1 << top_bits) - 1)
    return 16 + 2 * (((length - 4) << top_bits) | top) + neg, a & ((np.int64(1) << w) - 1), w


@njit(nogil=True, cache=True)
def diff_symbols(d, top_bits, small, sym_out, extra_out, width_out):  # pragma: no cover - jit
    """Symbol, extra-bit value and extra-bit width of every diff (one pass instead of a dozen
    int64 temporaries)."""
    for i in range(d.size):
        sym_out[i], extra_out[i], width_out[i] = _symbol(np.int64(d[i]), top_bits, small)


@njit(nogil=True, cache=True)
def value_symbols(
    value,
    ref,
    width,
    ctx,
    row_of_ctx,
    top_bits,
    small,
    sym_out,
    extra_out,
    width_out,
    row_out,
    counts,
):  # pragma: no cover - jit
    """Standalone values in one pass: the diff ``value - ref`` wrapped to ``width`` bits (as
    :func:`~.entropy.wrapped_diff`), its symbol, extra bits and width (as :func:`diff_symbols`),
    its value context's row ``row_out[i] = row_of_ctx[ctx[i]]`` and ``counts[row, symbol] += 1``
    (``counts`` zeroed by the caller)."""
    span = np.int64(1) << width
    for i in range(value.size):
        v = (np.int64(value[i]) - np.int64(ref[i])) & (span - 1)
        if v >= span >> 1:
            v -= span
        sym, extra_out[i], width_out[i] = _symbol(v, top_bits, small)
        sym_out[i] = sym
        row = row_of_ctx[ctx[i]]
        row_out[i] = row
        counts[row, sym] += 1


@njit(nogil=True, cache=True)
def analyse_gap_scan(
    index, start, count, value, ctx, old, emask, width, top_bits, small, alphabet, k_lo, n_k
):  # pragma: no cover - jit
    """Phase A of one standalone chunk coded by gaps, from its precomputed scan, in one call
    (one GIL hand-off per chunk where a dozen numpy and kernel calls made a dozen: on a 32-core
    host those hand-offs kept the encoder from scaling past 8 threads). ``index``: the changed
    elements' indices in the tensor (increasing), ``start`` / ``count`` the chunk's first element
    and size, ``value`` their new bit patterns, ``ctx`` / ``old`` the scan's context (old
    exponent) and old bit pattern of each.

    Returns ``(status, gaps, rice, kc, symbols, extra, widths, rows, counts)``: status 0, -1 if
    an index lies outside the chunk or a value equals its old one (the scan does not fit the
    delta), -2 if a context lies outside ``[0, emask]`` (the first of the two when both hold);
    ``gaps`` (uint32) as :func:`index_gaps` of the chunk-local indices; ``rice`` the Rice
    parameter in ``[k_lo, k_lo + n_k)`` that codes them in the fewest bits (the first such);
    ``kc`` the changes per context; then the values as :func:`value_symbols` makes them, rows
    numbered by the contexts present in ascending order."""
    k = index.size
    status = 0
    for j in range(k):
        i = np.int64(index[j]) - start
        if i < 0 or i >= count or value[j] == old[j]:
            status = -1
            break
    if status == 0:
        for j in range(k):
            c = np.int64(ctx[j])
            if c < 0 or c > emask:
                status = -2
                break
    empty = np.zeros(0, np.uint32)
    if status < 0:
        return (
            status,
            empty,
            np.int64(0),
            np.zeros(0, np.int64),
            np.zeros(0, np.uint16),
            empty,
            np.zeros(0, np.uint8),
            np.zeros(0, np.int32),
            np.zeros((0, 1), np.int64),
        )
    kc = count_values(ctx, emask + 1)
    gaps = np.empty(k, np.uint32)
    index_gaps(index, gaps)  # gaps between tensor indices; the first from the chunk's start
    if k:
        gaps[0] = np.int64(index[0]) - start
    costs = np.empty(n_k, np.int64)
    rice_costs(gaps, k_lo, costs)
    rice = k_lo + np.argmin(costs)
    row_of_ctx = np.full(emask + 1, -1, np.int32)
    rows_present = 0
    for e in range(emask + 1):
        if kc[e]:
            row_of_ctx[e] = rows_present
            rows_present += 1
    symbols = np.empty(k, np.uint16)
    extra = np.empty(k, np.uint32)
    widths = np.empty(k, np.uint8)
    rows = np.empty(k, np.int32)
    counts = np.zeros((rows_present, alphabet), np.int64)
    value_symbols(
        value, old, width, ctx, row_of_ctx, top_bits, small, symbols, extra, widths, rows, counts
    )
    return status, gaps, rice, kc, symbols, extra, widths, rows, counts


@njit(nogil=True, cache=True)
def code_gap_body(
    gaps, rice, symbols, rows, table_of_row, freq, cum, extra, widths
):  # pragma: no cover - jit
    """The body of a chunk coded by gaps in one call: the gaps Rice-coded with parameter
    ``rice`` (as :func:`rice_encode`), the symbols rANS-coded (:func:`rans_encode`), the extra
    bits (:func:`raw_bits_encode`), back to back in one array. Returns ``(body, rice bytes,
    rans bytes, extra bytes)``."""
    kparams = np.full(gaps.size, rice, np.uint8)
    extra_bits = np.int64(0)
    for j in range(widths.size):
        extra_bits += np.int64(widths[j])
    rl = (rice_bits(gaps, kparams) + 7) // 8
    el = (extra_bits + 7) // 8
    rans = np.empty(16 + 4 * symbols.size, np.uint8)
    at = rans_encode(symbols, rows, table_of_row, freq, cum, rans)
    al = rans.size - at
    body = np.zeros(rl + al + el, np.uint8)
    rice_encode(gaps, kparams, body[:rl])
    body[rl : rl + al] = rans[at:]
    raw_bits_encode(extra, widths, body[rl + al :])
    return body, rl, al, el


@njit(nogil=True, cache=True)
def count_values(values, n):  # pragma: no cover - jit
    """``np.bincount(values, minlength=n)`` for values in ``[0, n)``, without holding the GIL."""
    out = np.zeros(n, np.int64)
    for i in range(values.size):
        out[values[i]] += 1
    return out


@njit(nogil=True, cache=True)
def context_histogram(old, shift, emask, hist):  # pragma: no cover - jit
    for i in range(old.size):
        hist[(np.int64(old[i]) >> shift) & emask] += 1


@njit(nogil=True, cache=True)
def select_changed(
    old, shift, emask, gaps, starts, ends, complement, out_index, out_ctx, out_old
):  # pragma: no cover
    """Inverse of :func:`scan_contexts` and :func:`position_gaps`: turn each context's coded
    gaps back into flat indices.

    ``gaps[starts[c]:ends[c]]`` are context ``c``'s coded gaps (``rank - previous rank - 1``,
    the first from rank -1); where ``complement[c]`` they name its *unchanged* elements.
    Returns the number of changed elements written (with their contexts and old bit patterns),
    or -1 if the gaps do not fit the tensor (corrupt input, or another base).

    The loop runs once per element of the chunk (~100 per change at 1% density). Its common
    case is one load, one compare and one store: ``left[c]``, the elements of context ``c`` still
    to pass before its next coded one, counts down; only the coded element (``left`` 0), or an
    element of a complement context (``left`` -1), takes the slow path.
    """
    nctx = starts.size
    ptr = starts.copy()
    never = np.int64(1) << 62
    left = np.empty(nctx, np.int64)
    for c in range(nctx):
        if complement[c]:
            left[c] = -1
        elif ptr[c] < ends[c]:
            left[c] = gaps[ptr[c]]
        else:
            left[c] = never
    passed = np.zeros(nctx, np.int64)  # complement contexts: elements since the last coded one
    m = 0
    cap = out_index.size
    for i in range(old.size):
        c = (np.int64(old[i]) >> shift) & emask
        ahead = left[c]
        if ahead > 0:
            left[c] = ahead - 1
            continue
        if ahead == 0:  # the next coded element of a plain context: it changed
            if m >= cap:
                return -1
            out_index[m] = i
            out_ctx[m] = c
            out_old[m] = old[i]
            m += 1
            p = ptr[c] + 1
            ptr[c] = p
            left[c] = gaps[p] if p < ends[c] else never
            continue
        p = ptr[c]  # a complement context: its coded elements are the unchanged ones
        if p < ends[c] and passed[c] == gaps[p]:
            ptr[c] = p + 1
            passed[c] = 0
            continue
        passed[c] += 1
        if m >= cap:
            return -1
        out_index[m] = i
        out_ctx[m] = c
        out_old[m] = old[i]
        m += 1
    for c in range(nctx):
        if ptr[c] != ends[c]:
            return -1
    return m


@njit(nogil=True, cache=True)
def index_gaps(index, out):  # pragma: no cover - jit
    """``out[j] = index[j] - index[j - 1] - 1`` (the first from -1): a chunk's changed positions
    as gaps, for a chunk coded without position contexts."""
    prev = np.int64(-1)
    for j in range(index.size):
        i = np.int64(index[j])
        out[j] = i - prev - 1
        prev = i


@njit(nogil=True, cache=True)
def positions_from_gaps(
    gaps, old, shift, emask, index_out, old_out, ctx_out, counts
):  # pragma: no cover - jit
    """Inverse of :func:`index_gaps` against the chunk's base ``old``: each changed element's
    index, its old bit pattern and its context (old exponent), and ``counts`` (zeroed by the
    caller) of the contexts. Reads only the changed elements. Returns -1 if a position lies
    beyond the chunk (corrupt input), else 0.

    Two loops: the indices first (a running sum), then the base's elements at them, loads that
    do not wait for each other (a miss per change at 1% density: the base is far larger than
    the caches)."""
    i = np.int64(-1)
    n = old.size
    for j in range(gaps.size):
        g = np.int64(gaps[j])
        if g < 0 or g >= n:  # a Rice code past any gap (it may even wrap negative)
            return -1
        i += g + 1
        if i >= n:
            return -1
        index_out[j] = i
    for j in range(gaps.size):
        o = old[index_out[j]]
        c = (np.int64(o) >> shift) & emask
        old_out[j] = o
        ctx_out[j] = c
        counts[c] += 1
    return 0


@njit(nogil=True, cache=True)
def rice_costs(gaps, k_lo, costs):  # pragma: no cover - jit
    """``costs[i]``: the bits of Rice-coding every gap with parameter ``k_lo + i``, in one
    pass over the gaps."""
    n_k = costs.size
    sums = np.zeros(n_k, np.int64)
    for j in range(gaps.size):
        g = np.int64(gaps[j]) >> k_lo
        for i in range(n_k):
            sums[i] += g >> i
    for i in range(n_k):
        costs[i] = sums[i] + gaps.size * (1 + k_lo + i)


@njit(nogil=True, cache=True)
def rice_bits(values, kparams):  # pragma: no cover - jit
    total = np.int64(0)
    for j in range(values.size):
        k = np.int64(kparams[j])
        total += (np.int64(values[j]) >> k) + 1 + k
    return total


@njit(nogil=True, cache=True, inline="always")
def _put_bits(out, pos, val, n):  # pragma: no cover - jit
    """OR the ``n`` (<= 56) low bits of ``val`` into zeroed ``out`` at bit ``pos``, MSB first:
    a byte at a time from the last byte touched (the bits above ``n`` are zero)."""
    end = pos + n
    v = (np.int64(val) & ((np.int64(1) << n) - 1)) << ((8 - (end & 7)) & 7)
    i = (end - 1) >> 3
    while v:
        out[i] |= np.uint8(v & 0xFF)
        v >>= 8
        i -= 1


@njit(nogil=True, cache=True)
def rice_encode(values, kparams, out):  # pragma: no cover - jit
    """Rice-code ``values[j]`` with parameter ``kparams[j]`` into ``out`` (zeroed, sized by
    :func:`rice_bits`): ``values[j] >> k`` zero bits, a one, then the ``k`` low bits."""
    pos = np.int64(0)
    for j in range(values.size):
        v = np.int64(values[j])
        k = np.int64(kparams[j])
        pos += v >> k  # q zero bits (out is zeroed)
        _put_bits(out, pos, (np.int64(1) << k) | v, k + 1)
        pos += k + 1
    return pos


@njit(nogil=True, cache=True, inline="always")
def _rice_code(buf, k, p, acc, have, pos):  # pragma: no cover - jit
    """The next Rice code of ``buf`` with parameter ``k``: ``(quotient, remainder, p, acc,
    have, pos)``, the reader's state after it (``acc`` holds ``have`` bits; ``p``: the next
    byte to load; ``pos``: bits consumed). A run of zeros is counted a byte at a time. Bits
    past the buffer read as zero and are counted, and a run of zeros that leaves the buffer
    ends the code there: the caller finds an overrun from ``pos``."""
    n = buf.size
    nbits = np.int64(n) * 8
    q = np.int64(0)
    while True:
        if have < 8:
            acc = (acc << 8) | (np.int64(buf[p]) if p < n else np.int64(0))
            p += 1
            have += 8
        top = (acc >> (have - 8)) & 0xFF
        if top == 0:
            q += 8
            have -= 8
            pos += 8
            if pos > nbits:
                return q, np.int64(0), p, acc, have, pos
            continue
        z = np.int64(_LEADING_ZEROS[top])
        q += z
        have -= z + 1
        pos += z + 1
        acc &= (np.int64(1) << have) - 1  # at most 15 bits stay, so k <= 48 fits
        break
    while have < k:
        acc = (acc << 8) | (np.int64(buf[p]) if p < n else np.int64(0))
        p += 1
        have += 8
    have -= k
    pos += k
    r = (acc >> have) & ((np.int64(1) << k) - 1)
    acc &= (np.int64(1) << have) - 1
    return q, r, p, acc, have, pos


@njit(nogil=True, cache=True)
def rice_decode(buf, kparams, out):  # pragma: no cover - jit
    """Decode ``out.size`` Rice codes. Returns bits consumed, or -1 on overrun (corrupt input).

    The bits pass through a register (:func:`_rice_code`), so a code costs a few operations
    instead of a load per bit."""
    nbits = np.int64(buf.size) * 8
    p = 0  # next byte to load
    acc = np.int64(0)
    have = np.int64(0)
    pos = np.int64(0)  # bits consumed
    for j in range(out.size):
        q, r, p, acc, have, pos = _rice_code(buf, np.int64(kparams[j]), p, acc, have, pos)
        if pos > nbits:
            return -1
        out[j] = (q << np.int64(kparams[j])) | r
    return pos


@njit(nogil=True, cache=True)
def raw_bits_encode(values, widths, out):  # pragma: no cover - jit
    """Write the low ``widths[j]`` bits of ``values[j]``, MSB first, into zeroed ``out``."""
    pos = np.int64(0)
    for j in range(values.size):
        w = np.int64(widths[j])
        _put_bits(out, pos, values[j], w)
        pos += w
    return pos


@njit(nogil=True, cache=True, inline="always")
def _difference(s, buf, pos, nbits, width, top_bits, small):  # pragma: no cover - jit
    """The signed difference symbol ``s`` names, its extra bits read from ``buf`` at bit
    ``pos`` (MSB first, a byte at a time), and the bit position after them: the inverse of
    :func:`_symbol`. The position is -1 if ``buf`` ends early, -2 if the difference is wider
    than ``width`` (corrupt input either way)."""
    if s < 2 * small:
        a = (s >> 1) + 1
    else:
        w = ((s - 2 * small) >> (top_bits + 1)) + 3 - top_bits
        if w + 1 + top_bits > width:
            return np.int64(0), np.int64(-2)
        if pos + w > nbits:
            return np.int64(0), np.int64(-1)
        extra = np.int64(0)
        need = w
        while need > 0:
            avail = 8 - (pos & 7)
            take = avail if avail < need else need
            bits = (np.int64(buf[pos >> 3]) >> (avail - take)) & ((np.int64(1) << take) - 1)
            extra = (extra << take) | bits
            pos += take
            need -= take
        top = ((s - 2 * small) >> 1) & ((np.int64(1) << top_bits) - 1)
        a = (np.int64(1) << (w + top_bits)) | (top << w) | extra
    return (-a if s & 1 else a), pos


@njit(nogil=True, cache=True)
def decode_values(
    symbols, buf, ref, forbidden, chained, width, top_bits, small, out
):  # pragma: no cover - jit
    """The values of a chunk from its rANS symbols, in one pass: each symbol's extra bits read
    from ``buf`` (MSB first), the signed difference it names (:func:`_difference`), in a
    chained chunk moved past the forbidden residual (the inverse of
    ``context.skip_forbidden``), added to ``ref`` wrapped to ``width`` bits, into ``out``.

    Returns the extra bits consumed; -1 if ``buf`` ends early, -2 if a symbol names a
    difference wider than ``width`` (corrupt input either way)."""
    nbits = np.int64(buf.size) * 8
    pos = np.int64(0)
    span = np.int64(1) << width
    for j in range(symbols.size):
        d, pos = _difference(np.int64(symbols[j]), buf, pos, nbits, width, top_bits, small)
        if pos < 0:
            return pos
        if chained:
            f = np.int64(forbidden[j])
            if f < 0 and f <= d <= -1:
                d += 1
            elif f > 0 and 1 <= d <= f:
                d -= 1
        out[j] = (np.int64(ref[j]) + d) & (span - 1)
    return pos


@njit(nogil=True, cache=True)
def rans_encode(symbols, rows, table_of_row, freq, cum, out):  # pragma: no cover - jit
    """rANS-encode ``symbols[j]`` under table ``table_of_row[rows[j]]``; returns the start of
    the output in ``out`` (bytes are written at ``out[start:]``)."""
    x = np.int64(RANS_L)
    pos = out.size
    for j in range(symbols.size - 1, -1, -1):
        s = np.int64(symbols[j])
        t = np.int64(table_of_row[rows[j]])
        f = np.int64(freq[t, s])
        xmax = ((RANS_L >> PROB_BITS) << 8) * f
        while x >= xmax:
            pos -= 1
            out[pos] = np.uint8(x & 0xFF)
            x >>= 8
        x = ((x // f) << PROB_BITS) + (x % f) + np.int64(cum[t, s])
    pos -= 4
    out[pos] = np.uint8(x & 0xFF)
    out[pos + 1] = np.uint8((x >> 8) & 0xFF)
    out[pos + 2] = np.uint8((x >> 16) & 0xFF)
    out[pos + 3] = np.uint8((x >> 24) & 0xFF)
    return pos


@njit(nogil=True, cache=True)
def rans_owners(freq, cum):  # pragma: no cover - jit
    """``owner[t, b]``: the symbol of table ``t`` that holds slot ``b << BUCKET_SHIFT`` (the
    first slot of bucket ``b``); ``owner[t, -1]`` is the last symbol. A slot's symbol lies
    between its bucket's owner and the next bucket's. Tables must sum to ``PROB_SCALE``."""
    n_tables, nsym = freq.shape
    nb = PROB_SCALE >> BUCKET_SHIFT
    owner = np.empty((n_tables, nb + 1), np.int32)
    for t in range(n_tables):
        s = 0
        for b in range(nb):
            slot = b << BUCKET_SHIFT
            while s < nsym - 1 and cum[t, s] + freq[t, s] <= slot:
                s += 1
            owner[t, b] = s
        owner[t, nb] = nsym - 1
    return owner


@njit(nogil=True, cache=True, inline="always")
def _rans_symbol(slot, t, cum, owner):  # pragma: no cover - jit
    """The last symbol of table ``t`` whose cumulative frequency is <= ``slot``: searched only
    between the owners of the slot's bucket and of the next one (usually the same symbol)."""
    b = slot >> BUCKET_SHIFT
    lo = np.int64(owner[t, b])
    hi = np.int64(owner[t, b + 1])
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if cum[t, mid] <= slot:
            lo = mid
        else:
            hi = mid - 1
    return lo


@njit(nogil=True, cache=True, inline="always")
def _rans_state(buf):  # pragma: no cover - jit
    """A rANS stream's initial state: its first 4 bytes, little-endian (4 bytes or more)."""
    return (
        np.int64(buf[0])
        | (np.int64(buf[1]) << 8)
        | (np.int64(buf[2]) << 16)
        | (np.int64(buf[3]) << 24)
    )


@njit(nogil=True, cache=True)
def rans_decode(buf, tables, freq, cum, owner, out):  # pragma: no cover - jit
    """Decode ``out.size`` symbols (``owner``: :func:`rans_owners` of the tables). Returns
    bytes consumed, or -1 if the stream is corrupt."""
    n = buf.size
    if n < 4:
        return -1
    x = _rans_state(buf)
    p = 4
    mask = PROB_SCALE - 1
    for j in range(out.size):
        t = tables[j]
        slot = x & mask
        s = _rans_symbol(slot, t, cum, owner)
        f = np.int64(freq[t, s])
        if f == 0:
            return -1
        out[j] = s
        x = f * (x >> PROB_BITS) + slot - np.int64(cum[t, s])
        while x < RANS_L:
            if p >= n:
                return -1
            x = (x << 8) | np.int64(buf[p])
            p += 1
    if x != RANS_L:
        return -1
    return p


@njit(nogil=True, cache=True)
def moved_keys(old, shift, emask, moved, out):  # pragma: no cover - jit
    """``out[i] = 2 * ((old[i] >> shift) & emask) + (i in moved)``; ``moved`` is sorted and
    within ``old`` (chained chunks: position context = old exponent and "moved before")."""
    for i in range(old.size):
        out[i] = ((np.int64(old[i]) >> shift) & emask) << 1
    for j in range(moved.size):
        out[moved[j]] |= 1


@njit(nogil=True, cache=True)
def predict_moves(
    old, index, prev_index, prev_before, width, mbits, ebits, rho16, pred, forbidden, bucket
):  # pragma: no cover - jit
    """Chained deltas: for each changed element ``index[j]`` of a chunk, its predicted pattern
    ``pred[j]`` (the previous move ``old - before`` extrapolated by ``rho16 / 16`` in float64
    and rounded to nearest even in the format; ``old`` where there is no previous move or a
    special value is involved), ``forbidden[j] = old - pred`` (wrapped) and its move bucket.

    ``prev_index`` (sorted) and ``prev_before``: the context's chunk-local indices and their
    patterns before the context delta. Exact and deterministic: only IEEE float64 operations on
    exactly representable values, and integer rounding.
    """
    span = np.int64(1) << width
    half = span >> 1
    umask = span - 1
    emask = (np.int64(1) << ebits) - 1
    bias = (np.int64(1) << (ebits - 1)) - 1
    top = np.int64(1) << mbits
    m = prev_index.size
    factor = rho16 / 16.0
    for j in range(index.size):
        i = index[j]
        o = np.int64(old[i])
        lo, hi = 0, m
        while lo < hi:  # first prev_index >= i
            mid = (lo + hi) >> 1
            if prev_index[mid] < i:
                lo = mid + 1
            else:
                hi = mid
        p = o
        b = np.int64(0)
        if lo < m and prev_index[lo] == i:
            b = np.int64(prev_before[lo])
            move = (o - b) & umask
            if move >= half:
                move -= span
        else:
            move = 0
        a = -move if move < 0 else move
        if a == 0:
            bucket[j] = 0
        else:
            length = 0
            while a > 0 and length < 7:
                a >>= 1
                length += 1
            bucket[j] = 2 * length - 1 + (1 if move < 0 else 0)
        uo = o & umask
        ub = b & umask
        eo = (uo >> mbits) & emask
        eb = (ub >> mbits) & emask
        if move != 0 and 0 < eo < emask and 0 < eb < emask:
            vo = math.ldexp(float(top | (uo & (top - 1))), int(eo - bias - mbits))
            if uo >> (width - 1):
                vo = -vo
            vb = math.ldexp(float(top | (ub & (top - 1))), int(eb - bias - mbits))
            if ub >> (width - 1):
                vb = -vb
            x = vo + (vo - vb) * factor
            if math.isfinite(x) and x != 0.0:
                neg = x < 0.0
                fr, ex = math.frexp(-x if neg else x)  # x = fr * 2**ex, fr in [0.5, 1)
                q = math.ldexp(fr, mbits + 1)  # in [2**mbits, 2**(mbits+1)), exact
                r = math.floor(q)
                rest = q - r
                ri = np.int64(r)
                if rest > 0.5 or (rest == 0.5 and (ri & 1) == 1):
                    ri += 1
                if ri == top << 1:
                    ri = top
                    ex += 1
                e = np.int64(ex) - 1 + bias
                if 0 < e < emask:
                    u = (e << mbits) | (ri - top)
                    if neg:
                        u |= half
                    p = u - span if u >= half else u
        pred[j] = p
        f = (o - p) & umask
        forbidden[j] = f - span if f >= half else f


@njit(nogil=True, cache=True)
def decode_gap_positions(
    stream, rice_k, old, shift, emask, expected, index, ctx, old_at
):  # pragma: no cover - jit
    """A chunk's positions coded as gaps, in one call: Rice-decode ``index.size`` gaps with
    parameter ``rice_k``, then :func:`positions_from_gaps` against the chunk's base ``old``, and
    compare the changes per context with ``expected`` (the header's). Returns 0, or -1 if the
    stream ends early, -2 if a position lies beyond the chunk, -3 if the counts differ
    (another base, or a damaged chunk)."""
    k = index.size
    gaps = np.empty(k, np.int64)
    if rice_decode(stream, np.full(k, rice_k, np.uint8), gaps) < 0:
        return -1
    counts = np.zeros(emask + 1, np.int64)
    if positions_from_gaps(gaps, old, shift, emask, index, old_at, ctx, counts) < 0:
        return -2
    for c in range(emask + 1):
        if counts[c] != expected[c]:
            return -3
    return 0


@njit(nogil=True, cache=True)
def decode_standalone_values(
    ctx, old_at, ctx_table, freq, cum, owner, rans, extra, width, top_bits, small, out
):  # pragma: no cover - jit
    """A standalone chunk's values in one call: each change's table from its context
    (``ctx_table``), the rANS symbols, then :func:`decode_values` against the old bit patterns
    ``old_at``. Returns 0, or -4 if a context has no table, -5 if the rANS stream is damaged,
    -6 if the extra bits end early, -7 if a difference is wider than the dtype."""
    k = ctx.size
    tid = np.empty(k, np.int64)
    for j in range(k):
        t = ctx_table[ctx[j]]
        if t < 0:
            return -4
        tid[j] = t
    symbols = np.empty(k, np.int64)
    if rans_decode(rans, tid, freq, cum, owner, symbols) != rans.size:
        return -5
    used = decode_values(symbols, extra, old_at, symbols[:0], False, width, top_bits, small, out)
    if used == -2:
        return -7
    if used < 0:
        return -6
    return 0


@njit(nogil=True, cache=True)
def increasing_below(index, n):  # pragma: no cover - jit
    """Whether ``index`` is strictly increasing and within ``[0, n)``."""
    prev = np.int64(-1)
    for j in range(index.size):
        i = np.int64(index[j])
        if i <= prev:
            return False
        prev = i
    return prev < n


@njit(nogil=True, cache=True)
def decode_gap_chunk(
    rice,
    rice_k,
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
    width,
    top_bits,
    small,
    index_out,
    values_out,
    offset,
):  # pragma: no cover - jit
    """A standalone chunk coded by gaps, in one pass over its changes with no allocation of
    their size: ``index_out.size`` gaps Rice-decoded with parameter ``rice_k`` into positions
    (written to ``index_out`` plus ``offset``), the base ``old`` loaded there, each change's
    context (old exponent), table (``ctx_table``), rANS symbol and value against its old bit
    pattern (into ``values_out``). Blocks of :data:`GAP_BLOCK` changes go through the three
    steps in turn, so the base's loads of a block are independent of each other and its
    positions stay in the caches. ``owner``: :func:`rans_owners` of the tables.

    The changes per context must equal ``expected`` (the header's): a wrong base almost never
    gives them, and such a base is reported as one (-3) even when its values fail first.
    Returns 0; -1 if the position stream ends early, -2 if a position lies beyond the chunk,
    -3 if the counts differ, -4 if a context has no table, -5 if the rANS stream is damaged,
    -6 if the extra bits end early, -7 if a difference is wider than the dtype."""
    k = index_out.size
    n = old.size
    counts = np.zeros(emask + 1, np.int64)
    old_block = np.empty(GAP_BLOCK, old.dtype)
    # the Rice reader (see rice_decode): a bit register refilled a byte at a time
    rn = rice.size
    rbits = np.int64(rn) * 8
    rp = 0
    acc = np.int64(0)
    have = np.int64(0)
    used = np.int64(0)
    kk = np.int64(rice_k)
    # the rANS reader
    an = rans.size
    # a value step's failure, reported after the positions (and unless their counts say
    # another base)
    failed = 0
    for c in range(emask + 1):  # every context the header lists needs a table
        if expected[c] > 0 and ctx_table[c] < 0:
            failed = -4
    if an < 4 and not failed:
        failed = -5
    x = _rans_state(rans) if an >= 4 else np.int64(0)
    ap = 4
    mask = PROB_SCALE - 1
    ebits = np.int64(extra.size) * 8
    epos = np.int64(0)
    span = np.int64(1) << width
    i = np.int64(-1)
    for lo in range(0, k, GAP_BLOCK):
        hi = min(k, lo + GAP_BLOCK)
        for j in range(lo, hi):
            q, r, rp, acc, have, used = _rice_code(rice, kk, rp, acc, have, used)
            if used > rbits:
                return -1
            if q >= n:  # before the shift, which could wrap
                return -2
            g = (q << kk) | r
            i += g + 1
            if g >= n or i >= n:
                return -2
            index_out[j] = i
        for j in range(lo, hi):
            old_block[j - lo] = old[index_out[j]]
        for j in range(lo, hi):
            o = np.int64(old_block[j - lo])
            c = (o >> shift) & emask
            counts[c] += 1
            index_out[j] += offset
            if failed:
                continue
            t = ctx_table[c]
            if t < 0:
                failed = -4
                continue
            slot = x & mask
            s = _rans_symbol(slot, t, cum, owner)
            f = np.int64(freq[t, s])
            if f == 0:
                failed = -5
                continue
            x = f * (x >> PROB_BITS) + slot - np.int64(cum[t, s])
            while x < RANS_L and ap < an:
                x = (x << 8) | np.int64(rans[ap])
                ap += 1
            if x < RANS_L:
                failed = -5
                continue
            d, epos = _difference(s, extra, epos, ebits, width, top_bits, small)
            if epos < 0:
                failed = -7 if epos == -2 else -6
                continue
            values_out[j] = (o + d) & (span - 1)
    for c in range(emask + 1):
        if counts[c] != expected[c]:
            return -3
    if failed:
        return failed
    if x != RANS_L or ap != an:
        return -5
    return 0


@intrinsic
def _pointer(typingctx, address, like):  # pragma: no cover - jit
    """A pointer to ``like``'s dtype at ``address`` (an integer), for :func:`numba.carray`."""
    sig = types.CPointer(like.dtype)(address, like)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return sig, codegen


@njit(nogil=True, cache=True)
def decode_gap_batch(
    data,
    meta,
    expected,
    ctx_tables,
    freq,
    cum,
    owner,
    like,
    shift,
    emask,
    width,
    top_bits,
    small,
    lo,
    hi,
):  # pragma: no cover - jit
    """Chunks ``lo`` to ``hi`` of a plan of standalone chunks coded by gaps, of any tensors of
    one float format, in one call (one GIL hand-off for the lot). Chunk ``j``'s body lies at
    ``meta[j, 0:4]`` = (offset in ``data``, rice, rans and extra bytes), then ``meta[j, 4:11]``
    = (Rice parameter, first element, elements, changes, address of its base elements, of its
    index output, of its value output). The addresses are of arrays that the caller holds for
    the call and sized by it: its base ``elements`` long (of ``like``'s dtype), its outputs
    ``changes`` long (int64, ``like``'s dtype). Returns ``(0, -1)``, or the first failing
    chunk's status (:func:`decode_gap_chunk`) and number."""
    for j in range(lo, hi):
        off, rl, al, el = meta[j, 0], meta[j, 1], meta[j, 2], meta[j, 3]
        start, count, k = meta[j, 5], meta[j, 6], meta[j, 7]
        old = carray(_pointer(meta[j, 8], like), count)  # type: ignore[call-arg]
        index_out = carray(_pointer(meta[j, 9], meta), k)
        values_out = carray(_pointer(meta[j, 10], like), k)
        status = decode_gap_chunk(
            data[off : off + rl],
            meta[j, 4],
            old,
            shift,
            emask,
            expected[j],
            ctx_tables[j],
            freq,
            cum,
            owner,
            data[off + rl : off + rl + al],
            data[off + rl + al : off + rl + al + el],
            width,
            top_bits,
            small,
            index_out,
            values_out,
            start,
        )
        if status < 0:
            return status, j
    return 0, -1


@njit(nogil=True, cache=True, inline="always")
def _varint(buf, p):  # pragma: no cover - jit
    """The varint at byte ``p`` of ``buf`` and the byte after it; ``p`` is -1 if ``buf`` ends
    inside it or it runs past 63 bits."""
    v = np.int64(0)
    shift = 0
    while True:
        if p >= buf.size or shift > 63:
            return np.int64(0), -1
        b = np.int64(buf[p])
        p += 1
        v |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return v, p


@njit(nogil=True, cache=True, inline="always")
def _header_error(status, detail, alphabet):  # pragma: no cover - jit
    """:func:`read_gap_header`'s answer when it reads no header: ``status`` and ``detail``,
    empty arrays for the rest."""
    empty = np.zeros(0, np.int64)
    return (
        status,
        detail,
        0,
        empty,
        empty,
        np.zeros(0, np.bool_),
        np.zeros((0, alphabet), np.int64),
    )


@njit(cache=True)  # holds the GIL: a few dozen bytes, less than a hand-off costs
def read_gap_header(buf, n_exp, alphabet, max_rice):  # pragma: no cover - jit
    """A chunk header coded by gaps (``2 C + 1``, the Rice parameter, C x (context gap,
    2 changes + own), then each own table: its symbols, then (symbol gap, frequency) pairs),
    read and checked in one call: ``(status, detail, rice, context ids, changes, own, own
    tables)``. Status 0; 1 if the header is not coded by gaps (nothing read); -1 if it ends
    early or holds a malformed number; -2 if it is malformed; -3 if a table lists ``detail``
    symbols; -4 if a table entry is out of range; -5 if a table does not sum to
    ``PROB_SCALE``; -6 if ``detail`` bytes follow it."""
    first, p = _varint(buf, 0)
    if p < 0:
        return _header_error(-1, 0, alphabet)
    if not first & 1:
        return _header_error(1, 0, alphabet)
    n_present = first >> 1
    rice, p = _varint(buf, p)
    if p < 0:
        return _header_error(-1, 0, alphabet)
    if rice > max_rice or n_present > n_exp:
        return _header_error(-2, 0, alphabet)
    ids = np.empty(n_present, np.int64)
    changes = np.empty(n_present, np.int64)
    own = np.zeros(n_present, np.bool_)
    c = np.int64(-1)
    n_own = 0
    for i in range(n_present):
        gap, p = _varint(buf, p)
        if p < 0:
            return _header_error(-1, 0, alphabet)
        v, p = _varint(buf, p)
        if p < 0:
            return _header_error(-1, 0, alphabet)
        if gap >= n_exp or v < 2 or v >> 1 > MAX_CHANGES:  # checked before any sum can wrap
            return _header_error(-2, 0, alphabet)
        c += gap + 1
        if c >= n_exp:
            return _header_error(-2, 0, alphabet)
        ids[i] = c
        changes[i] = v >> 1
        own[i] = (v & 1) == 1
        n_own += v & 1
    tables = np.zeros((n_own, alphabet), np.int64)
    for t in range(n_own):
        nnz, p = _varint(buf, p)
        if p < 0:
            return _header_error(-1, 0, alphabet)
        if not 0 < nnz <= alphabet:
            return _header_error(-3, nnz, alphabet)
        s = np.int64(-1)
        total = np.int64(0)
        for _ in range(nnz):
            gap, p = _varint(buf, p)
            if p < 0:
                return _header_error(-1, 0, alphabet)
            f, p = _varint(buf, p)
            if p < 0:
                return _header_error(-1, 0, alphabet)
            if gap >= alphabet:
                return _header_error(-4, 0, alphabet)
            s += gap + 1
            if s >= alphabet or not 0 < f <= PROB_SCALE:
                return _header_error(-4, 0, alphabet)
            tables[t, s] = f
            total += f
        if total != PROB_SCALE:
            return _header_error(-5, 0, alphabet)
    if p != buf.size:
        return _header_error(-6, buf.size - p, alphabet)
    return 0, 0, rice, ids, changes, own, tables
