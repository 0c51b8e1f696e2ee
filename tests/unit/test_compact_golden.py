"""The compact encoder's bytes do not change when its internals are sped up.

The digests below pin the bytes of format version 3, positions by context rank and as gaps; a
faster encoder must produce the same bytes for the same delta, so receivers and stored deltas
are unaffected. Objects of versions 1 and 2 (kept in ``data/``) must still decode. The two
kernels are also checked against the numpy code they replaced, kept below as the
specification."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard

from deltarl.weightsync import apply_delta, compute_delta
from deltarl.weightsync.codec import kernels
from deltarl.weightsync.codec.compact import MAGIC, decode_compact, encode_compact, read_footer
from deltarl.weightsync.codec.entropy import SMALL, TOP_BITS, diff_to_symbols


def _state() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    old = {
        "a": (torch.randn(300, 257, generator=g) * 0.02).to(torch.bfloat16),
        "b": (torch.randn(5000, generator=g)).to(torch.float16),
        "c": (torch.randn(64, 65, generator=g) * 3).to(torch.float32),
    }
    new = {}
    for k, t in old.items():
        f = t.double()
        m = torch.rand(f.shape, generator=g)
        f = f + torch.randn(f.shape, generator=g, dtype=torch.float64) * f.abs() * 0.02 * (m < 0.1)
        f = torch.where(m > 0.995, f * 1000, f)  # large jumps: symbols with extra bits
        new[k] = f.to(t.dtype)
    new["b"][:2000] = old["b"][:2000] + 1  # a dense region: contexts coded by complement
    return old, new


GOLDEN = {  # format version 3: (chunk elements, positions) -> content digest
    (1 << 24, "contexts"): "de71b1d1f46a84e9ab9d75a7152851dde1803ac813f7f3207ba2e5852d79866a",
    (1000, "contexts"): "a7bea29c97e6493a9a19a5da85a1926af9b253af8c6ea195e24859c717558e7b",
    (1 << 24, "gaps"): "bda7e3930c5649cbc92435fde693a4e93d6c5e2885e207878ea3c89bb6f8151f",
    (1000, "gaps"): "387206aba3fa8979a4bfbd330bce00211a0983f87527884ec8278817c919a914",
}
DATA = Path(__file__).parent / "data"
# the same delta at 1000-element chunks, written by the encoders of format versions 1 and 2
OLD_OBJECTS = {1: DATA / "compact-v1.dlt", 2: DATA / "compact-v2.dlt"}


def content_digest(blob: bytes) -> str:
    """SHA-256 of what a receiver decodes: the chunk bodies, the index (decompressed) and the
    footer (parsed), without the index's compressed length and checksum. The zstd level of
    the index and footer is the encoder's choice (3 now, 19 before: ~0.2 s less
    per object, < 1 KB bigger); what they hold is pinned."""
    footer = read_footer(blob)
    off, length, raw_len, _ = footer["index"]
    index = zstandard.ZstdDecompressor().decompress(blob[off : off + length], raw_len)
    h = hashlib.sha256(blob[len(MAGIC) : off])
    h.update(index)
    h.update(json.dumps({**footer, "index": [off, raw_len]}, sort_keys=True).encode())
    return h.hexdigest()


@pytest.mark.parametrize(("chunk_elems", "positions"), sorted(GOLDEN))
def test_encoder_bytes_are_unchanged(chunk_elems: int, positions: str) -> None:
    old, new = _state()
    d = compute_delta(old, new, 3, 4)
    blob = encode_compact(d, old, chunk_elems=chunk_elems, threads=2, positions=positions)
    assert content_digest(blob) == GOLDEN[(chunk_elems, positions)]


@pytest.mark.parametrize("version", sorted(OLD_OBJECTS))
def test_objects_of_earlier_versions_still_decode(version: int) -> None:
    """Objects of format versions 1 (no Rice parameters in its chunk headers: the decoder
    counts the base's elements per context to derive them) and 2 (every chunk by context rank,
    its header without the positions flag) decode to the same delta."""
    old, new = _state()
    blob = OLD_OBJECTS[version].read_bytes()
    assert read_footer(blob)["format_version"] == version
    got = decode_compact(blob, old)
    want = decode_compact(encode_compact(compute_delta(old, new, 3, 4), old), old)
    assert (got.base_version, got.version) == (3, 4)
    for name, p in want.patches.items():
        q = got.patches[name]
        assert np.array_equal(p.index, q.index) and np.array_equal(p.value, q.value), name
    state = {k: v.clone() for k, v in old.items()}
    apply_delta(state, got)
    assert all(torch.equal(state[k].view(torch.uint8), new[k].view(torch.uint8)) for k in new)


def _reference_symbols(d: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The numpy mapping the compiled kernel replaced (kept here as the specification)."""
    a = np.abs(d)
    neg = (d < 0).astype(np.int64)
    small = a <= SMALL
    length = np.maximum(np.frexp(np.maximum(a, 1).astype(np.float64))[1].astype(np.int64), 4)
    width = np.where(small, 0, length - 1 - TOP_BITS)
    top = (a >> width) & ((1 << TOP_BITS) - 1)
    sym = np.where(small, 2 * (a - 1) + neg, 16 + 2 * ((length - 4) << TOP_BITS | top) + neg)
    extra = np.where(small, 0, a & ((np.int64(1) << width) - 1))
    return sym.astype(np.int64), extra.astype(np.int64), width.astype(np.int64)


def test_symbol_kernel_matches_the_numpy_mapping() -> None:
    rng = np.random.default_rng(0)
    edges = [1, -1, 8, -8, 9, -9, 15, 16, 17, 255, 256, -(2**15), 2**15 - 1, 2**31 - 1, -(2**31)]
    d = np.concatenate(
        [
            np.array(edges, np.int64),
            rng.integers(-(2**31), 2**31, 20000),
            rng.integers(-40, 40, 20000),
        ]
    )
    d = d[d != 0]
    for got, want in zip(diff_to_symbols(d), _reference_symbols(d), strict=True):
        assert got.dtype == want.dtype and np.array_equal(got, want)


def _reference_gaps(
    ctx: np.ndarray, rank: np.ndarray, hist: np.ndarray, comp: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The numpy position stream the compiled kernel replaced (kept here as the specification)."""
    order = np.argsort(ctx, kind="stable")
    c_sorted, r_sorted = ctx[order], rank[order]
    keep = ~comp[c_sorted]
    gap_ctx, gap_rank = [c_sorted[keep]], [r_sorted[keep]]
    for c in np.flatnonzero(comp):
        unchanged = np.ones(int(hist[c]), bool)
        unchanged[rank[ctx == c]] = False
        gap_ctx.append(np.full(int(unchanged.sum()), c, np.int64))
        gap_rank.append(np.flatnonzero(unchanged).astype(np.int64))
    gc, gr = np.concatenate(gap_ctx), np.concatenate(gap_rank)
    o2 = np.argsort(gc, kind="stable")
    gc, gr = gc[o2], gr[o2]
    prev = np.empty_like(gr)
    if gr.size:
        prev[0] = -1
        prev[1:] = gr[:-1]
        prev[np.flatnonzero(np.diff(gc)) + 1] = -1
    return gr - prev - 1, gc


@pytest.mark.parametrize("density", [0.0, 0.001, 0.05, 0.6, 1.0])
@pytest.mark.parametrize("nctx", [32, 256, 512])
def test_position_gap_kernel_matches_the_numpy_stream(density: float, nctx: int) -> None:
    rng = np.random.default_rng(int(density * 1000) + nctx)
    n = 20000
    keys = (rng.standard_normal(n) * 4).astype(np.int64) % nctx  # uneven contexts
    index = np.flatnonzero(rng.random(n) < density).astype(np.int64)
    hist = np.zeros(nctx, np.int64)
    ctx = np.empty(index.size, np.int64)
    rank = np.empty(index.size, np.int64)
    kernels.scan_contexts(keys, index, 0, nctx - 1, hist, ctx, rank)
    kc = np.bincount(ctx, minlength=nctx)
    comp = 2 * kc > hist
    if 0 < density < 1:
        assert comp.any() == (density > 0.5)
    coded = np.where(comp, hist - kc, kc)
    gaps = np.empty(int(coded.sum()), np.int64)
    gc = np.empty(gaps.size, np.int64)
    assert kernels.position_gaps(ctx, rank, hist, kc, comp, np.arange(nctx), gaps, gc) == gaps.size
    want_gaps, want_gc = _reference_gaps(ctx, rank, hist, comp)
    assert np.array_equal(gaps, want_gaps) and np.array_equal(gc, want_gc)
