"""Entropy models of the compact format, shared by its encoder and decoder (pure numpy).

* value differences -> symbols (+ raw extra bits) and back;
* the Rice parameter of a context, from integers only, so both sides always agree;
* rANS frequency tables: quantization, cost estimates, and their varint serialization.
"""

from __future__ import annotations

import numpy as np

from deltarl.weightsync.codec import kernels
from deltarl.weightsync.errors import CorruptDeltaError

TOP_BITS = 3  # bits after the leading one of a large |diff| that are entropy-coded
ALPHABET = 16 + 2 * 29 * (1 << TOP_BITS)  # small diffs + sign x bit length (4..32) x top bits
SMALL = 8  # |diff| <= SMALL gets a symbol of its own


def _bitlen(a: np.ndarray) -> np.ndarray:
    """Bit length of positive int64 values below 2**53 (exact through frexp)."""
    return np.frexp(a.astype(np.float64))[1].astype(np.int64)


def wrapped_diff(new: np.ndarray, old: np.ndarray, width: int) -> np.ndarray:
    """``new - old`` as signed ``width``-bit integers (int64)."""
    span = 1 << width
    d = (new.astype(np.int64) - old.astype(np.int64)) & (span - 1)
    return np.where(d >= span // 2, d - span, d)


def diff_to_symbols(d: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Map non-zero diffs to (symbol, extra-bit value, extra-bit width).

    ``|d| <= 8``: symbol ``2 (|d| - 1) + sign``. Larger: the bit length L of ``|d|`` and the
    ``TOP_BITS`` bits after its leading one form the symbol
    ``16 + 2 (2**TOP_BITS (L - 4) + top) + sign``; the remaining ``L - 1 - TOP_BITS`` low bits
    are sent raw.
    """
    d = np.ascontiguousarray(d, dtype=np.int64)
    sym = np.empty(d.size, np.int64)
    extra = np.empty(d.size, np.int64)
    width = np.empty(d.size, np.int64)
    kernels.diff_symbols(d, TOP_BITS, SMALL, sym, extra, width)
    return sym, extra, width


def rice_parameter(n: np.ndarray, coded: np.ndarray) -> np.ndarray:
    """Near-optimal Rice parameter for ``coded`` geometric gaps among ``n`` elements.

    k = round(log2(mean_gap * ln 2)), computed in integers so encoder and decoder always agree.
    """
    n = n.astype(np.int64)
    coded = np.maximum(coded.astype(np.int64), 1)
    v = ((n - coded) * 64241) // (coded * 65536)
    return np.maximum(_bitlen(np.maximum(v, 1)) - 1, 0) * (v > 0)


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


def coding_cost_bits(counts: np.ndarray, freq: np.ndarray) -> np.ndarray:
    """Bits to code ``counts`` (rows) under quantized ``freq`` (rows); inf where impossible."""
    with np.errstate(divide="ignore", invalid="ignore"):
        per = kernels.PROB_BITS - np.log2(freq.astype(np.float64))
        cost = np.where(counts > 0, counts * per, 0.0)
    return cost.sum(axis=-1)


def entropy_bits(counts: np.ndarray) -> np.ndarray:
    """Empirical entropy of each row of ``counts``, in total bits."""
    total = counts.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        cost = np.where(counts > 0, counts * np.log2(total / np.maximum(counts, 1)), 0.0)
    return cost.sum(axis=-1)


def varints(values: list[int]) -> bytes:
    out = bytearray()
    for v in values:
        if v < 0:
            raise ValueError("varints are unsigned")
        while True:
            b = v & 0x7F
            v >>= 7
            if v:
                out.append(b | 0x80)
            else:
                out.append(b)
                break
    return bytes(out)


class VarintReader:
    """Reads varints from untrusted bytes; any overrun is a :class:`CorruptDeltaError`."""

    def __init__(self, data: bytes | memoryview, what: str) -> None:
        self.data = bytes(data)
        self.pos = 0
        self.what = what

    def varint(self) -> int:
        v = shift = 0
        while True:
            if self.pos >= len(self.data) or shift > 63:
                raise CorruptDeltaError(f"{self.what} ends early or holds a malformed number")
            b = self.data[self.pos]
            self.pos += 1
            v |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return v

    def done(self) -> None:
        if self.pos != len(self.data):
            raise CorruptDeltaError(f"{self.what} has {len(self.data) - self.pos} unexpected bytes")


def table_bytes(freq: np.ndarray) -> bytes:
    nz = np.flatnonzero(freq)
    vals = [int(nz.size)]
    prev = -1
    for s in nz.tolist():
        vals += [s - prev - 1, int(freq[s])]
        prev = s
    return varints(vals)


def read_table(r: VarintReader) -> np.ndarray:
    freq = np.zeros(ALPHABET, np.int64)
    nnz = r.varint()
    if not 0 < nnz <= ALPHABET:
        raise CorruptDeltaError(f"{r.what}: frequency table with {nnz} symbols")
    s = -1
    for _ in range(nnz):
        s += r.varint() + 1
        f = r.varint()
        if s >= ALPHABET or not 0 < f <= kernels.PROB_SCALE:
            raise CorruptDeltaError(f"{r.what}: frequency table entry out of range")
        freq[s] = f
    if int(freq.sum()) != kernels.PROB_SCALE:
        raise CorruptDeltaError(f"{r.what}: frequency table does not sum to 2**{kernels.PROB_BITS}")
    return freq


def cumulative(freq: np.ndarray) -> np.ndarray:
    cum = np.zeros_like(freq)
    cum[:, 1:] = np.cumsum(freq, axis=1)[:, :-1]
    return cum
